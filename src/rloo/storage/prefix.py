"""Reading a prefix whoever wrote it: an rloo upload (its ``_MANIFEST.json`` lists every file's SHA-256) or
plain objects written by ``aws s3 cp``, Spark or ``datasets.Dataset.to_parquet``.

A prefix with a manifest is read as :func:`rloo.storage.download_dir` reads it: every SHA-256 checked, a
damaged upload refused. A prefix without one is read as listed: the chosen objects are downloaded, their
sizes checked against the listing, and the prefix is listed again after the download, so that objects
replaced meanwhile (a writer still at work) fail the read (exit 75: a retry may heal it) instead of mixing
two versions. Either way the result records each file's key, size, ETag (S3's, as listed: an MD5 of the
bytes only for single-part uploads without SSE-KMS, so it is recorded, never checked) and the SHA-256 of
the bytes read.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rloo.storage.backends import LocalBackend, S3Backend, backend_for
from rloo.storage.errors import IncompleteArtifactError, StorageError, StorageUnavailable
from rloo.storage.location import Location
from rloo.storage.manifest import (
    MANIFEST_NAME,
    TEMP_PREFIX,
    FileEntry,
    Manifest,
    sha256_file,
    write_manifest_file,
)
from rloo.storage.progress import Progress
from rloo.storage.transfer import _data_backend, _read_manifest, _swap_into_place, download_dir

log = logging.getLogger(__name__)

# Beside a cached copy: the listing it was read from, so that a later read of an unchanged prefix reuses it.
# A hidden name: neither a model loader nor the dataset resolver reads it.
SOURCE_RECORD = f"{TEMP_PREFIX}source.json"

Select = Callable[[Sequence[str]], Sequence[str]]


@dataclass(frozen=True)
class ReadFile:
    """One file as it was read: ``path`` relative to the prefix, ``key`` the object's key in its bucket (the
    absolute path for a local source), ``etag`` the store's ETag (None for a local source)."""

    path: str
    size: int
    sha256: str
    etag: str | None = None
    key: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class ReadPrefix:
    """What a read of ``uri`` fetched; ``manifest``: checked against the prefix's manifest (SHA-256 of every
    file), else read as listed (sizes checked, the listing unchanged through the read)."""

    uri: str
    files: tuple[ReadFile, ...]
    manifest: bool


def list_objects(uri: str | Location, *, client: Any = None) -> dict[str, tuple[int, str | None]]:
    """Every object below ``uri``: path relative to it -> (size, ETag). Zero-byte ``dir/`` markers (what
    consoles create for folders) are left out. A missing bucket or bad credentials raise StorageError (exit 2),
    an unreachable store StorageUnavailable (75); an empty prefix is an empty dict."""
    backend = backend_for(Location.parse(uri), client)
    listed = backend.listing()
    if not listed:
        backend.check_access(create=False)  # a missing bucket should say so, not "nothing there"
    return {rel: v for rel, v in listed.items() if rel and not rel.endswith("/")}


def _key(loc: Location, rel: str) -> str:
    return loc.object_key(rel) if loc.is_s3 else str(loc.path / rel)


def _safe(rel: str) -> bool:
    """Whether an object's relative key can be stored as a file below a directory (no ``..``, no ``//``)."""
    parts = rel.split("/")
    return not rel.startswith("/") and all(p not in ("", ".", "..") for p in parts)


