"""Prompt datasets: a Hub id, a local directory laid out like a Hub dataset repository, or an ``s3://`` prefix
holding such a directory, whoever wrote it (rloo's storage upload, ``aws s3 cp``, Spark, ``to_parquet``).

Which files form which split follows the Hugging Face ``datasets`` library (``get_data_patterns`` in
huggingface/datasets ``src/datasets/data_files.py``), so a directory splits here as ``load_dataset`` splits
it: ``data/<split>-00000-of-00002.parquet`` (any split name), else directories named after a split
(``train/part-00000-*.snappy.parquet``), else file names holding one (``train.jsonl``, ``my_test_0.csv``),
else everything is ``train``. Hidden files, ``__special__`` directories, ``README.md`` and the like are
never data; the ``.parquet``, ``.jsonl``, ``.json`` and ``.csv`` files of a split are read.

Only the ``prompt`` column is required: plain text, or chat messages (a list of ``{"role", "content"}``)
to which the tokenizer's chat template is applied. Every other column is passed to reward functions.

An ``s3://`` dataset is downloaded once per machine (into a per-URI directory under the system temp dir):
an upload with rloo's ``_MANIFEST.json`` has every file checked against its SHA-256; a prefix without one
has its data files read as listed (see :mod:`rloo.storage.prefix`). Every split read is recorded as a
:class:`DatasetRecord` (name, source, digest, and each file read with its key, size, ETag and SHA-256),
which the MLflow sink logs as the run's dataset input.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rloo.errors import UserError
from rloo.storage.location import SourceKind, local_source_path, source_kind
from rloo.storage.prefix import ReadFile, ReadPrefix

log = logging.getLogger(__name__)

# MLflow keeps at most 36 characters of a dataset digest; the runs table shows it next to the name.
MLFLOW_DIGEST_CHARS = 12
# Beside the trained model: the training split as the trainer read it (the model card names it from here).
TRAINING_DATASET_FILE = "training_dataset.json"
# The formats read (the last suffix decides: "part-0.snappy.parquet" is parquet; compressed files are not read)
DATA_SUFFIXES = (".parquet", ".jsonl", ".json", ".csv")

# --- which files form which split: huggingface/datasets src/datasets/data_files.py ----------------------------
# In order, the first stage that matches any file decides: the sharded names (their split names taken from
# the file names), then each dict of split -> patterns (a split is there when one of its patterns matches).
_SHARDED = "data/{split}-[0-9][0-9][0-9][0-9][0-9]-of-[0-9][0-9][0-9][0-9][0-9]*.*"
_DEFAULT_SPLITS = ("train", "validation", "test")
_SPLIT_KEYWORDS = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "dev", "val"),
    "test": ("test", "testing", "eval", "evaluation"),
}
_SEP = "-._ 0-9"  # NON_WORDS_CHARS
_IN_FILENAME = ("**/{keyword}[{sep}]*", "**/*[{sep}]{keyword}[{sep}]*")  # fsspec >= 2023.12's patterns
_IN_DIR_NAME = (
    "**/{keyword}/**",
    "**/{keyword}[{sep}]*/**",
    "**/*[{sep}]{keyword}/**",
    "**/*[{sep}]{keyword}[{sep}]*/**",
)


def _by_keyword(bases: tuple[str, ...]) -> dict[str, list[str]]:
    return {
        split: [b.format(keyword=k, sep=_SEP) for k in _SPLIT_KEYWORDS[split] for b in bases]
        for split in _DEFAULT_SPLITS
    }


_PATTERN_STAGES: tuple[dict[str, list[str]], ...] = (
    {"logs": ["**/*.eval"]},  # DEFAULT_PATTERNS_LOGS
    {"test": ["**/task.toml", "**/instruction.md"]},  # DEFAULT_PATTERNS_HARBOR
    _by_keyword(_IN_DIR_NAME),
    _by_keyword(_IN_FILENAME),
    {"train": ["**"]},  # DEFAULT_PATTERNS_ALL
)
_FILES_TO_IGNORE = frozenset(
    (
        "README.md",
        "config.json",
        "dataset_info.json",
        "dataset_infos.json",
        "dummy_data.zip",
        "dataset_dict.json",
    )
)
_SPLIT_NAME_RE = re.compile(r"^\w+(\.\w+)*$")  # datasets.naming._split_re


@functools.lru_cache(maxsize=128)
def _glob(pattern: str) -> re.Pattern[str]:
    """A glob as fsspec (>= 2023.12) matches it against relative paths: a ``**`` segment spans any number of
    directories (none included), ``*`` and ``[...]`` stay within one name."""
    out = []
    segments = pattern.split("/")
    for i, seg in enumerate(segments):
        last = i == len(segments) - 1
        if seg == "**":
            out.append(".*" if last else "(?:.+/)?")
            continue
        for piece in re.split(r"(\*|\?|\[[^]]*\])", seg):
            if piece == "*":
                out.append("[^/]*")
            elif piece == "?":
                out.append("[^/]")
            elif piece.startswith("[") and piece.endswith("]") and len(piece) > 2:
                body = piece[1:-1]
                neg = body.startswith("!")
                body = body[1:] if neg else body
                out.append("[" + ("^" if neg else "") + body.replace("\\", "\\\\").replace("^", "\\^") + "]")
            else:
                out.append(re.escape(piece))
        if not last:
            out.append("/")
    return re.compile("".join(out) + r"\Z", re.S)


def _visible(rel: str) -> bool:
    """What datasets' resolve_pattern considers at all: no hidden part (``.x``), no ``__special__`` parent
    directory, not one of its FILES_TO_IGNORE; rloo's own manifest is metadata too."""
    parts = rel.split("/")
    if any(p.startswith(".") and set(p) != {"."} for p in parts) or any(
        p.startswith("__") for p in parts[:-1]
    ):
        return False
    return parts[-1] not in _FILES_TO_IGNORE and rel != _manifest_name()


