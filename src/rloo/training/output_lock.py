"""One ``rloo train`` per output at a time.

Two runs writing one ``output_dir`` interleave their ``metrics.jsonl`` and checkpoints, and the one that
"succeeds" leaves a directory neither of them trained. So the main process takes a lock on the output when
it starts and holds it until it ends; a second run is refused at once, in one line naming the holder (host,
pid, since when) and what to do, and exits 75 (``EX_TEMPFAIL``: nothing about its flags is wrong, and a
retried pipeline step tries again instead of failing for good).

Local directory (and the staging directory of an ``s3://`` output)
    an exclusive ``flock`` on ``<dir>/.rloo-train.lock``, a file that records the holder. The kernel drops
    the lock when the process ends, however it ends (SIGKILL, out of memory, a crash), so a dead run never
    blocks the next one: re-running the same command resumes as before. A clean end deletes the file (and
    the directory, if the lock made it and nothing else was written there). On a filesystem without
    ``flock`` the run goes on unlocked, with a warning.

``s3://`` output_dir
    a lock object ``<prefix>/.rloo-train.lock`` created with a conditional write (``If-None-Match: *``: of two
    runs, exactly one creates it), refreshed every :data:`S3_HEARTBEAT_S` seconds (``If-Match`` its ETag) and
    deleted at the end. A run that dies leaves it behind: it counts as stale :data:`S3_EXPIRY_S` seconds after
    its last refresh (by the server's clock), or at once when it names a process of this host that is gone,
    and the next run takes it over (conditionally again, so of two runs taking over one wins). A run on
    another machine right after a crash is therefore refused for up to two minutes, and says until when.
    This needs a server that honours conditional writes (AWS S3, MinIO, SeaweedFS, Ceph RGW); one that
    answers ``NotImplemented`` gets a warning and no lock.

In one process a second trainer on the same output (a notebook, the tests) shares the lock.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import json
import logging
import os
import socket
import threading
import uuid
import weakref
from dataclasses import asdict, dataclass
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

from rloo.errors import UserError

log = logging.getLogger(__name__)

LOCK_NAME = ".rloo-train.lock"
S3_HEARTBEAT_S = 30.0
S3_EXPIRY_S = 120.0
_PRECONDITION = {"PreconditionFailed", "412", "ConditionalRequestConflict", "409"}
_UNSUPPORTED = {"NotImplemented", "501"}


class OutputInUse(UserError):
    """Another run holds the output's lock. Exits 75 (``EX_TEMPFAIL``): it is busy, not wrong."""

    exit_code = 75


@dataclass(frozen=True)
class Holder:
    """Who holds a lock: recorded in the lock, named in the refusal."""

    host: str
    pid: int
    started: str  # UTC, ISO 8601
    token: str

    @classmethod
    def this_process(cls) -> Holder:
        now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        return cls(socket.gethostname(), os.getpid(), now, uuid.uuid4().hex)

    @classmethod
    def parse(cls, data: bytes) -> Holder | None:
        try:
            d = json.loads(data)
            return cls(str(d["host"]), int(d["pid"]), str(d["started"]), str(d.get("token", "")))
        except (ValueError, KeyError, TypeError):
            return None

    def to_json(self, **extra: Any) -> bytes:
        return json.dumps({**asdict(self), **extra}, indent=2).encode()

    def describe(self) -> str:
        return f"host {self.host}, pid {self.pid}, since {self.started}"

    def is_gone(self) -> bool:
        """True when this holder was a process of this host that no longer runs (or this very pid: a
        restarted container reuses its pids)."""
        if self.host != socket.gethostname():
            return False
        if self.pid == os.getpid():
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # it exists, as another user
            return False
        return False


_HOW = (
    "wait for it to end, or stop it (Ctrl-C or SIGTERM: it checkpoints, and the same command resumes where it "
    "stopped), or choose another {flag}."
)


