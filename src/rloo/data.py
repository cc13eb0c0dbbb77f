"""Prompt datasets: a Hub id, or a local directory laid out like a Hub dataset repository.

Local layout (what ``huggingface-cli download --repo-type dataset`` leaves behind)::

    <dir>/data/<split>-00000-of-00001.parquet   (or .jsonl / .json; any split name, e.g. descriptiveness)

Only the ``prompt`` column is required: plain text, or chat messages (a list of ``{"role", "content"}``)
to which the tokenizer's chat template is applied. Every other column is passed to reward functions.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rloo.errors import UserError

log = logging.getLogger(__name__)

_DATA_SUFFIXES = (".parquet", ".jsonl", ".json")
# "<split>-00000-of-00001.parquet", "<split>-foo.jsonl" or "<split>.jsonl"
_SPLIT_RE = re.compile(r"^(?P<split>[A-Za-z0-9_.]+?)(?:-[^/]*)?\.(?:parquet|jsonl|json)$")


@dataclass
class PromptDataset:
    """Rows of one split: ``prompts[i]`` and, for every other column c, ``extra[c][i]``."""

    prompts: list[Any]
    extra: dict[str, list[Any]] = field(default_factory=dict)
    split: str = "train"

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


def read_split(
    name: str,
    split: str,
    *,
    config: str | None = None,
    fallback_split: str | None = None,
    split_flags: str = "--dataset_train_split / --dataset_test_split",
) -> tuple[dict[str, list[Any]], str]:
    """The columns of one split of a local Hub-layout directory or a Hub dataset, and the split's name
    (``fallback_split`` when ``split`` is absent and a fallback is given). ``split_flags`` names the
    flags a user changes to pick another split, for the error message."""
    root = Path(name).expanduser()
    looks_local = root.exists() or name.startswith((".", "/", "~")) or name.count("/") > 1
    if not looks_local:
        try:
            return _load_hub(name, config, split), split
        except UserError:
            if fallback_split is None:
                raise
            log.warning("dataset has no split %r; using %r for it", split, fallback_split)
            return _load_hub(name, config, fallback_split), fallback_split
    if not root.is_dir():
        raise UserError(
            f"--dataset_name {name}: no such directory; pass a local dataset directory or a Hub id."
        )
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
    return _read_files(splits[split]), split


def load_prompt_dataset(
    name: str, split: str, *, config: str | None = None, fallback_split: str | None = None
) -> PromptDataset:
    """Load one split; if it is absent and ``fallback_split`` is given, load that split instead."""
    columns, split = read_split(name, split, config=config, fallback_split=fallback_split)
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
    return PromptDataset(prompts=prompts, extra=columns, split=split)


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
