"""Small directories to upload, and clients with tight retry budgets (so fault tests end quickly)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from boto3.s3.transfer import TransferConfig

from rloo.storage import s3_client

MiB = 1024 * 1024
# Multipart above 5 MiB (S3's smallest part size), so an 11 MiB file goes up in three parts.
SMALL_PARTS = TransferConfig(
    multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB, max_concurrency=4, num_download_attempts=4
)


def make_tree(root: Path, *, big: int = 11 * MiB, seed: bytes = b"") -> Path:
    """A model-like directory: a config, a nested tokenizer file, one multipart-sized weights file."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"model_type": "gpt_neox", "seed": seed.hex()}))
    (root / "tokenizer").mkdir(exist_ok=True)
    (root / "tokenizer" / "vocab.txt").write_text("a\nb\nc\n" + seed.hex())
    (root / "model.safetensors").write_bytes(os.urandom(big))
    return root


def tight_client(endpoint: str | None = None, *, attempts: int = 3, read_timeout: float = 3.0) -> Any:
    return s3_client(endpoint, max_attempts=attempts, connect_timeout=1.0, read_timeout=read_timeout)


def same_tree(a: Path, b: Path) -> bool:
    def files(root: Path) -> dict[str, bytes]:
        return {
            p.relative_to(root).as_posix(): p.read_bytes()
            for p in root.rglob("*")
            if p.is_file() and p.name != "_MANIFEST.json"
        }

    return files(a) == files(b)