def _manifest_name() -> str:
    from rloo.storage.manifest import MANIFEST_NAME

    return MANIFEST_NAME


def _split_patterns(paths: Sequence[str]) -> dict[str, list[str]]:
    """datasets' ``_get_data_files_patterns``: split -> its patterns, from the first stage that matches."""
    sharded = _glob(_SHARDED.replace("{split}", "*"))
    # datasets.utils.py_utils.string_to_dict: "{split}" becomes a greedy group of the file name's pattern
    name_rx = re.compile(re.sub(r"{([^}]+)}", r"(?P<_\1>.+)", _SHARDED.rsplit("/", 1)[-1]))
    names = {
        m.group("_split") for p in paths if sharded.match(p) and (m := name_rx.search(p.rsplit("/", 1)[-1]))
    }
    if names:
        bad = sorted(n for n in names if not _SPLIT_NAME_RE.match(n))
        if bad:
            raise UserError(
                f"split name {bad[0]!r} (from data/{bad[0]}-NNNNN-of-NNNNN file names) is not a valid split "
                "name: use letters, digits and '_' (dots between words)."
            )
        ordered = [s for s in _DEFAULT_SPLITS if s in names] + sorted(names - set(_DEFAULT_SPLITS))
        return {s: [_SHARDED.format(split=s)] for s in ordered}
    for stage in _PATTERN_STAGES:
        found = {s: pats for s, pats in stage.items() if any(_glob(p).match(x) for p in pats for x in paths)}
        if found:
            return found
    return {}


