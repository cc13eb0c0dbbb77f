"""Two backends with one set of primitives: S3 (boto3 managed transfers) and a local directory tree.

The protocol in :mod:`rloo.storage.transfer` is written once against these primitives, so ``file://`` and
``s3://`` locations have the same semantics (manifest written last, readers verify).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

from rloo.storage.errors import IncompleteArtifactError, StorageError
from rloo.storage.location import Location
from rloo.storage.manifest import TEMP_PREFIX, fsync_dir
from rloo.storage.progress import Progress
from rloo.storage.s3 import error_code, s3_client, s3_errors

MiB = 1024 * 1024
# put_files' temporary names: TEMP_PREFIX, the target's name, a dot and 8 hex digits.
_TEMP_FILE_RE = re.compile(rf"^{re.escape(TEMP_PREFIX)}.+\.[0-9a-f]{{8}}$")


def default_transfer_config() -> Any:
    """Multipart above 16 MiB in 16 MiB parts (10,000 parts: files up to ~160 GB), 8 parallel requests."""
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(
        multipart_threshold=16 * MiB,
        multipart_chunksize=16 * MiB,
        max_concurrency=8,
        num_download_attempts=5,
        use_threads=True,
    )


class LocalBackend:
    """A directory tree. Files are copied to temporary names and renamed into place, then fsynced."""

    def __init__(self, loc: Location) -> None:
        self.loc = loc
        self.root = loc.path

    def describe(self) -> str:
        return self.loc.uri

    def check_access(self, *, create: bool) -> None:
        if create:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise StorageError(
                    f"cannot create {self.root}: {e.strerror}: choose a writable location."
                ) from None

    def read_bytes(self, rel: str) -> bytes | None:
        try:
            return (self.root / rel).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def write_bytes(self, rel: str, data: bytes) -> None:
        target = self.root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f"{TEMP_PREFIX}{target.name}.{uuid.uuid4().hex[:8]}")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        fsync_dir(target.parent)

    def delete(self, rel: str) -> None:
        (self.root / rel).unlink(missing_ok=True)

    def abort_incomplete(self) -> int:
        """Remove the temporary files of an earlier copy into this tree that was killed mid-file (the
        ``.rloo-<name>.<hex>`` names of :meth:`put_files`); returns how many."""
        if not self.root.is_dir():
            return 0
        removed = 0
        for root, _dirs, files in os.walk(self.root):
            for name in files:
                if _TEMP_FILE_RE.match(name):
                    with contextlib.suppress(OSError):
                        Path(root, name).unlink()
                        removed += 1
        return removed

    def sizes(self) -> dict[str, int]:
        if not self.root.is_dir():
            return {}
        out = {}
        for root, _dirs, files in os.walk(self.root):
            for name in files:
                p = Path(root, name)
                out[p.relative_to(self.root).as_posix()] = p.stat().st_size
        return out

    def listing(self) -> dict[str, tuple[int, str | None]]:
        """Every file below the root: relative path -> (size, None); a directory tree has no ETags."""
        return {rel: (size, None) for rel, size in self.sizes().items()}

    def children(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir())

    def put_files(self, items: list[tuple[Path, str, str]], progress: Progress) -> None:
        """Copy (local file, relative path, sha256) into the tree, each via a temp name and a rename."""
        dirs = set()
        for src, rel, _sha in items:
            target = self.root / rel
            tmp = target.with_name(f"{TEMP_PREFIX}{target.name}.{uuid.uuid4().hex[:8]}")
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                with open(src, "rb") as fi, open(tmp, "wb") as fo:
                    while chunk := fi.read(MiB):
                        fo.write(chunk)
                        progress.update(len(chunk))
                    fo.flush()
                    os.fsync(fo.fileno())
                os.replace(tmp, target)
            except OSError as e:
                raise StorageError(
                    f"writing {target} failed ({e.strerror or e}); nothing was published (no manifest): fix the "
                    "destination and upload again."
                ) from None
            finally:
                with contextlib.suppress(OSError):
                    tmp.unlink(missing_ok=True)
            dirs.add(target.parent)
        for d in dirs:
            fsync_dir(d)

    def get_files(self, items: list[tuple[str, Path]], progress: Progress) -> None:
        for rel, dest in items:
            dest.parent.mkdir(parents=True, exist_ok=True)
            try:
                with open(self.root / rel, "rb") as fi, open(dest, "wb") as fo:
                    while chunk := fi.read(MiB):
                        fo.write(chunk)
                        progress.update(len(chunk))
            except FileNotFoundError:
                raise IncompleteArtifactError(
                    f"{self.loc.uri}: {rel} is listed in the manifest but missing: the prefix was modified after "
                    "it was published; upload the directory again."
                ) from None

    def delete_tree(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def delete_all_but(self, keep_file: str, keep_prefix: str) -> None:
        """Delete every file except ``keep_file`` and those under ``keep_prefix``, then empty directories."""
        for rel in self.sizes():
            if rel != keep_file and not rel.startswith(keep_prefix):
                (self.root / rel).unlink(missing_ok=True)
        for root, _dirs, _files in sorted(os.walk(self.root), key=lambda w: -len(w[0])):
            if Path(root) != self.root:
                with contextlib.suppress(OSError):
                    Path(root).rmdir()  # only succeeds when empty


class S3Backend:
    """A prefix in an S3 bucket. Uploads and downloads go through one boto3 TransferManager."""

    def __init__(self, loc: Location, client: Any = None, transfer_config: Any = None) -> None:
        self.loc = loc
        self.client = client if client is not None else s3_client()
        self.transfer_config = transfer_config if transfer_config is not None else default_transfer_config()

    def describe(self) -> str:
        from rloo.storage.s3 import endpoint_of

        return f"{self.loc.uri} at {endpoint_of(self.client)}"

    def _key(self, rel: str) -> str:
        return self.loc.object_key(rel)

    def check_access(self, *, create: bool) -> None:
        # One cheap request up front turns the common mistakes (credentials, bucket, endpoint) into a precise
        # message before anything is transferred.
        with s3_errors("accessing", self.loc, self.client):
            try:
                self.client.head_bucket(Bucket=self.loc.bucket)
            except Exception as e:
                if error_code(e) in ("404", "NotFound", "NoSuchBucket"):
                    e.response["Error"]["Code"] = "NoSuchBucket"  # type: ignore[attr-defined]
                raise

    def read_bytes(self, rel: str) -> bytes | None:
        with s3_errors("reading", self.loc, self.client):
            try:
                obj = self.client.get_object(Bucket=self.loc.bucket, Key=self._key(rel))
            except Exception as e:
                if error_code(e) in ("NoSuchKey", "404", "NotFound"):
                    return None
                raise
            return obj["Body"].read()

    def write_bytes(self, rel: str, data: bytes) -> None:
        # A single PutObject is atomic in S3: readers see the old object or the new one, never a mix.
        with s3_errors("writing", self.loc, self.client):
            self.client.put_object(Bucket=self.loc.bucket, Key=self._key(rel), Body=data)

    def delete(self, rel: str) -> None:
        with s3_errors("deleting", self.loc, self.client):
            self.client.delete_object(Bucket=self.loc.bucket, Key=self._key(rel))

    def abort_incomplete(self) -> int:
        """Abort the multipart uploads still open under this prefix: a killed transfer leaves them behind,
        and the bucket keeps (and bills) their parts until someone aborts them. Concurrent writers to one
        prefix are not supported, so every open upload here belongs to an earlier, dead run. Returns how
        many were aborted."""
        prefix = self._key("")
        aborted = 0
        with s3_errors("listing multipart uploads of", self.loc, self.client):
            pages = self.client.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.loc.bucket, Prefix=prefix
            )
            for page in pages:
                for up in page.get("Uploads", []):
                    try:
                        self.client.abort_multipart_upload(
                            Bucket=self.loc.bucket, Key=up["Key"], UploadId=up["UploadId"]
                        )
                        aborted += 1
                    except Exception as e:
                        if error_code(e) != "NoSuchUpload":  # aborted or completed meanwhile
                            raise
        return aborted

    def sizes(self) -> dict[str, int]:
        return {rel: size for rel, (size, _etag) in self.listing().items()}

    def listing(self) -> dict[str, tuple[int, str | None]]:
        """Every object below the prefix: relative key -> (size, ETag without its quotes)."""
        prefix = self._key("")
        out: dict[str, tuple[int, str | None]] = {}
        with s3_errors("listing", self.loc, self.client):
            for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.loc.bucket, Prefix=prefix
            ):
                for obj in page.get("Contents", []):
                    etag = str(obj.get("ETag") or "").strip('"') or None
                    out[obj["Key"][len(prefix) :]] = (int(obj["Size"]), etag)
        return out

    def children(self) -> list[str]:
        prefix = self._key("")
        names: list[str] = []
        with s3_errors("listing", self.loc, self.client):
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.loc.bucket, Prefix=prefix, Delimiter="/"
            )
            for page in pages:
                names += [cp["Prefix"][len(prefix) :].rstrip("/") for cp in page.get("CommonPrefixes", [])]
        return sorted(n for n in names if n)

    def _run(self, action: str, submit: Any, jobs: list[Any], progress: Progress) -> None:
        from boto3.s3.transfer import ProgressCallbackInvoker, create_transfer_manager

        subscribers = [ProgressCallbackInvoker(progress.update)]
        with s3_errors(action, self.loc, self.client):
            manager = create_transfer_manager(self.client, self.transfer_config)
            futures: list[Any] = []
            try:
                futures += [submit(manager, job, subscribers) for job in jobs]
                for future in futures:
                    future.result()
            except BaseException as e:
                # Stop the other transfers: the caller publishes nothing after a failure. Each future is
                # cancelled itself: s3transfer 0.19's shutdown(cancel=True) passes its arguments shifted
                # (cancel_msg=True, exc_type=''), so a transfer still running made it raise TypeError.
                for future in futures:
                    future.cancel()
                manager.shutdown()
                if action == "downloading" and error_code(e) in ("404", "NoSuchKey", "NotFound"):
                    raise IncompleteArtifactError(
                        f"{self.loc.uri}: a file listed in the manifest is missing: the prefix was modified "
                        "after it was published; upload the directory again."
                    ) from None
                raise
            manager.shutdown()

    def put_files(self, items: list[tuple[Path, str, str]], progress: Progress) -> None:
        def submit(manager: Any, job: tuple[Path, str, str], subscribers: list[Any]) -> Any:
            src, rel, sha = job
            return manager.upload(
                str(src),
                self.loc.bucket,
                self._key(rel),
                # The digest travels with the object, so a deep check needs no download (HeadObject).
                extra_args={"Metadata": {"sha256": sha}},
                subscribers=subscribers,
            )

        self._run("uploading to", submit, items, progress)

    def get_files(self, items: list[tuple[str, Path]], progress: Progress) -> None:
        for _rel, dest in items:
            dest.parent.mkdir(parents=True, exist_ok=True)

        def submit(manager: Any, job: tuple[str, Path], subscribers: list[Any]) -> Any:
            rel, dest = job
            return manager.download(self.loc.bucket, self._key(rel), str(dest), subscribers=subscribers)

        self._run("downloading", submit, items, progress)

    def delete_tree(self) -> None:
        self._delete_keys(list(self.sizes()))

    def delete_all_but(self, keep_file: str, keep_prefix: str) -> None:
        """Delete every object except ``keep_file`` and those under ``keep_prefix``."""
        self._delete_keys([k for k in self.sizes() if k != keep_file and not k.startswith(keep_prefix)])

    def _delete_keys(self, keys: list[str]) -> None:
        with s3_errors("deleting", self.loc, self.client):
            for i in range(0, len(keys), 1000):
                batch = [{"Key": self._key(k)} for k in keys[i : i + 1000]]
                self.client.delete_objects(Bucket=self.loc.bucket, Delete={"Objects": batch, "Quiet": True})


def backend_for(loc: Location, client: Any = None, transfer_config: Any = None) -> LocalBackend | S3Backend:
    return S3Backend(loc, client, transfer_config) if loc.is_s3 else LocalBackend(loc)
