"""Prompt datasets: a Hub id, a local directory laid out like a Hub dataset repository, or an ``s3://`` prefix
holding such a directory as uploaded by :func:`rloo.storage.upload_dir`.

Local layout (what ``huggingface-cli download --repo-type dataset`` leaves behind)::

    <dir>/data/<split>-00000-of-00001.parquet   (or .jsonl / .json; any split name, e.g. descriptiveness)

Only the ``prompt`` column is required: plain text, or chat messages (a list of ``{"role", "content"}``)
to which the tokenizer's chat template is applied. Every other column is passed to reward functions.

An ``s3://`` dataset is read like a model: downloaded (once per machine, into a per-URI directory under the
system temp dir) with every file checked against the SHA-256 of the upload's manifest; a prefix without a
manifest is refused. Every split read is recorded as a :class:`DatasetRecord` (name, source, digest), which
the MLflow sink logs as the run's dataset input.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import re
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rloo.errors import UserError
from rloo.storage.location import SourceKind, local_source_path, source_kind

log = logging.getLogger(__name__)

_DATA_SUFFIXES = (".parquet", ".jsonl", ".json")
# "<split>-00000-of-00001.parquet", "<split>-foo.jsonl" or "<split>.jsonl"
_SPLIT_RE = re.compile(r"^(?P<split>[A-Za-z0-9_.]+?)(?:-[^/]*)?\.(?:parquet|jsonl|json)$")

# MLflow keeps at most 36 characters of a dataset digest; the runs table shows it next to the name.
MLFLOW_DIGEST_CHARS = 12
# Beside the trained model: the training split as the trainer read it (the model card names it from here).
TRAINING_DATASET_FILE = "training_dataset.json"


@dataclass(frozen=True)
class DatasetRecord:
    """Which dataset a stage read: what the model card and the MLflow run record.

    ``digest``: ``sha256:<hex>`` over the data files of a local or ``s3://`` dataset (every split: each
    file's path, size and SHA-256, the same for the same files wherever they are stored), the resolved
    commit of a Hub dataset when the Hub said which, else None.
    """

    name: str  # as the user gave it
    split: str
    kind: SourceKind
    source: str  # the Hub id, the s3:// URI or the absolute local directory
    digest: str | None
    config: str | None = None
    num_rows: int | None = None

    @property
    def display_name(self) -> str:
        """The short name the MLflow runs table shows: the Hub id, else the directory's or prefix's name."""
        base = self.name if self.kind == "hub" else self.source.rstrip("/").rsplit("/", 1)[-1] or self.source
        return f"{base}:{self.split}"

    @property
    def short_digest(self) -> str:
        """At most MLFLOW_DIGEST_CHARS characters: the content digest, or a hash of name, config and split
        for a Hub dataset whose commit is unknown."""
        full = self.digest or hashlib.sha256(f"{self.name}\0{self.config}\0{self.split}".encode()).hexdigest()
        return full.rsplit(":", 1)[-1][:MLFLOW_DIGEST_CHARS]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> DatasetRecord:
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in json.loads(text).items() if k in fields})

    def describe(self) -> str:
        """One line for a model card: name, split and digest."""
        what = "commit" if self.kind == "hub" else "digest"
        config = f", config {self.config}" if self.config else ""
        digest = f", {what} {self.digest}" if self.digest else ""
        return f"{self.name} (split {self.split}{config}{digest})"


# The records of the splits read in this process, by (name, config, split): a stage reads its dataset
# before it opens its tracking run, and the sink logs what was read (see rloo.tracking.mlflow_sink).
_READ: dict[tuple[str, str | None, str], DatasetRecord] = {}


def files_digest(entries: Iterable[tuple[str, int, str]]) -> str:
    """``sha256:<hex>`` over (relative path, size, SHA-256) of each file, in path order."""
    h = hashlib.sha256()
    for path, size, sha in sorted(entries):
        h.update(f"{path}\0{size}\0{sha}\n".encode())
    return "sha256:" + h.hexdigest()


def data_file_paths(rel_paths: Iterable[str]) -> list[str]:
    """The data files among relative paths (a manifest's): those :func:`local_splits` reads, under
    ``data/`` or, when there are none there, at the top."""
    rels = sorted(rel_paths)
    for base in ("data/", ""):
        found = [
            r
            for r in rels
            if r.startswith(base) and "/" not in r[len(base) :] and _SPLIT_RE.match(r[len(base) :])
        ]
        if found:
            return found
    return []


def _local_digest(root: Path, splits: dict[str, list[Path]], known: dict[str, str] | None = None) -> str:
    """:func:`files_digest` of a local dataset's data files; ``known``: SHA-256s already verified (a download)."""
    from rloo.storage.manifest import sha256_file

    entries = []
    for files in splits.values():
        for f in files:
            rel = f.relative_to(root).as_posix()
            sha = (known or {}).get(rel) or sha256_file(f)
            entries.append((rel, f.stat().st_size, sha))
    return files_digest(entries)


@dataclass
class PromptDataset:
    """Rows of one split: ``prompts[i]`` and, for every other column c, ``extra[c][i]``."""

    prompts: list[Any]
    extra: dict[str, list[Any]] = field(default_factory=dict)
    split: str = "train"
    record: DatasetRecord | None = None  # what was read: name, source, digest

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def conversational(self) -> bool:
        return bool(self.prompts) and isinstance(self.prompts[0], list)

    def extra_for(self, indices: list[int]) -> dict[str, list[Any]]:
        return {c: [vals[i] for i in indices] for c, vals in self.extra.items()}


def local_splits(root: Path) -> dict[str, list[Path]]:
    """Map split name -> its data files, found under ``root/data`` (or ``root`` itself)."""
    found: dict[str, list[Path]] = {}
    for base in (root / "data", root):
        if not base.is_dir():
            continue
        for path in sorted(base.iterdir()):
            m = _SPLIT_RE.match(path.name)
            if path.is_file() and m:
                found.setdefault(m.group("split"), []).append(path)
        if found:
            break
    return found


def _read_files(files: list[Path]) -> dict[str, list[Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    tables = []
    for path in files:
        try:
            if path.suffix == ".parquet":
                tables.append(pq.read_table(path))
            else:
                text = path.read_text()
                rows = json.loads(text) if path.suffix == ".json" and text.lstrip().startswith("[") else None
                if rows is None:
                    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
                tables.append(pa.Table.from_pylist(rows))
        except (OSError, ValueError, pa.ArrowException) as e:
            raise UserError(
                f"cannot read dataset file {path}: {type(e).__name__}: {e}".splitlines()[0]
            ) from None
    columns: dict[str, list[Any]] = {}
    for table in tables:
        for name in table.column_names:
            columns.setdefault(name, [])
        n = table.num_rows
        for name in columns:
            columns[name].extend(table.column(name).to_pylist() if name in table.column_names else [None] * n)
    return columns


def _load_hub(name: str, config: str | None, split: str) -> dict[str, list[Any]]:
    try:
        import datasets
    except ImportError:  # pragma: no cover - the train extra installs it
        raise UserError(
            f"--dataset_name {name}: Hub datasets need the 'datasets' package (pip install datasets)."
        ) from None
    try:
        ds = datasets.load_dataset(name, config, split=split)
    except ValueError as e:
        if "split" in str(e).lower():
            raise UserError(
                f"--dataset_name {name} has no split {split!r}: {str(e).splitlines()[0]}"
            ) from None
        raise UserError(f"--dataset_name {name}: {str(e).splitlines()[0]}") from None
    except Exception as e:  # network, auth, missing repo: all user-fixable, none worth a traceback
        raise UserError(
            f"--dataset_name {name}: could not load it from the Hub ({type(e).__name__}); check the id, your "
            "network and HF_TOKEN, or pass a local directory."
        ) from None
    return ds.to_dict()


def _upload_hint(uri: str) -> str:
    return (
        "upload the dataset directory with rloo's storage upload, which records every file's SHA-256: "
        f"python -c \"from rloo.storage import upload_dir; upload_dir('DATASET_DIR', '{uri}')\""
    )


def _s3_manifest(name: str) -> Any:
    """The manifest of an ``s3://`` dataset; one line when there is none (not an rloo upload)."""
    from rloo.storage import Location, Manifest
    from rloo.storage.backends import backend_for
    from rloo.storage.manifest import MANIFEST_NAME

    try:
        loc = Location.parse(name)
        backend = backend_for(loc)
        data = backend.read_bytes(MANIFEST_NAME)
        if data is None:
            backend.check_access(create=False)  # a missing bucket or bad credentials say so
        manifest = None if data is None else Manifest.from_json(data, loc.uri)
    except UserError as e:
        raise UserError(f"--dataset_name {name}: {e}") from None
    if manifest is None:
        raise UserError(f"--dataset_name {name}: no {MANIFEST_NAME} at this prefix; {_upload_hint(name)}")
    return manifest


def check_dataset_source(name: str, *, flag: str = "--dataset_name") -> None:
    """Without reading any rows: a local dataset directory must exist and an ``s3://`` prefix must hold a
    complete upload (its manifest, with data files); a Hub id passes. One-line UserErrors naming ``flag``."""
    kind = source_kind(name)
    if kind == "hub":
        return
    try:
        if kind == "s3":
            manifest = _s3_manifest(name)
            if not data_file_paths(f.path for f in manifest.files):
                raise UserError(
                    f"--dataset_name {name}: the upload holds no data files; expected data/<split>-*.parquet or "
                    ".jsonl files."
                )
            return
        if not local_source_path(name).is_dir():
            raise UserError(
                f"--dataset_name {name}: no such directory; pass a local dataset directory, an s3:// upload or "
                "a Hub id."
            )
    except UserError as e:
        raise UserError(str(e).replace("--dataset_name", flag, 1)) from None


def fetch_s3_dataset(name: str) -> tuple[Path, dict[str, str]]:
    """Download an ``s3://`` dataset (verified against its manifest) into this machine's cache directory for
    that URI, once: processes of one machine share it (a file lock), later reads find the verified copy.
    Returns the directory and the verified SHA-256 of each file."""
    import fcntl

    from rloo.storage import download_dir

    _s3_manifest(name)  # a prefix without one is refused in one line, with how to upload it
    uri = name.strip().rstrip("/")
    dest = Path(tempfile.gettempdir()) / "rloo-datasets" / hashlib.sha256(uri.encode()).hexdigest()[:16]
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f"{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            manifest = download_dir(uri, dest, progress=False, overwrite=True)
        except UserError as e:  # a tampered or damaged file: its SHA-256 does not match the manifest
            raise UserError(f"--dataset_name {name}: {e}") from None
    return dest, {f.path: f.sha256 for f in manifest.files}


@functools.lru_cache(maxsize=64)
def _hub_commit(name: str) -> str | None:
    """The commit the Hub's main branch of dataset ``name`` is at, or None (offline, no access)."""
    try:
        from huggingface_hub import HfApi

        sha = HfApi().dataset_info(name, timeout=10).sha
    except Exception as e:  # offline mode, no network, a mirror without the API: the name is recorded
        log.info("could not resolve the Hub commit of dataset %s (%s)", name, type(e).__name__)
        return None
    return str(sha) if sha else None


def read_split(
    name: str,
    split: str,
    *,
    config: str | None = None,
    fallback_split: str | None = None,
    split_flags: str = "--dataset_train_split / --dataset_test_split",
) -> tuple[dict[str, list[Any]], str]:
    """The columns of one split of a local Hub-layout directory, an ``s3://`` upload of one or a Hub dataset,
    and the split's name (``fallback_split`` when ``split`` is absent and a fallback is given). ``split_flags``
    names the flags a user changes to pick another split, for the error message. The split read is
    recorded (:func:`dataset_record`)."""
    kind = source_kind(name)
    if kind == "hub":
        try:
            columns = _load_hub(name, config, split)
        except UserError:
            if fallback_split is None:
                raise
            log.warning("dataset has no split %r; using %r for it", split, fallback_split)
            split = fallback_split
            columns = _load_hub(name, config, split)
        _remember(DatasetRecord(name, split, "hub", name, _hub_commit(name), config, num_rows(columns)))
        return columns, split
    known: dict[str, str] | None = None
    if kind == "s3":
        root, known = fetch_s3_dataset(name)
        source = name.strip().rstrip("/")
    else:
        check_dataset_source(name)  # the directory must be there
        root = local_source_path(name)
        source = str(root.resolve())
    splits = local_splits(root)
    if not splits:
        raise UserError(
            f"--dataset_name {name}: no data files found; expected data/<split>-*.parquet or .jsonl files."
        )
    if split not in splits:
        if fallback_split is None or fallback_split not in splits:
            raise UserError(
                f"--dataset_name {name} has no split {split!r}; available: {', '.join(sorted(splits))}. "
                f"Choose one with {split_flags}."
            )
        log.warning("dataset has no split %r; using %r for it", split, fallback_split)
        split = fallback_split
    columns = _read_files(splits[split])
    _remember(
        DatasetRecord(
            name, split, kind, source, _local_digest(root, splits, known), config, num_rows(columns)
        )
    )
    return columns, split


def num_rows(columns: dict[str, list[Any]]) -> int:
    """The rows of a split read as columns (the longest column)."""
    return max((len(v) for v in columns.values()), default=0)


def _remember(record: DatasetRecord) -> None:
    _READ[(record.name, record.config, record.split)] = record


def dataset_record(name: str, split: str, *, config: str | None = None) -> DatasetRecord:
    """The record of split ``split`` of dataset ``name``: the one read in this process, else described
    without reading rows (a local directory's files hashed, an ``s3://`` upload's manifest read; a Hub
    dataset by name and split, its commit unknown). Raises a one-line UserError when the dataset is not
    there."""
    found = _READ.get((name, config, split))
    if found is not None:
        return found
    kind = source_kind(name)
    if kind == "hub":
        return DatasetRecord(name, split, "hub", name, None, config)
    if kind == "s3":
        manifest = _s3_manifest(name)
        sha = {f.path: (f.size, f.sha256) for f in manifest.files}
        entries = [(p, *sha[p]) for p in data_file_paths(sha)]
        return DatasetRecord(name, split, "s3", name.strip().rstrip("/"), files_digest(entries), config)
    check_dataset_source(name)
    root = local_source_path(name)
    return DatasetRecord(
        name, split, "local", str(root.resolve()), _local_digest(root, local_splits(root)), config
    )


def load_prompt_dataset(
    name: str, split: str, *, config: str | None = None, fallback_split: str | None = None
) -> PromptDataset:
    """Load one split; if it is absent and ``fallback_split`` is given, load that split instead."""
    columns, split = read_split(name, split, config=config, fallback_split=fallback_split)
    record = dataset_record(name, split, config=config)  # the one read_split recorded
    if not any(columns.values()):  # no rows at all (an empty .jsonl has no columns either)
        raise UserError(
            f"--dataset_name {name} split {split!r} is empty; give a split with at least one prompt."
        )
    if "prompt" not in columns:
        raise UserError(
            f"--dataset_name {name} split {split!r} has no 'prompt' column (columns: "
            f"{', '.join(sorted(columns)) or 'none'}); rename the prompt column to 'prompt'."
        )
    prompts = columns.pop("prompt")
    if not prompts:
        raise UserError(
            f"--dataset_name {name} split {split!r} is empty; give a split with at least one prompt."
        )
    for i, p in enumerate(prompts):
        if not (isinstance(p, str) or (isinstance(p, list) and all(isinstance(m, dict) for m in p))):
            raise UserError(
                f"--dataset_name {name}: row {i} of 'prompt' is {type(p).__name__}; each prompt must be text or "
                "a list of chat messages."
            )
    return PromptDataset(prompts=prompts, extra=columns, split=split, record=record)


def format_prompts(prompts: list[Any], tokenizer: Any) -> list[str]:
    """Prompt text as the policy sees it: chat messages go through the tokenizer's chat template."""
    if prompts and isinstance(prompts[0], list):
        if getattr(tokenizer, "chat_template", None) is None:
            raise UserError(
                "the prompts are chat messages but the tokenizer has no chat template; use a chat model's "
                "tokenizer or a dataset of plain-text prompts."
            )
        return [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    return list(prompts)


def tokenize_prompts(texts: list[str], tokenizer: Any, *, chat: bool) -> list[list[int]]:
    """Token ids of each prompt. Chat-formatted text already carries the template's special tokens.

    Over-long prompts are kept whole: the callers cut them from the left to fit the model (and say so once),
    so transformers' own "will result in indexing errors" warning would be a second, wrong line.
    """
    return tokenizer(texts, add_special_tokens=not chat, verbose=False)["input_ids"]