def hub_splits(rel_paths: Iterable[str]) -> dict[str, list[str]]:
    """Split name -> its data files (paths relative to the dataset's root, in the order ``datasets`` reads
    them), from every file's relative path, by the rules of huggingface/datasets ``data_files.py`` (see the
    module docstring). Splits whose files are all in other formats are left out. A sharded split name that
    datasets refuses is a one-line UserError."""
    paths = sorted(p for p in set(rel_paths) if _visible(p))
    out: dict[str, list[str]] = {}
    for split, patterns in _split_patterns(paths).items():
        files: list[str] = []
        for pattern in patterns:
            rx = _glob(pattern)
            files += [p for p in paths if rx.match(p) and p.endswith(DATA_SUFFIXES) and p not in files]
        if files:
            out[split] = files
    return out


def data_file_paths(rel_paths: Iterable[str]) -> list[str]:
    """The data files among relative paths (a listing's or a manifest's): those of every split
    (:func:`hub_splits`), in path order."""
    return sorted({f for files in hub_splits(rel_paths).values() for f in files})


def _no_data_files(name: str, flag: str, paths: Sequence[str]) -> UserError:
    seen = ", ".join(sorted(p for p in paths if _visible(p))[:3]) or "nothing"
    return UserError(
        f"{flag} {name}: no data files found (saw {seen}); expected a Hub dataset layout: "
        f"{', '.join(DATA_SUFFIXES)} files such as data/train-00000-of-00001.parquet, train.jsonl or "
        "train/part-00000.parquet."
    )


@dataclass(frozen=True)
class DatasetRecord:
    """Which dataset a stage read: what the model card and the MLflow run record.

    ``digest``: ``sha256:<hex>`` over the data files of a local or ``s3://`` dataset (every split: each
    file's path, size and SHA-256, the same for the same files wherever they are stored), the resolved
    commit of a Hub dataset when the Hub said which, else None. ``files``: each data file of the split read,
    with its key (object key, or absolute path), size, SHA-256 and (``s3://``) the store's ETag.
    """

    name: str  # as the user gave it
    split: str
    kind: SourceKind
    source: str  # the Hub id, the s3:// URI or the absolute local directory
    digest: str | None
    config: str | None = None
    num_rows: int | None = None
    files: tuple[ReadFile, ...] = ()

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
        values = {k: v for k, v in json.loads(text).items() if k in fields}
        values["files"] = tuple(ReadFile(**f) for f in values.get("files") or ())
        return cls(**values)

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


def _local_files(
    root: Path, splits: dict[str, list[Path]], read: ReadPrefix | None = None
) -> dict[str, ReadFile]:
    """Every data file of a local dataset (or of a downloaded ``s3://`` one: ``read`` says what its store
    listed, SHA-256s already verified), by path relative to ``root``."""
    from rloo.storage.manifest import sha256_file

    known = {f.path: f for f in read.files} if read is not None else {}
    out = {}
    for files in splits.values():
        for f in files:
            rel = f.relative_to(root).as_posix()
            out[rel] = known.get(rel) or ReadFile(
                rel, f.stat().st_size, sha256_file(f), None, str(f.resolve())
            )
    return out


def _digest_of(files: dict[str, ReadFile]) -> str:
    return files_digest((f.path, f.size, f.sha256) for f in files.values())


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


def _scan(root: Path) -> list[str]:
    """Every file below ``root`` (symlinked files followed), as relative POSIX paths."""
    out = []
    for here, _dirs, files in os.walk(root):
        for name in files:
            path = Path(here, name)
            if path.is_file():
                out.append(path.relative_to(root).as_posix())
    return out


def local_splits(root: Path) -> dict[str, list[Path]]:
    """Map split name -> its data files below ``root`` (:func:`hub_splits`)."""
    return {split: [root / rel for rel in rels] for split, rels in hub_splits(_scan(root)).items()}


def _read_table(path: Path) -> Any:
    import pyarrow as pa
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    if path.suffix == ".parquet":
        return pq.read_table(path)
    if path.suffix == ".csv":
        return pcsv.read_csv(path)
    text = path.read_text()
    rows = json.loads(text) if path.suffix == ".json" and text.lstrip().startswith("[") else None
    if rows is None:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return pa.Table.from_pylist(rows)


