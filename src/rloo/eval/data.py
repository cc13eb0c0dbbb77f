"""Evaluation rows: a prompt and its reference completion, from ``prompt`` + ``completion`` columns (as in
trl-lib/tldr) or from chat ``messages`` whose last turn is the assistant's reference answer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The prompt loader's readers are reused so local layouts, s3:// uploads and Hub ids behave exactly as in
# `rloo train`.
from rloo.data import DatasetRecord, dataset_record, num_rows, read_split
from rloo.errors import UserError
from rloo.judging.templates import completion_text, prompt_text


@dataclass
class EvalRows:
    prompts: list[Any]  # text, or chat messages (what the model is given)
    references: list[str]
    judge_prompts: list[str]  # the prompt as plain text, for the judge
    record: DatasetRecord | None = None  # what was read: name, source, digest
    rows: list[dict[str, Any]] | None = None  # every column of each row (an environment is reset with it)

    def __len__(self) -> int:
        return len(self.prompts)


def load_eval_rows(
    name: str, split: str, *, config: str | None = None, num_examples: int | None = None
) -> EvalRows:
    """The first ``num_examples`` rows of ``split`` with their references; one-line UserErrors otherwise."""
    cols, _ = read_split(name, split, config=config, split_flags="--dataset_split")
    record = dataset_record(name, split, config=config)  # the one read_split recorded
    n_rows = num_rows(cols)
    if n_rows == 0:
        raise UserError(
            f"--dataset_name {name} split {split!r} is empty; give a split with at least one row."
        )
    n = n_rows if num_examples is None else min(num_examples, n_rows)
    where = f"--dataset_name {name} split {split!r}"
    prompts: list[Any] = []
    refs: list[str] = []
    if "prompt" in cols and "completion" in cols:
        for i in range(n):
            p, ref = cols["prompt"][i], completion_text(cols["completion"][i])
            if ref is None or not isinstance(p, (str, list)):
                raise UserError(f"{where}: row {i} has no usable prompt/completion; fix or drop that row.")
            prompts.append(p)
            refs.append(ref)
    elif "messages" in cols:
        for i in range(n):
            msgs = cols["messages"][i]
            if not (isinstance(msgs, list) and msgs and isinstance(msgs[-1], dict)):
                raise UserError(f"{where}: row {i} of 'messages' is not a list of chat messages.")
            if msgs[-1].get("role") != "assistant" or len(msgs) < 2:
                raise UserError(
                    f"{where}: row {i} of 'messages' does not end with an assistant turn after a prompt; "
                    "the last assistant message is the reference."
                )
            prompts.append(msgs[:-1])
            refs.append(str(msgs[-1].get("content", "")))
    else:
        raise UserError(
            f"{where} has no reference completions (columns: {', '.join(sorted(cols)) or 'none'}); expected "
            "'prompt' + 'completion' columns or chat 'messages' ending with the assistant's answer."
        )
    columns = [{c: vals[i] for c, vals in cols.items()} for i in range(n)]
    return EvalRows(
        prompts=prompts,
        references=refs,
        judge_prompts=[prompt_text(p) for p in prompts],
        record=record,
        rows=columns,
    )
