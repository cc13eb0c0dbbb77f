"""A full disk, said in one line: which path, how much space the write needs, how much is free.

Writers report a full disk in different ways: ``OSError`` with ``ENOSPC``/``EDQUOT`` from Python's own I/O,
a ``SafetensorError`` whose text holds the OS error (safetensors writes in Rust), and a ``RuntimeError``
from ``torch.save``'s zip writer ("file write failed", "unexpected pos"), which drops the errno. The last one
is taken as a full disk only when the free space is below what the write needed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from rloo.errors import UserError

_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_FULL_TEXT = ("No space left on device", "StorageFull", "Disk quota exceeded", "QuotaExceeded")
_MIB = 2**20


class DiskFullError(UserError):
    """The disk under an output path filled up; the message names the path and the space needed."""


def free_bytes(path: Path) -> int | None:
    """Free bytes on the filesystem of ``path`` (or of its nearest existing parent), None if unknown."""
    for p in (path, *path.parents):
        if p.exists():
            try:
                return shutil.disk_usage(p).free
            except OSError:
                return None
    return None


def tensor_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the tensors among ``tensors`` (other values count 0)."""
    return sum(t.numel() * t.element_size() for t in tensors if hasattr(t, "element_size"))


def human_bytes(n: int) -> str:
    """``n`` bytes for a message: GiB, or MiB below one GiB."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / _MIB:.1f} MiB"


def is_disk_full(e: BaseException, path: Path | None = None, needed: int | None = None) -> bool:
    chain: list[BaseException] = []
    cur: BaseException | None = e
    while cur is not None and len(chain) < 8:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    for err in chain:
        if isinstance(err, OSError) and err.errno in _FULL_ERRNOS:
            return True
        if any(s in str(err) for s in _FULL_TEXT):
            return True
    # torch.save's zip writer drops the errno ("file write failed", "unexpected pos ..."): a write error with
    # less space free than the write needs is a full disk
    if isinstance(e, (OSError, RuntimeError)) and path is not None and needed is not None:
        free = free_bytes(path)
        return free is not None and free < needed
    return False


@contextlib.contextmanager
def disk_full_as_one_line(path: Path, needed: int, what: str) -> Iterator[None]:
    """Turn a full disk while writing ``what`` under ``path`` into a :class:`DiskFullError`; other errors pass.

    ``needed``: bytes the write takes (an estimate is fine; it is what the message asks to free).
    """
    try:
        yield
    except UserError:
        raise
    except Exception as e:
        if not is_disk_full(e, path, needed):
            raise
        free = free_bytes(path)
        have = f", {human_bytes(free)} free now" if free is not None else ""
        raise DiskFullError(
            f"no space left on the disk of {path} while writing {what}: it needs about {human_bytes(needed)}{have}; "
            "nothing half-written was kept: free some space (or point the output elsewhere) and run the same "
            "command again."
        ) from None


def write_bytes_atomic(path: Path, data: bytes, what: str) -> None:
    """Write ``path`` through a temporary name in the same directory and ``os.replace``: a reader sees the
    whole file or none (never a 0-byte one left by a full disk)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # unique: two processes writing the same file (tests in parallel, a retried step) never share a temp file
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with disk_full_as_one_line(path, len(data), what):
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def append_bytes(path: Path, data: bytes, what: str) -> None:
    """Append ``data`` to ``path`` whole or not at all: a full disk part-way truncates the file back to its
    length before (a reader of a JSON-lines file never meets half a line) and is one :class:`DiskFullError`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as f:
        before = f.tell()
        try:
            with disk_full_as_one_line(path, len(data), what):
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            f.truncate(before)  # shrinking needs no space: what was there stays, nothing half-written
            raise


def current_umask() -> int:
    """The process's umask, read without changing it where Linux says it (``os.umask`` can only set it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def honour_umask(root: Path) -> None:
    """Give every file under ``root`` the mode a plain ``open()`` gives (0644 under umask 022).

    Some writers create their files 0600 whatever the umask: safetensors (>= 0.7) writes the weights to a
    private temporary file and renames it, so ``model.safetensors`` would be the one file of a model that a
    reader running as another user (a serving pod, a shared volume) cannot open.
    """
    mode = 0o666 & ~current_umask()
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink() and stat.S_IMODE(path.stat().st_mode) != mode:
            path.chmod(mode)