def _read_files(files: list[Path]) -> dict[str, list[Any]]:
    """The rows of ``files`` as columns; a column some files lack is None in their rows."""
    import pyarrow as pa

    columns: dict[str, list[Any]] = {}
    rows = 0
    for path in files:
        try:
            table = _read_table(path)
        except (OSError, ValueError, pa.ArrowException) as e:
            raise UserError(
                f"cannot read dataset file {path}: {type(e).__name__}: {e}".splitlines()[0]
            ) from None
        for name in table.column_names:
            columns.setdefault(name, [None] * rows)
        for name, values in columns.items():
            values.extend(
                table.column(name).to_pylist() if name in table.column_names else [None] * table.num_rows
            )
        rows += table.num_rows
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
        from rloo.storage.hub import hub_error

        hub = hub_error(e, f"--dataset_name {name}")
        if hub is not None:  # the Hub out of reach exits 75 (a retry may heal it), a missing repo 2
            raise hub from None
        raise UserError(
            f"--dataset_name {name}: could not load it from the Hub ({type(e).__name__}); check the id, your "
            "network and HF_TOKEN, or pass a local directory."
        ) from None
    return ds.to_dict()


def _s3_paths(name: str, flag: str) -> tuple[list[str], bool]:
    """The relative paths of an ``s3://`` dataset's files (its manifest's, else the store's listing) and
    whether it has a manifest; one line naming ``flag`` for a missing bucket, bad credentials (exit 2) or an
    unreachable store (75)."""
    from rloo.storage import Location, read_manifest
    from rloo.storage.errors import prefixed
    from rloo.storage.manifest import MANIFEST_NAME
    from rloo.storage.prefix import list_objects

    try:
        loc = Location.parse(name)
        listed = list_objects(loc)
        if MANIFEST_NAME in listed:
            return [f.path for f in read_manifest(loc).files], True
    except UserError as e:
        raise prefixed(e, f"{flag} {name}") from None
    if not listed:
        raise UserError(
            f"{flag} {name}: no objects under this prefix; check the URI (keys are case-sensitive)."
        )
    return list(listed), False


def check_dataset_source(name: str, *, flag: str = "--dataset_name") -> None:
    """Without reading any rows: a local dataset directory must exist and an ``s3://`` prefix must hold data
    files in a Hub layout (an upload's manifest is read, not checked: the read checks it); a Hub id passes.
    One-line UserErrors naming ``flag``."""
    kind = source_kind(name)
    if kind == "hub":
        return
    if kind == "s3":
        paths, _ = _s3_paths(name, flag)
        if not data_file_paths(paths):
            raise _no_data_files(name, flag, paths)
        return
    if not local_source_path(name).is_dir():
        raise UserError(
            f"{flag} {name}: no such directory; pass a local dataset directory, an s3:// prefix or a Hub id."
        )


def fetch_s3_dataset(name: str) -> tuple[Path, ReadPrefix]:
    """Download an ``s3://`` dataset's data files into this machine's cache directory for that URI, once:
    processes of one machine share it (a file lock), later reads of an unchanged prefix reuse it. An upload
    with a manifest is verified against it (SHA-256 of every file); a prefix without one is read as listed.
    Returns the directory and what was read."""
    from rloo.storage.errors import prefixed
    from rloo.storage.prefix import cached_prefix

    check_dataset_source(name)  # one line for an empty prefix or one without data files
    try:
        return cached_prefix(name.strip().rstrip("/"), "rloo-datasets", select=data_file_paths)
    except UserError as e:  # a tampered or damaged file (its SHA-256 does not match the manifest), ...
        raise prefixed(e, f"--dataset_name {name}") from None


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
    read: ReadPrefix | None = None
    if kind == "s3":
        root, read = fetch_s3_dataset(name)
        source = name.strip().rstrip("/")
    else:
        check_dataset_source(name)  # the directory must be there
        root = local_source_path(name)
        source = str(root.resolve())
    splits = local_splits(root)
    if not splits:
        raise _no_data_files(name, "--dataset_name", _scan(root))
    if split not in splits:
        if fallback_split is None or fallback_split not in splits:
            raise UserError(
                f"--dataset_name {name} has no split {split!r}; available: {', '.join(sorted(splits))}. "
                f"Choose one with {split_flags}."
            )
        log.warning("dataset has no split %r; using %r for it", split, fallback_split)
        split = fallback_split
    columns = _read_files(splits[split])
    _remember(_described(name, split, kind, source, root, splits, read, config, num_rows(columns)))
    return columns, split