def fetch_prefix(
    uri: str | Location,
    local_dir: str | os.PathLike[str],
    *,
    select: Select | None = None,
    progress: bool = False,
    client: Any = None,
    transfer_config: Any = None,
) -> ReadPrefix:
    """Download ``uri`` into ``local_dir`` (replaced; it appears only complete), with or without a manifest
    (see the module docstring). ``select`` picks the objects of a prefix without a manifest from their
    relative paths (default: all but our own temporary names); an upload with a manifest is read whole, as
    published. The local copy gets a manifest of what was read, so it is a verified local directory too."""
    loc = Location.parse(uri)
    backend = backend_for(loc, client, transfer_config)
    dest = Path(local_dir)
    listed = list_objects(loc, client=_client(backend))
    if MANIFEST_NAME in listed:
        published = _read_manifest(backend)
        download_dir(loc, dest, progress=progress, overwrite=True, client=_client(backend))
        return ReadPrefix(loc.uri, _manifested_files(loc, backend, published), manifest=True)
    if not listed:
        raise IncompleteArtifactError(
            f"{backend.describe()}: no objects under this prefix: check the URI (keys are case-sensitive)."
        )
    chosen = _choose(listed, select)
    if not chosen:
        raise IncompleteArtifactError(f"{backend.describe()}: none of its objects is one to read.")
    unsafe = [r for r in chosen if not _safe(r)]
    if unsafe:
        raise StorageError(
            f"{backend.describe()}: object key {unsafe[0]!r} cannot be stored as a local file ('..', '.' or an "
            "empty segment); rename it."
        )
    tmp = dest.parent / f"{TEMP_PREFIX}{dest.name}.partial-{uuid.uuid4().hex[:8]}"
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        _download_as_listed(backend, loc, chosen, listed, tmp, progress)
        with ThreadPoolExecutor(max_workers=4) as pool:
            digests = list(pool.map(lambda rel: sha256_file(tmp / rel), chosen))
        files = tuple(
            ReadFile(rel, listed[rel][0], sha, listed[rel][1], _key(loc, rel))
            for rel, sha in zip(chosen, digests, strict=True)
        )
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        write_manifest_file(tmp, Manifest(tuple(FileEntry(f.path, f.size, f.sha256) for f in files), stamp))
        (tmp / SOURCE_RECORD).write_text(json.dumps(_signature(loc.uri, listed)))
        _swap_into_place(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ReadPrefix(loc.uri, files, manifest=False)


def _client(backend: LocalBackend | S3Backend) -> Any:
    return backend.client if isinstance(backend, S3Backend) else None


def _choose(listed: dict[str, tuple[int, str | None]], select: Select | None) -> list[str]:
    names = sorted(listed)
    if select is not None:
        return list(select(names))
    return [r for r in names if not any(part.startswith(TEMP_PREFIX) for part in r.split("/"))]


def _manifested_files(
    loc: Location, backend: LocalBackend | S3Backend, manifest: Manifest
) -> tuple[ReadFile, ...]:
    """The files of a published prefix as read: the manifest's sizes and SHA-256s, the store's ETags and keys
    (below the ``root`` a pointer manifest names)."""
    stored = _data_backend(backend, manifest).listing()
    below = f"{manifest.root}/" if manifest.root else ""
    return tuple(
        ReadFile(f.path, f.size, f.sha256, stored.get(f.path, (0, None))[1], _key(loc, below + f.path))
        for f in manifest.files
    )


def _download_as_listed(
    backend: LocalBackend | S3Backend,
    loc: Location,
    chosen: list[str],
    listed: dict[str, tuple[int, str | None]],
    tmp: Path,
    progress: bool,
) -> None:
    """Download ``chosen`` into ``tmp``; refuse a prefix whose chosen objects changed during the read, and
    sizes that differ from the listing (exit 75: the writer may still be at work, a retry may heal)."""
    total = sum(listed[r][0] for r in chosen)
    try:
        with Progress(total, f"download {loc.name or loc.uri}", progress) as bar:
            backend.get_files([(rel, tmp / rel) for rel in chosen], bar)
    except StorageUnavailable:
        raise
    except StorageError:  # a vanished object: changed under us (75), or truly refused (raised as it is)
        _refuse_if_changed(backend, chosen, listed)
        raise
    _refuse_if_changed(backend, chosen, listed)
    for rel in chosen:
        got = (tmp / rel).stat().st_size
        if got != listed[rel][0]:
            raise StorageUnavailable(
                f"{backend.describe()}: {rel} read {got} bytes, the listing said {listed[rel][0]}: it is being "
                "rewritten; retry once the writer is done."
            )


def _refuse_if_changed(
    backend: LocalBackend | S3Backend, chosen: list[str], listed: dict[str, tuple[int, str | None]]
) -> None:
    now = backend.listing()
    changed = [r for r in chosen if now.get(r) != listed[r]]
    if changed:
        raise StorageUnavailable(
            f"{backend.describe()}: {changed[0]} changed while it was read ({len(changed)} object(s) replaced or "
            "deleted): a writer is still at work; retry once it is done."
        )


def _signature(uri: str, listed: dict[str, tuple[int, str | None]]) -> dict[str, Any]:
    """What a copy was read from: every object the prefix listed (any change there invalidates the copy)."""
    return {"uri": uri, "objects": {r: list(v) for r, v in sorted(listed.items())}}


# --------------------------------------------------------------------------------------------------------
# One copy per machine: the ranks of a node (and later stages on it) share what the first one fetched.


def cache_dir(area: str, uri: str) -> Path:
    """The directory below this machine's scratch (``tempfile.gettempdir()``: the step's emptyDir in a pod)
    where ``uri`` is kept for ``area`` (``rloo-datasets``, ``rloo-models``)."""
    digest = hashlib.sha256(uri.strip().rstrip("/").encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / area / digest


def cached_prefix(
    uri: str, area: str, *, select: Select | None = None, client: Any = None
) -> tuple[Path, ReadPrefix]:
    """:func:`fetch_prefix` into :func:`cache_dir`, once per machine (a file lock: concurrent processes wait
    for the first). A copy read while the store listed exactly the objects it lists now (same keys, sizes and
    ETags, the manifest's included) is reused without a transfer; anything else is read again."""
    dest = cache_dir(area, uri)
    dest.parent.mkdir(parents=True, exist_ok=True)
    loc = Location.parse(uri.strip().rstrip("/"))
    with open(dest.parent / f"{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        listed = list_objects(loc, client=client)
        reused = _reusable(dest, loc, listed, client)
        if reused is not None:
            return dest, reused
        read = fetch_prefix(loc, dest, select=select, client=client)
        if read.manifest:  # fetch_prefix records the listing of a prefix without one itself
            (dest / SOURCE_RECORD).write_text(json.dumps(_signature(loc.uri, listed)))
        return dest, read


def _reusable(
    dest: Path, loc: Location, listed: dict[str, tuple[int, str | None]], client: Any
) -> ReadPrefix | None:
    """The record of the copy at ``dest`` when the store lists exactly what it was read from, else None."""
    if not listed or any(etag is None for _size, etag in listed.values()):
        return None  # nothing there, or a local source: no ETags to tell a changed file by
    try:
        if json.loads((dest / SOURCE_RECORD).read_text()) != _signature(loc.uri, listed):
            return None
        local = Manifest.from_json((dest / MANIFEST_NAME).read_text(), str(dest))
    except (OSError, ValueError, IncompleteArtifactError):
        return None
    if any(not (dest / f.path).is_file() or (dest / f.path).stat().st_size != f.size for f in local.files):
        return None
    log.info("%s: the store lists what was read before: reusing the copy in %s", loc.uri, dest)
    if MANIFEST_NAME not in listed:
        files = tuple(
            ReadFile(f.path, f.size, f.sha256, listed[f.path][1], _key(loc, f.path)) for f in local.files
        )
        return ReadPrefix(loc.uri, files, manifest=False)
    backend = backend_for(loc, client)
    return ReadPrefix(loc.uri, _manifested_files(loc, backend, _read_manifest(backend)), manifest=True)
