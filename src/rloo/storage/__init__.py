"""Artifacts in S3-compatible object storage or local directories, never half-written.

Every uploaded directory gets a manifest (file list, sizes, SHA-256) written last; readers refuse a prefix
without one or whose files do not match it. See :mod:`rloo.storage.transfer` for the protocol.

Locations are ``s3://bucket/prefix`` (endpoint and credentials from the AWS environment plus
``S3_ENDPOINT_URL``), ``file:///abs/path`` or plain local paths, with the same semantics.
"""

from rloo.storage.checkpoints import CheckpointMirror
from rloo.storage.errors import IncompleteArtifactError, StorageError, StorageUnavailable
from rloo.storage.location import Location
from rloo.storage.manifest import MANIFEST_NAME, FileEntry, Manifest, build_manifest, write_manifest
from rloo.storage.redact import redact
from rloo.storage.s3 import resolve_endpoint, s3_client
from rloo.storage.transfer import (
    delete_prefix,
    download_dir,
    is_complete,
    latest_complete_prefix,
    list_complete_prefixes,
    publish_atomic,
    read_manifest,
    upload_dir,
    verify_prefix,
)

__all__ = [
    "MANIFEST_NAME",
    "CheckpointMirror",
    "FileEntry",
    "IncompleteArtifactError",
    "Location",
    "Manifest",
    "StorageError",
    "StorageUnavailable",
    "build_manifest",
    "delete_prefix",
    "download_dir",
    "is_complete",
    "latest_complete_prefix",
    "list_complete_prefixes",
    "publish_atomic",
    "read_manifest",
    "redact",
    "resolve_endpoint",
    "s3_client",
    "upload_dir",
    "verify_prefix",
    "write_manifest",
]