def _described(
    name: str,
    split: str,
    kind: SourceKind,
    source: str,
    root: Path,
    splits: dict[str, list[Path]],
    read: ReadPrefix | None,
    config: str | None,
    rows: int | None = None,
) -> DatasetRecord:
    """The record of split ``split`` of the dataset in directory ``root`` (``read``: what its store listed,
    for a downloaded one): the digest over every split's files, the files of this split."""
    files = _local_files(root, splits, read)
    mine = tuple(files[f.relative_to(root).as_posix()] for f in splits.get(split, []))
    return DatasetRecord(name, split, kind, source, _digest_of(files), config, rows, mine)


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
        return _s3_record(name, split, config)
    check_dataset_source(name)
    root = local_source_path(name)
    return _described(name, split, "local", str(root.resolve()), root, local_splits(root), None, config)


def _s3_record(name: str, split: str, config: str | None) -> DatasetRecord:
    """The record of an ``s3://`` dataset not read in this process: an upload's manifest says every SHA-256
    without a download; a prefix without one is read (into the machine's cache) to learn them."""
    from rloo.storage import Location, read_manifest

    uri = name.strip().rstrip("/")
    paths, manifested = _s3_paths(name, "--dataset_name")
    if not manifested:
        root, read = fetch_s3_dataset(name)
        return _described(name, split, "s3", uri, root, local_splits(root), read, config)
    loc = Location.parse(uri)
    manifest = read_manifest(loc)
    below = f"{manifest.root}/" if manifest.root else ""
    files = {
        p: ReadFile(p, manifest.by_path[p].size, manifest.by_path[p].sha256, None, loc.object_key(below + p))
        for p in data_file_paths(paths)
    }
    mine = tuple(files[p] for p in hub_splits(paths).get(split, []))
    return DatasetRecord(name, split, "s3", uri, _digest_of(files), config, None, mine)


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


def format_prompts(
    prompts: list[Any], tokenizer: Any, *, tools: list[dict[str, Any]] | None = None
) -> list[str]:
    """Prompt text as the policy sees it: chat messages go through the tokenizer's chat template (with the
    schemas of the ``tools`` an agent may call)."""
    if tools and prompts and not isinstance(prompts[0], list):
        raise UserError(
            "--tools and --environment need chat prompts (the tools are described through the chat template): "
            "give the dataset a 'prompt' column of message lists."
        )
    if prompts and isinstance(prompts[0], list):
        if getattr(tokenizer, "chat_template", None) is None:
            raise UserError(
                "the prompts are chat messages but the tokenizer has no chat template; use a chat model's "
                "tokenizer or a dataset of plain-text prompts."
            )
        return [
            tokenizer.apply_chat_template(p, tools=tools or None, tokenize=False, add_generation_prompt=True)
            for p in prompts
        ]
    return list(prompts)


def tokenize_prompts(texts: list[str], tokenizer: Any, *, chat: bool) -> list[list[int]]:
    """Token ids of each prompt. Chat-formatted text already carries the template's special tokens.

    Over-long prompts are kept whole: the callers cut them from the left to fit the model (and say so once),
    so transformers' own "will result in indexing errors" warning would be a second, wrong line.
    """
    return tokenizer(texts, add_special_tokens=not chat, verbose=False)["input_ids"]