# ---------------------------------------------------------------------------------------------------------
class LocalLock:
    """``flock`` on ``<directory>/.rloo-train.lock``; see the module docstring."""

    def __init__(self, directory: Path, *, flag: str, where: str, holder: Holder) -> None:
        self.directory = directory
        self.path = directory / LOCK_NAME
        self.flag = flag
        self.where = where
        self.holder = holder
        self.fd: int | None = None
        self.created: list[Path] = []  # directories the lock made, outermost first

    def acquire(self) -> None:
        self._make_directory()
        try:
            self._lock()
        except BaseException:
            self._remove_created()
            raise

    def _make_directory(self) -> None:
        missing = []
        for p in (self.directory, *self.directory.parents):
            if p.exists():
                break
            missing.append(p)
        for p in reversed(missing):
            try:
                p.mkdir()
            except FileExistsError:
                continue
            except OSError as e:
                self._remove_created()
                raise UserError(f"{self.flag} {self.where}: cannot create {p}: {e.strerror}.") from None
            self.created.append(p)

    def _lock(self) -> None:
        import fcntl

        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not _is_current(fd, self.path):  # its holder just ended and deleted it: look again
                    os.close(fd)
                    continue
                holder = Holder.parse(os.pread(fd, 4096, 0))
                os.close(fd)
                who = holder.describe() if holder is not None else "which one is not recorded yet"
                raise OutputInUse(
                    f"{self.flag} {self.where} is in use by another rloo train ({who}; lock {self.path}): "
                    + _HOW.format(flag=self.flag)
                ) from None
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    log.warning(
                        "%s: this filesystem does not support file locks (%s): two runs started on it at once "
                        "would not be told apart",
                        self.directory,
                        e.strerror,
                    )
                    return
                raise
            if _is_current(fd, self.path):
                break
            os.close(fd)  # locked a file its holder deleted meanwhile: lock the one there now
        os.ftruncate(fd, 0)
        os.pwrite(fd, self.holder.to_json(), 0)
        self.fd = fd

    def release(self) -> None:
        """Delete the lock file (while still holding it: whoever opens the path next gets a new file), let the
        lock go, and remove the directories the lock made if nothing else was written there."""
        if self.fd is not None:
            with contextlib.suppress(FileNotFoundError):
                if _is_current(self.fd, self.path):
                    self.path.unlink()
            os.close(self.fd)
            self.fd = None
        self._remove_created()

    def _remove_created(self) -> None:
        for p in reversed(self.created):
            try:
                p.rmdir()
            except OSError:  # not empty: the run wrote there, or someone else did
                break
        self.created = []


