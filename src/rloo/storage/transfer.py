"""Upload and download of whole directories with a manifest, so readers never see half-written data.

Protocol (the same for ``s3://`` and local paths):

upload
    1. hash every local file (the manifest is built before anything is sent);
    2. delete the prefix's old manifest, if any: from here on readers refuse the prefix;
    2b. abort what an earlier, killed run of the same upload left open (multipart uploads, temp files);
    3. send the files (boto3 managed transfers: multipart, parallel, botocore retries);
    4. list the prefix and check every file is there with its size;
    5. write the manifest, last, in one atomic PutObject (or rename).
    An upload interrupted anywhere before 5 leaves a prefix without a manifest, which readers refuse.

read
    A prefix is complete when its manifest parses and every listed file exists with the listed size;
    ``download_dir`` also checks every SHA-256 and only then moves the directory into place.

Objects under the prefix that the manifest does not list are ignored (never deleted): a model prefix may
hold nested ``checkpoint-N`` prefixes of its own. Concurrent writers to one prefix are not supported.

atomic publish (:func:`publish_atomic`, for a location readers use while it is replaced, e.g. production)
    Upload deletes the manifest first, so between steps 2 and 5 the prefix has no readable version at all,
    and a writer killed there leaves it so until a re-run. Instead: upload the new version, complete with
    its own manifest, under a fresh ``<prefix>/versions/<id>/``; then replace ``<prefix>/_MANIFEST.json``
    by a *pointer manifest* (the same file list plus ``root: versions/<id>``) in one atomic PutObject or
    rename; then delete everything under the prefix the pointer does not cover (older versions, the files of
    a killed publish, flat files of the old layout). Readers follow ``root``, so they see the complete old
    version or the complete new one, never a mix.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Sequence
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from rloo.errors import UserError
from rloo.storage.backends import LocalBackend, S3Backend, backend_for
from rloo.storage.errors import IncompleteArtifactError, StorageError
from rloo.storage.location import Location
from rloo.storage.manifest import (
    MANIFEST_NAME,
    TEMP_PREFIX,
    Manifest,
    build_manifest,
    verify_local,
    write_manifest_file,
)
from rloo.storage.progress import Progress

log = logging.getLogger(__name__)


def upload_dir(
    local_dir: str | os.PathLike[str],
    uri: str | os.PathLike[str] | Location,
    *,
    progress: bool = True,
    exclude: Sequence[str] = (),
    client: Any = None,
    transfer_config: Any = None,
) -> Manifest:
    """Publish ``local_dir`` at ``uri`` (manifest written last) and return the manifest.

    ``exclude`` holds globs matched against relative paths (``"mlruns"``, ``"*.tmp"``). ``progress`` shows a
    bar for transfers of 64 MiB or more. Raises StorageError (one line) when the storage refuses or the
    retry budget is spent; the prefix is then left without a manifest, which readers refuse.
    """
    src = Path(local_dir)
    if not src.is_dir():
        raise UserError(f"cannot upload {src}: it is not a directory.")
    loc = Location.parse(uri)
    if loc.is_local and loc.path.resolve() == src.resolve():
        manifest = build_manifest(src, exclude)  # publishing a directory in place: seal it
        write_manifest_file(src, manifest)
        return manifest
    if loc.is_local and loc.path.resolve().is_relative_to(src.resolve()):
        raise UserError(f"cannot upload {src} into {loc.path}: the destination is inside the source.")
    manifest = build_manifest(src, exclude)
    backend = backend_for(loc, client, transfer_config)
    backend.check_access(create=True)
    backend.delete(MANIFEST_NAME)
    # What a killed earlier run of this upload left half-sent (open multipart uploads, temp files): gone
    # before this run sends anything, so the bucket does not keep paying for parts nobody will complete.
    stale = backend.abort_incomplete()
    if stale:
        log.info("%s: cleaned up %d incomplete transfer(s) of an earlier interrupted upload", loc.uri, stale)
    items = [(src / f.path, f.path, f.sha256) for f in manifest.files]
    with Progress(manifest.total_bytes, f"upload {loc.name or loc.uri}", progress) as bar:
        backend.put_files(items, bar)
    problems = _mismatches(manifest, backend.sizes())
    if problems:
        raise StorageError(
            f"upload to {backend.describe()} did not verify ({problems}); nothing was published (no manifest): "
            "upload again."
        )
    backend.write_bytes(MANIFEST_NAME, manifest.to_json().encode())
    return manifest


VERSIONS_DIR = "versions"


def publish_atomic(
    local_dir: str | os.PathLike[str],
    uri: str | os.PathLike[str] | Location,
    *,
    progress: bool = True,
    client: Any = None,
    transfer_config: Any = None,
) -> Manifest:
    """Replace what ``uri`` holds by ``local_dir`` so that readers always see a complete version (see the
    module docstring: versioned sub-prefix, pointer manifest written last, old versions deleted after).
    Returns the pointer manifest (its ``root`` names the version)."""
    src = Path(local_dir)
    loc = Location.parse(uri)
    if loc.is_local and loc.path.resolve().is_relative_to(src.resolve()):
        raise UserError(f"cannot publish {src} into {loc.path}: the destination is inside the source.")
    backend = backend_for(loc, client, transfer_config)
    backend.check_access(create=True)
    shared = backend.client if isinstance(backend, S3Backend) else None
    # Parts and temp files of a killed earlier publish (under its own versions/<id>/) go before anything
    # is sent; their complete files go in the clean-up below.
    stale = backend.abort_incomplete()
    if stale:
        log.info("%s: cleaned up %d incomplete transfer(s) of an earlier interrupted publish", loc.uri, stale)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    root = f"{VERSIONS_DIR}/{stamp}-{uuid.uuid4().hex[:8]}"
    manifest = upload_dir(
        src, loc.child(root), progress=progress, client=shared, transfer_config=transfer_config
    )
    pointer = dataclasses.replace(manifest, root=root)
    backend.write_bytes(MANIFEST_NAME, pointer.to_json().encode())  # the switch: one atomic write
    backend.delete_all_but(MANIFEST_NAME, root + "/")
    return pointer


def read_manifest(uri: str | os.PathLike[str] | Location, *, client: Any = None) -> Manifest:
    """The manifest of a published prefix; IncompleteArtifactError if there is none or it is invalid."""
    loc = Location.parse(uri)
    return _read_manifest(backend_for(loc, client))


def _read_manifest(backend: LocalBackend | S3Backend) -> Manifest:
    data = backend.read_bytes(MANIFEST_NAME)
    if data is None:
        backend.check_access(create=False)  # a missing bucket should say so, not "no manifest"
        raise IncompleteArtifactError(
            f"{backend.describe()} has no {MANIFEST_NAME}: it is not a complete upload (interrupted, still "
            "being written, or not written by rloo); upload the directory again or point to a complete one."
        )
    return Manifest.from_json(data, backend.loc.uri)


def _data_backend(backend: LocalBackend | S3Backend, manifest: Manifest) -> LocalBackend | S3Backend:
    """Where the files of ``manifest`` are: next to it, or below its ``root`` for a pointer manifest."""
    if not manifest.root:
        return backend
    if isinstance(backend, S3Backend):
        return S3Backend(backend.loc.child(manifest.root), backend.client, backend.transfer_config)
    return LocalBackend(backend.loc.child(manifest.root))


def _mismatches(manifest: Manifest, sizes: dict[str, int]) -> str:
    missing = [f.path for f in manifest.files if f.path not in sizes]
    wrong = [
        f"{f.path} ({sizes[f.path]} bytes, expected {f.size})"
        for f in manifest.files
        if sizes.get(f.path, f.size) != f.size
    ]
    parts = []
    if missing:
        parts.append(f"missing: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    if wrong:
        parts.append(f"wrong size: {', '.join(wrong[:5])}{' ...' if len(wrong) > 5 else ''}")
    return "; ".join(parts)


def verify_prefix(uri: str | os.PathLike[str] | Location, *, client: Any = None) -> Manifest:
    """Check a prefix is complete (manifest present, every file there with its size) without downloading.

    Returns the manifest; raises IncompleteArtifactError saying what is wrong otherwise.
    """
    backend = backend_for(Location.parse(uri), client)
    manifest = _read_manifest(backend)
    problems = _mismatches(manifest, _data_backend(backend, manifest).sizes())
    if problems:
        raise IncompleteArtifactError(
            f"{backend.describe()} does not match its manifest ({problems}): it was modified or damaged after it "
            "was published; upload the directory again."
        )
    return manifest


def is_complete(uri: str | os.PathLike[str] | Location, *, client: Any = None) -> bool:
    """True when ``uri`` is a complete upload. Credential, bucket and endpoint errors still raise."""
    try:
        verify_prefix(uri, client=client)
    except IncompleteArtifactError:
        return False
    return True


def download_dir(
    uri: str | os.PathLike[str] | Location,
    local_dir: str | os.PathLike[str],
    *,
    progress: bool = True,
    overwrite: bool = False,
    client: Any = None,
    transfer_config: Any = None,
) -> Manifest:
    """Download a published prefix into ``local_dir``, verify every SHA-256, then move it into place.

    ``local_dir`` appears only complete and verified (with its manifest). If it already holds a verified copy
    of the same manifest, nothing is transferred. An existing different ``local_dir`` is an error unless
    ``overwrite``.
    """
    loc = Location.parse(uri)
    backend = backend_for(loc, client, transfer_config)
    manifest = _read_manifest(backend)
    dest = Path(local_dir)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        if _is_verified_copy(dest, manifest):
            return manifest
        if not overwrite:
            raise UserError(
                f"cannot download {loc.uri} into {dest}: it exists and is not a verified copy; remove it or "
                "choose another directory."
            )
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f"{TEMP_PREFIX}{dest.name}.partial-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        items = [(f.path, tmp / f.path) for f in manifest.files]
        with Progress(manifest.total_bytes, f"download {loc.name or loc.uri}", progress) as bar:
            _data_backend(backend, manifest).get_files(items, bar)
        verify_local(tmp, manifest, loc.uri)
        # the local copy holds the files next to its manifest, whatever the layout of the source
        manifest = dataclasses.replace(manifest, root="")
        write_manifest_file(tmp, manifest)
        _swap_into_place(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def _is_verified_copy(dest: Path, manifest: Manifest) -> bool:
    local = dest / MANIFEST_NAME
    if not dest.is_dir() or not local.is_file():
        return False
    try:
        if Manifest.from_json(local.read_text(), str(dest)).by_path != manifest.by_path:
            return False
        verify_local(dest, manifest, str(dest))
    except IncompleteArtifactError:
        return False
    return True


def _swap_into_place(tmp: Path, dest: Path) -> None:
    old = None
    if dest.exists() or dest.is_symlink():
        old = dest.parent / f"{TEMP_PREFIX}{dest.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(dest, old)
    os.replace(tmp, dest)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def _natural_key(name: str) -> list[Any]:
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", name) if t]


def list_complete_prefixes(
    uri_parent: str | os.PathLike[str] | Location, pattern: str = "checkpoint-*", *, client: Any = None
) -> list[str]:
    """URIs of the complete child prefixes of ``uri_parent`` whose names match ``pattern``, oldest first.

    Ordered by the numbers in their names (``checkpoint-9`` before ``checkpoint-10``), so the last one is the
    newest complete checkpoint to resume from. Incomplete prefixes (interrupted uploads) are left out.
    """
    parent = Location.parse(uri_parent)
    backend = backend_for(parent, client)
    names = sorted((n for n in backend.children() if fnmatchcase(n, pattern)), key=_natural_key)
    shared = backend.client if isinstance(backend, S3Backend) else None
    # Answer in the caller's style: plain paths for a plain path, URIs for a URI.
    plain = parent.is_local and not str(uri_parent).startswith("file://")
    return [
        str(parent.child(n).path) if plain else parent.child(n).uri
        for n in names
        if is_complete(parent.child(n), client=shared)
    ]


def latest_complete_prefix(
    uri_parent: str | os.PathLike[str] | Location, pattern: str = "checkpoint-*", *, client: Any = None
) -> str | None:
    """The newest complete child prefix matching ``pattern`` (see list_complete_prefixes), or None."""
    found = list_complete_prefixes(uri_parent, pattern, client=client)
    return found[-1] if found else None


def delete_prefix(uri: str | os.PathLike[str] | Location, *, client: Any = None) -> None:
    """Delete a prefix: its manifest first (readers stop accepting it at once), then everything under it."""
    loc = Location.parse(uri)
    if (loc.is_s3 and not loc.key) or (loc.is_local and loc.path == loc.path.parent):
        raise UserError(
            f"refusing to delete {loc.uri}: give a prefix, not a whole bucket or filesystem root."
        )
    backend = backend_for(loc, client)
    backend.delete(MANIFEST_NAME)
    backend.delete_tree()


def read_published_file(
    uri: str | os.PathLike[str] | Location, rel: str, *, client: Any = None
) -> bytes | None:
    """One file of a published prefix, as its manifest names it (below the version a pointer manifest names),
    checked against the manifest's SHA-256; None when the prefix has no manifest or the manifest lists no such
    file. IncompleteArtifactError when the file is missing or its bytes do not match."""
    backend = backend_for(Location.parse(uri), client)
    try:
        manifest = _read_manifest(backend)
    except IncompleteArtifactError:
        return None
    entry = manifest.by_path.get(rel)
    if entry is None:
        return None
    data = _data_backend(backend, manifest).read_bytes(rel)
    if data is None or hashlib.sha256(data).hexdigest() != entry.sha256:
        raise IncompleteArtifactError(
            f"{backend.describe()}: {rel} {'is missing' if data is None else 'does not match its manifest'} (it "
            "was modified or damaged after it was published); publish the directory again."
        )
    return data
