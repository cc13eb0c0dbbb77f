"""Where an artifact lives: ``s3://bucket/prefix``, ``file:///abs/path`` or a plain local path."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Literal

from rloo.errors import UserError
from rloo.storage.redact import redact

# S3 bucket naming rules (lowercase, 3-63 characters); SeaweedFS and MinIO enforce the same.
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
_SCHEME_RE = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.\-]*)://")


@dataclass(frozen=True)
class Location:
    """A parsed storage URI. For ``s3``, ``key`` is the prefix without surrounding slashes; for ``file``
    it is an absolute POSIX path and ``bucket`` is empty."""

    scheme: str
    bucket: str
    key: str

    @classmethod
    def parse(cls, uri: str | os.PathLike[str] | Location) -> Location:
        if isinstance(uri, Location):
            return uri
        if isinstance(uri, os.PathLike):
            return cls("file", "", Path(uri).expanduser().resolve().as_posix())
        text = str(uri).strip()
        if not text:
            raise UserError("empty storage URI: give s3://bucket/prefix, file:///path or a local path.")
        m = _SCHEME_RE.match(text)
        if m is None:
            return cls("file", "", Path(text).expanduser().resolve().as_posix())
        scheme = m.group(1).lower()
        rest = text[m.end() :]
        if scheme == "file":
            if not rest.startswith("/"):
                raise UserError(
                    f"file URI {text!r} must be absolute (file:///abs/path); give a plain path for "
                    "relative locations."
                )
            return cls("file", "", Path(rest).resolve().as_posix())
        if scheme == "s3":
            bucket, _, prefix = rest.partition("/")
            if "@" in bucket or ":" in bucket:
                raise UserError(
                    f"S3 URI {redact(text)!r} carries credentials or a port in the bucket part: use "
                    "s3://bucket/prefix and put credentials in AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and "
                    "the server in S3_ENDPOINT_URL."
                )
            if not _BUCKET_RE.match(bucket):
                raise UserError(
                    f"invalid S3 bucket name {bucket!r} in {text!r}: bucket names are 3-63 lowercase letters, "
                    "digits, dots and hyphens (s3://bucket/prefix)."
                )
            parts = [p for p in prefix.split("/") if p]
            if any(p in (".", "..") for p in parts):
                raise UserError(f"S3 URI {text!r} contains '.' or '..' segments: give a normalized prefix.")
            return cls("s3", bucket, "/".join(parts))
        raise UserError(
            f"unsupported storage URI {redact(text)!r}: use s3://bucket/prefix (S3-compatible storage), "
            "file:///abs/path or a plain local path."
        )

    # ----------------------------------------------------------------------------------------------
    @property
    def is_s3(self) -> bool:
        return self.scheme == "s3"

    @property
    def is_local(self) -> bool:
        return self.scheme == "file"

    @property
    def path(self) -> Path:
        if not self.is_local:
            raise ValueError(f"{self.uri} is not a local path")
        return Path(self.key)

    @property
    def uri(self) -> str:
        if self.is_s3:
            return f"s3://{self.bucket}/{self.key}" if self.key else f"s3://{self.bucket}"
        return f"file://{self.key}"

    @property
    def name(self) -> str:
        return PurePosixPath(self.key).name

    def child(self, *parts: str) -> Location:
        """The location of ``parts`` below this one (``/``-separated parts are split)."""
        segs = [s for p in parts for s in str(p).split("/") if s]
        if any(s in (".", "..") for s in segs):
            raise ValueError(f"child path {parts!r} must not contain '.' or '..'")
        if self.is_s3:
            return Location("s3", self.bucket, "/".join([*([self.key] if self.key else []), *segs]))
        return Location("file", "", PurePosixPath(self.key, *segs).as_posix())

    def object_key(self, rel: str) -> str:
        """The S3 key of ``rel`` below this prefix."""
        return f"{self.key}/{rel}" if self.key else rel

    def __str__(self) -> str:
        return self.uri


def has_scheme(value: str | os.PathLike[str]) -> bool:
    """True when ``value`` is written as a URI (``s3://...``, ``gs://...``, ``file://...``)."""
    return not isinstance(value, os.PathLike) and _SCHEME_RE.match(str(value).strip()) is not None


def require_local_path(flag: str, value: str | os.PathLike[str] | None, hint: str = "") -> None:
    """Refuse a URI where only a local path works, in one line naming the flag (``--output_dir`` etc.).

    Without this a path-like flag given ``s3://b/x`` silently becomes a local directory ``s3:/b/x``.
    ``hint`` says what to use instead.
    """
    if value is None or not has_scheme(value):
        return
    text = str(value).strip()
    what = "object storage (s3://)" if text.lower().startswith("s3://") else "a URI"
    raise UserError(
        f"{flag} {redact(text)!r}: {what} is not supported here, only a local path"
        + (f"; {hint}" if hint else "; give a plain directory or file path.")
    )


def require_not_file(flag: str, value: str | os.PathLike[str] | None) -> None:
    """Refuse a local output directory that is an existing file, in one line naming the flag.

    ``Path.mkdir(exist_ok=True)`` only forgives an existing directory: on a file it raises
    ``FileExistsError`` (or ``NotADirectoryError`` when writing below it), after the models have loaded.
    """
    if value is None or has_scheme(value):
        return
    path = Path(value).expanduser()
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {path} is a file; pass a directory.")


# ------------------------------------------------------------------------------------------------------
# What a model or dataset argument names. One rule for every stage and command, so that a value is the same
# kind of thing to `rloo train`, `rloo eval`, `rloo push` and every pipeline step.

SourceKind = Literal["hub", "s3", "local"]

# A Hugging Face Hub repo id, loosely: ``name`` or ``org/name``, each part letters, digits, '-', '_' and '.',
# not starting with '.' or '-' (the Hub's own rules are stricter; it reports its own refusal).
_HUB_ID_RE = re.compile(r"^(?:[A-Za-z0-9_][A-Za-z0-9_.\-]*/)?[A-Za-z0-9_][A-Za-z0-9_.\-]*$")


def source_kind(value: str | os.PathLike[str]) -> SourceKind:
    """Whether a model or dataset argument is a Hub id, an ``s3://`` URI or a local path.

    Local: a ``file://`` URI, a value starting with ``/``, ``.`` or ``~``, a path that exists, or anything
    with more than one ``/`` or that is not shaped like a Hub id. ``s3``: ``s3://...``. Hub: ``name`` (as
    ``gpt2``) or ``org/name``. Other URI schemes count as local paths (that do not exist): the commands that
    take only local paths refuse them by name (:func:`require_local_path`).
    """
    if isinstance(value, os.PathLike):
        return "local"
    text = str(value).strip()
    if text[:5].lower() == "s3://":
        return "s3"
    if text.startswith(("file://", "/", ".", "~")) or Path(text).expanduser().exists():
        return "local"
    if not _HUB_ID_RE.match(text):  # more than one '/' included
        return "local"
    return "hub"


def local_source_path(value: str | os.PathLike[str]) -> Path:
    """The directory a local model or dataset argument names (``file://`` removed, ``~`` expanded)."""
    text = value if isinstance(value, os.PathLike) else str(value).strip().removeprefix("file://")
    return Path(text).expanduser()


def require_local_or_s3(flag: str, value: str | os.PathLike[str] | None, hint: str = "") -> None:
    """:func:`require_local_path` that also takes a well-formed ``s3://bucket/prefix`` (a bad bucket name or
    ``..`` segment is refused in one line naming ``flag``), for the inputs read from object storage too."""
    if value is None or source_kind(value) != "s3":
        if value is not None and has_scheme(value):
            raise UserError(
                f"{flag} {redact(str(value).strip())!r}: only s3:// URIs and local paths are supported"
                + (f"; {hint}" if hint else ".")
            )
        return
    try:
        Location.parse(value)
    except UserError as e:
        raise UserError(f"{flag}: {e}") from None
