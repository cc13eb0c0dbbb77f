"""The manifest that makes an uploaded directory trustworthy: file list, sizes and SHA-256, written last.

A prefix without a manifest is not a complete upload; a reader refuses it. A prefix whose files do not
match its manifest has been modified or damaged after it was published; a reader refuses that too.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from rloo.errors import UserError
from rloo.storage.errors import IncompleteArtifactError

MANIFEST_NAME = "_MANIFEST.json"
MANIFEST_FORMAT = "rloo-manifest/1"
# A pointer manifest (atomic publishing, see transfer.publish_atomic): the files live below ``root``, a
# versioned sub-prefix. Its own format, so a reader that does not know ``root`` refuses it.
POINTER_FORMAT = "rloo-manifest/2"
# Our own temporary names (partial downloads, checkpoint snapshots) never belong in a manifest.
TEMP_PREFIX = ".rloo-"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_CHUNK = 1 << 20


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative, POSIX separators
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    files: tuple[FileEntry, ...]
    created_at: str
    format: str = MANIFEST_FORMAT
    root: str = ""  # where the files are, relative to the manifest's prefix ("" = next to it)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def by_path(self) -> dict[str, FileEntry]:
        return {f.path: f for f in self.files}

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": POINTER_FORMAT if self.root else MANIFEST_FORMAT,
                **({"root": self.root} if self.root else {}),
                "created_at": self.created_at,
                "total_bytes": self.total_bytes,
                "num_files": len(self.files),
                "files": [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in self.files],
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str | bytes, source: str) -> Manifest:
        """Parse and validate; ``source`` names the location in error messages."""
        try:
            data = json.loads(text)
            fmt = data.get("format")
            if fmt not in (MANIFEST_FORMAT, POINTER_FORMAT):
                raise ValueError(f"unknown format {fmt!r}")
            root = str(data.get("root") or "") if fmt == POINTER_FORMAT else ""
            if fmt == POINTER_FORMAT:
                _check_rel_path(root)
            files = []
            for item in data["files"]:
                path, size, sha = item["path"], item["size"], item["sha256"]
                _check_rel_path(path)
                if not isinstance(size, int) or size < 0 or not _HEX64.match(sha):
                    raise ValueError(f"bad entry {item!r}")
                files.append(FileEntry(path, size, sha))
            return cls(tuple(files), str(data.get("created_at", "")), MANIFEST_FORMAT, root)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise IncompleteArtifactError(
                f"{source}/{MANIFEST_NAME} is not a valid rloo manifest ({e}): the prefix was not written by "
                "rloo or was damaged; upload the directory again."
            ) from None


def _check_rel_path(path: str) -> None:
    # A manifest comes from storage: never let it address files outside the download directory.
    p = PurePosixPath(path)
    if not path or p.is_absolute() or any(part in ("", ".", "..") for part in path.split("/")):
        raise ValueError(f"unsafe path {path!r}")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def scan_dir(local_dir: Path, exclude: Sequence[str] = ()) -> list[tuple[str, Path]]:
    """(relative POSIX path, file) for every file below ``local_dir``, sorted; symlinked files are followed.

    Left out: the manifest itself, our temporary names, and paths matching an ``exclude`` glob (matched
    against the relative path, e.g. ``"mlruns/*"`` or ``"*.tmp"``).
    """
    out: list[tuple[str, Path]] = []
    for root, dirs, files in os.walk(local_dir):
        dirs[:] = sorted(d for d in dirs if not d.startswith(TEMP_PREFIX) and ".partial-" not in d)
        for name in files:
            if name.startswith(TEMP_PREFIX) or ".partial-" in name:
                continue
            full = Path(root, name)
            rel = full.relative_to(local_dir).as_posix()
            if rel == MANIFEST_NAME or _excluded(rel, exclude):
                continue
            if full.is_file():  # skips dangling links, sockets, fifos
                out.append((rel, full))
    return sorted(out)


def _excluded(rel: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(rel, p) or fnmatch.fnmatchcase(rel.split("/")[0], p) for p in patterns)


def build_manifest(local_dir: str | Path, exclude: Sequence[str] = (), *, workers: int = 4) -> Manifest:
    """Hash every file of ``local_dir`` (in threads: hashlib releases the GIL on large buffers)."""
    root = Path(local_dir)
    if not root.is_dir():
        raise UserError(f"{root} is not a directory: give the directory to upload.")
    files = scan_dir(root, exclude)
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        digests = list(pool.map(lambda item: sha256_file(item[1]), files))
    entries = tuple(
        FileEntry(rel, path.stat().st_size, digest)
        for (rel, path), digest in zip(files, digests, strict=True)
    )
    return Manifest(entries, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


def write_manifest_file(local_dir: Path, manifest: Manifest) -> None:
    """Write ``manifest`` into ``local_dir`` atomically and durably (temp file, fsync, rename)."""
    target = local_dir / MANIFEST_NAME
    tmp = local_dir / f"{TEMP_PREFIX}{MANIFEST_NAME}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)
    fsync_dir(local_dir)


def write_manifest(local_dir: str | Path, exclude: Sequence[str] = ()) -> Manifest:
    """Seal a local directory in place (e.g. a checkpoint the trainer just wrote): hash, write the manifest."""
    root = Path(local_dir)
    manifest = build_manifest(root, exclude)
    write_manifest_file(root, manifest)
    return manifest


def verify_local(local_dir: Path, manifest: Manifest, source: str, *, hash_limit: int | None = None) -> None:
    """Raise IncompleteArtifactError unless every manifest file exists with its size and SHA-256.

    ``hash_limit``: files larger than this are checked by size only (a resume check of a checkpoint: reading
    gigabytes of weights back is slow, and truncation is what happens to them)."""
    for entry in manifest.files:
        path = local_dir / entry.path
        if not path.is_file():
            raise IncompleteArtifactError(f"{source}: {entry.path} is listed in the manifest but missing.")
        size = path.stat().st_size
        if size != entry.size:
            raise IncompleteArtifactError(
                f"{source}: {entry.path} has {size} bytes, the manifest says {entry.size}: the data was "
                "modified or damaged after it was published; upload the directory again."
            )
        if hash_limit is not None and size > hash_limit:
            continue
        digest = sha256_file(path)
        if digest != entry.sha256:
            raise IncompleteArtifactError(
                f"{source}: {entry.path} fails its SHA-256 check (got {digest[:12]}..., the manifest says "
                f"{entry.sha256[:12]}...): the data was modified or damaged after it was published; upload the "
                "directory again."
            )


def fsync_file(path: Path) -> None:
    """Flush a written file to the disk (before a rename makes it visible)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (after a rename), where the filesystem allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the rename is still atomic
    finally:
        os.close(fd)
