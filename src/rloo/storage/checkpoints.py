"""Mirror training checkpoints to object storage and find the newest complete one to resume from.

The trainer writes ``<output_dir>/checkpoint-N`` locally (temp dir + rename); a :class:`CheckpointMirror`
uploads each to ``<remote_parent>/checkpoint-N`` in a background thread, so training does not wait for the
network. A fresh pod calls :meth:`CheckpointMirror.restore_latest` to download the newest *complete* remote
checkpoint (interrupted uploads have no manifest and are skipped).
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import threading
import uuid
from pathlib import Path
from typing import Any

from rloo.storage.errors import StorageError
from rloo.storage.location import Location
from rloo.storage.manifest import TEMP_PREFIX
from rloo.storage.transfer import delete_prefix, download_dir, list_complete_prefixes, upload_dir

log = logging.getLogger(__name__)


class CheckpointMirror:
    """Uploads checkpoints one at a time, in submission order, from hard-link snapshots; a submission waits
    for the previous upload to finish.

    The snapshot (hard links, or a copy across filesystems) lets the trainer rotate or delete its local
    checkpoint while the upload is still running. ``keep_last`` deletes older remote checkpoints once a newer
    one is complete. Upload failures are logged and kept; :meth:`wait` raises the error of the newest
    checkpoint if it could not be mirrored.
    """

    def __init__(
        self,
        remote_parent: str | os.PathLike[str] | Location,
        *,
        keep_last: int | None = None,
        background: bool = True,
        pattern: str = "checkpoint-*",
        client: Any = None,
        transfer_config: Any = None,
    ) -> None:
        self.remote = Location.parse(remote_parent)
        self.keep_last = keep_last
        self.pattern = pattern
        self._client = client
        self._transfer_config = transfer_config
        self._errors: dict[str, StorageError] = {}
        self._last_submitted: str | None = None
        self.uploaded: list[str] = []
        self._queue: queue.Queue[tuple[Path, str] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._worker, name="rloo-checkpoint-mirror", daemon=True)
            self._thread.start()

    def submit(self, local_checkpoint: str | os.PathLike[str]) -> str:
        """Mirror ``local_checkpoint`` to ``<remote_parent>/<its name>``; returns that URI."""
        src = Path(local_checkpoint)
        target = self.remote.child(src.name).uri
        snapshot = _snapshot(src)
        self._last_submitted = target
        if self._thread is None:
            self._upload(snapshot, target)
        else:
            # At most one upload in flight: the previous checkpoint is complete remotely before the next
            # starts uploading, so a pod killed mid-upload loses at most the one being sent (and uploads
            # slower than checkpointing slow training down instead of piling up snapshots on disk).
            self._queue.join()
            self._queue.put((snapshot, target))
        return target

    def _worker(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                self._upload(*job)
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _upload(self, snapshot: Path, target: str) -> None:
        try:
            upload_dir(
                snapshot, target, progress=False, client=self._client, transfer_config=self._transfer_config
            )
            self.uploaded.append(target)
            self._errors.pop(target, None)
            self._prune()
        except StorageError as e:
            log.warning("checkpoint mirror: %s", e)
            self._errors[target] = e
        except Exception as e:  # a background thread must not die silently
            log.warning("checkpoint mirror: uploading %s failed: %s", target, e)
            self._errors[target] = StorageError(f"uploading {target} failed: {type(e).__name__}: {e}")
        finally:
            shutil.rmtree(snapshot, ignore_errors=True)

    def _prune(self) -> None:
        if not self.keep_last:
            return
        complete = list_complete_prefixes(self.remote, self.pattern, client=self._client)
        for uri in complete[: -self.keep_last]:
            delete_prefix(uri, client=self._client)

    def wait(self) -> None:
        """Block until every submitted checkpoint is uploaded; raise if the newest one failed."""
        if self._thread is not None:
            self._queue.join()
        if self._last_submitted in self._errors:
            raise self._errors[self._last_submitted]

    def close(self) -> None:
        """Finish pending uploads and stop the thread (errors are not raised: call wait() for that)."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._thread = None

    def latest(self) -> str | None:
        """URI of the newest complete remote checkpoint, or None."""
        found = list_complete_prefixes(self.remote, self.pattern, client=self._client)
        return found[-1] if found else None

    def restore_latest(self, local_parent: str | os.PathLike[str]) -> Path | None:
        """Download the newest complete remote checkpoint into ``local_parent/<name>`` (verified)."""
        uri = self.latest()
        if uri is None:
            return None
        dest = Path(local_parent) / Location.parse(uri).name
        download_dir(uri, dest, overwrite=True, client=self._client, transfer_config=self._transfer_config)
        return dest


def _snapshot(src: Path) -> Path:
    if not src.is_dir():
        raise StorageError(f"cannot mirror {src}: it is not a directory.")
    snap = src.parent / f"{TEMP_PREFIX}mirror-{src.name}-{uuid.uuid4().hex[:8]}"
    for root, _dirs, files in os.walk(src):
        rel_root = Path(root).relative_to(src)
        (snap / rel_root).mkdir(parents=True, exist_ok=True)
        for name in files:
            a, b = Path(root, name), snap / rel_root / name
            try:
                os.link(a, b)
            except OSError:
                shutil.copy2(a, b)
    return snap