def _is_current(fd: int, path: Path) -> bool:
    """True when ``path`` still names the file open as ``fd``."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


# ---------------------------------------------------------------------------------------------------------
class S3Lock:
    """A lock object under an ``s3://`` prefix, refreshed in the background; see the module docstring."""

    def __init__(self, loc: Any, *, flag: str, holder: Holder, client: Any = None) -> None:
        from rloo.storage.s3 import s3_client

        self.loc = loc
        self.uri = loc.child(LOCK_NAME).uri
        self.flag = flag
        self.holder = holder
        self.client = client if client is not None else s3_client()
        self.key = loc.object_key(LOCK_NAME)
        self.etag: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost = False

    def _body(self) -> bytes:
        now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        return self.holder.to_json(refreshed=now, expires_after_s=S3_EXPIRY_S)

    def _put(self, **condition: str) -> str | None:
        """The new ETag, or None when the condition did not hold."""
        from botocore.exceptions import ClientError

        from rloo.storage.s3 import error_code

        try:
            resp = self.client.put_object(
                Bucket=self.loc.bucket, Key=self.key, Body=self._body(), **condition
            )
        except ClientError as e:
            if error_code(e) in _PRECONDITION:
                return None
            raise
        return str(resp["ETag"])

    def _read(self) -> tuple[Holder | None, str, float] | None:
        """(holder, ETag, seconds since its last write by the server's clock), or None when there is none."""
        from botocore.exceptions import ClientError

        from rloo.storage.s3 import error_code

        try:
            resp = self.client.get_object(Bucket=self.loc.bucket, Key=self.key)
        except ClientError as e:
            if error_code(e) in ("NoSuchKey", "404", "NotFound"):
                return None
            raise
        holder = Holder.parse(resp["Body"].read())
        server_now = dt.datetime.now(dt.timezone.utc)
        with contextlib.suppress(KeyError, TypeError, ValueError):
            server_now = parsedate_to_datetime(resp["ResponseMetadata"]["HTTPHeaders"]["date"])
        age = (server_now - resp["LastModified"]).total_seconds()
        return holder, str(resp["ETag"]), age

    def acquire(self) -> None:
        from botocore.exceptions import ClientError

        from rloo.storage.backends import S3Backend
        from rloo.storage.s3 import error_code, s3_errors

        # a missing bucket says so (some servers create one on a write); wrong credentials too, in one line
        S3Backend(self.loc, self.client).check_access(create=False)
        with s3_errors("locking", self.loc, self.client):
            try:
                self.etag = self._take()
            except ClientError as e:
                if error_code(e) not in _UNSUPPORTED:
                    raise
                log.warning(
                    "%s: the S3 server does not support conditional writes (%s): two runs started on this "
                    "output at once would not be told apart",
                    self.loc.uri,
                    error_code(e),
                )
                return
        self._thread = threading.Thread(target=self._heartbeat, name="rloo-output-lock", daemon=True)
        self._thread.start()

    def _take(self) -> str:
        for _ in range(5):
            etag = self._put(IfNoneMatch="*")
            if etag is not None:
                return etag
            current = self._read()
            if current is None:  # released meanwhile
                continue
            holder, old_etag, age = current
            if holder is not None and age <= S3_EXPIRY_S and not holder.is_gone():
                until = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=S3_EXPIRY_S - age)
                raise OutputInUse(
                    f"{self.flag} {self.loc.uri} is in use by another rloo train ({holder.describe()}; lock "
                    f"{self.uri}, refreshed {age:.0f}s ago): "
                    + _HOW.format(flag=self.flag)
                    + f" If that run died, its lock expires {S3_EXPIRY_S:.0f}s after its last refresh (at "
                    f"{until.strftime('%H:%M:%SZ')}): run the same command again then."
                )
            etag = self._put(IfMatch=old_etag)
            if etag is not None:
                why = (
                    "unreadable"
                    if holder is None
                    else f"of {holder.describe()}, last refreshed {age:.0f}s ago"
                )
                log.warning("%s: took over a stale lock (%s)", self.uri, why)
                return etag
        raise OutputInUse(
            f"{self.flag} {self.loc.uri}: other runs keep taking its lock {self.uri}: "
            + _HOW.format(flag=self.flag)
        )

    def _heartbeat(self) -> None:
        failing = False
        while not self._stop.wait(S3_HEARTBEAT_S):
            try:
                etag = self._put(IfMatch=self.etag or "*")
            except Exception as e:  # an outage: keep trying; the lock holds until it expires
                if not failing:
                    log.warning("%s: refreshing the lock failed (%s); retrying", self.uri, e)
                failing = True
                continue
            failing = False
            if etag is None:
                self.lost = True
                log.warning(
                    "%s: another run took over this run's lock (its refreshes failed for over %.0fs): two runs "
                    "may now write to %s",
                    self.uri,
                    S3_EXPIRY_S,
                    self.loc.uri,
                )
                return
            self.etag = etag

    def release(self) -> None:
        """Stop refreshing and delete the lock object if it is still this run's."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        if self.etag is None or self.lost:
            return
        try:
            current = self._read()
            if current is not None and current[1] == self.etag:
                self.client.delete_object(Bucket=self.loc.bucket, Key=self.key)
        except Exception as e:  # it expires on its own
            log.warning("%s: could not delete the lock (%s); it expires in %.0fs", self.uri, e, S3_EXPIRY_S)
        self.etag = None


# ---------------------------------------------------------------------------------------------------------
class _Held:
    def __init__(self, locks: list[Any]) -> None:
        self.locks = locks
        self.count = 0


_HELD: dict[tuple[str, str], _Held] = {}
_HELD_LOCK = threading.Lock()


class OutputLock:
    """The lock(s) of one run's output, as :meth:`acquire` gives them; :meth:`release` is idempotent and also
    runs when the object is garbage-collected."""

    def __init__(self, key: tuple[str, str], held: _Held) -> None:
        self._key = key
        self._held = held
        self._finalizer = weakref.finalize(self, _drop, key, held)

    @classmethod
    def acquire(
        cls, local_dir: Path, remote: Any = None, *, local_dir_flag: str = "--output_dir"
    ) -> OutputLock:
        """Lock ``local_dir`` (the output directory, or the staging directory of ``remote``) and, for an s3://
        output, ``remote`` itself. Raises :class:`OutputInUse` naming the holder."""
        key = (os.path.realpath(local_dir), remote.uri if remote is not None else "")
        with _HELD_LOCK:
            held = _HELD.get(key)
            if held is None:
                holder = Holder.this_process()
                where = str(local_dir) if remote is None else f"{remote.uri} (staged in {local_dir})"
                flag = "--output_dir" if remote is None else local_dir_flag
                local = LocalLock(Path(local_dir), flag=flag, where=where, holder=holder)
                local.acquire()
                locks: list[Any] = [local]
                if remote is not None and remote.is_s3:
                    s3 = S3Lock(remote, flag="--output_dir", holder=holder)
                    try:
                        s3.acquire()
                    except BaseException:
                        local.release()
                        raise
                    locks.append(s3)
                held = _HELD[key] = _Held(locks)
            held.count += 1
        return cls(key, held)

    def release(self) -> None:
        self._finalizer()


def _drop(key: tuple[str, str], held: _Held) -> None:
    with _HELD_LOCK:
        held.count -= 1
        if held.count > 0:
            return
        if _HELD.get(key) is held:
            del _HELD[key]
    for lock in reversed(held.locks):
        lock.release()


__all__ = ["LOCK_NAME", "Holder", "LocalLock", "OutputInUse", "OutputLock", "S3Lock"]
