"""Small files written whole or not at all on a disk that fills up: the sample tables of a training run
(``samples/update_N.html``/``.json``, ``samples.jsonl``) must never be left 0-byte or half a line.

A plain ``open(path, "w").write(text)`` creates (or truncates) the file first and then meets ENOSPC: the
reader finds a 0-byte ``update_000003.html``. Python's buffered file (CPython ``Lib/_pyio.py``,
``BufferedWriter.flush``) raises the ``OSError`` (errno ``ENOSPC``, POSIX ``write(2)``) only when the buffer
reaches the disk, after part of the data may have landed; an appended JSON line is then cut. Truncating back
(``ftruncate(2)``) needs no free space, so the file can always be restored to its length before.

The disk is real: a tmpfs of a few KiB in a user + mount namespace (``unshare -rm``), as
tests/integration/test_disk_full.py does for ``rloo train``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def _can_mount() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"], capture_output=True
    )
    return probe.returncode == 0


pytestmark = pytest.mark.skipif(
    not _can_mount(), reason="needs unprivileged user+mount namespaces (unshare -rm)"
)

# Runs inside the namespace: the tmpfs is mounted on argv[1]; prints what each write left behind.
SCRIPT = r"""
import json, sys
from pathlib import Path
from rloo.diskspace import DiskFullError, append_bytes, write_bytes_atomic

root = Path(sys.argv[1])
out = {}
jsonl = root / "samples.jsonl"
append_bytes(jsonl, b'{"update": 1}\n', "the samples of update 1")
try:
    append_bytes(jsonl, b'{"update": 2, "text": "' + b"x" * 64_000 + b'"}\n', "the samples of update 2")
except DiskFullError as e:
    out["append_error"] = str(e)
out["jsonl"] = jsonl.read_text()
html = root / "samples" / "update_000003.html"
try:
    write_bytes_atomic(html, b"<table>" + b"y" * 64_000, "the sample table of update 3")
except DiskFullError as e:
    out["write_error"] = str(e)
out["left"] = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
print(json.dumps(out))
"""


def test_sample_files_on_a_full_disk_are_whole_or_absent(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    proc = subprocess.run(
        ["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o size=16k tmpfs "$1" || exit 99; shift; exec "$@"',
         "sh", str(disk), sys.executable, "-c", SCRIPT, str(disk)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["jsonl"] == '{"update": 1}\n'  # the first line whole, none of the second
    assert out["append_error"].startswith(
        f"no space left on the disk of {disk / 'samples.jsonl'} while writing "
    )
    assert out["write_error"].startswith(
        f"no space left on the disk of {disk / 'samples' / 'update_000003.html'}"
    )
    assert out["left"] == ["samples.jsonl"]  # no 0-byte update_000003.html, no temporary file
