"""A toy agent task, offline: a tiny model learns with RL to call a calculator tool instead of guessing.

Each prompt asks for a sum of two digits ("add 3 and 4"); the model may answer directly or call :func:`add`
with a Hermes ``<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>`` block, read the
tool's result and answer. :func:`tool_use_reward` pays for a tool call that returns the right sum.

- :data:`AGENT_CHAT_TEMPLATE` renders tool schemas, tool calls and tool messages for the tiny tokenizer of
  :mod:`rloo.demo.tiny`, every message ended by its EOS token, so appending a tool message never changes how
  the earlier turns tokenize (what a trainer needs to splice a tool's result after a model's turn).
- :func:`write_agent_toy_dataset` writes the prompts as a Hub-style parquet folder, like :mod:`rloo.demo.toy`.
- :func:`build_agent_sft_model` builds a tiny Qwen2 model and warms it up with a few seconds of supervised
  training on episodes of both kinds, so it calls the tool in some of its samples and answers directly in the
  rest: a random-init model would never write a well-formed call, so RL would have nothing to reinforce.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rloo.demo.tiny import EOS_TOKEN, _save_tokenizer, build_causal_lm, build_tokenizer, quiet_progress_bars
from rloo.diskspace import honour_umask

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

__all__ = [
    "AGENT_CHAT_TEMPLATE",
    "TOOL_CALL_TOKENS",
    "add",
    "build_agent_sft_model",
    "build_agent_tokenizer",
    "tool_use_reward",
    "write_agent_toy_dataset",
]

# Added to the tiny tokenizer as single tokens, as Qwen2.5's tokenizer has them: spelt in bytes they would
# cost 17 tokens of every call.
TOOL_CALL_TOKENS = ("<tool_call>", "</tool_call>")

# "role: content" then EOS for every message, tools listed in a first "system" line, and the generation
# prompt "assistant:" with no trailing space, so the completion starts right after it (with the space that
# the rendered "assistant: " carries). The EOS after each message is what keeps the template prefix-preserving
# on this byte-level tokenizer: special tokens split the text, so nothing after one can re-merge the text
# before it. A sampled turn's text, kept as it was, renders as it was sampled: its leading space is the one
# after "assistant:", and the tool_calls parsed from it are not written out again. The {% generation %}
# markers let return_assistant_tokens_mask find the model's own tokens.
AGENT_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- 'system: tools: ' }}"
    "{%- for tool in tools %}"
    "{%- set fn = tool['function'] if tool['function'] is defined else tool %}"
    "{%- set params = fn['parameters']['properties'] if fn['parameters'] is defined"
    " and fn['parameters']['properties'] is defined else {} %}"
    "{{- fn['name'] + '(' + (params | list | join(', ')) + ')' }}"
    "{%- if not loop.last %}{{- ', ' }}{%- endif %}"
    "{%- endfor %}"
    "{{- '" + EOS_TOKEN + "' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- set content = message['content'] if message['content'] is string else '' %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- 'assistant:' }}"
    "{%- generation %}"
    "{{- content if content.startswith(' ') else ' ' + content }}"
    "{%- for call in (message['tool_calls'] or []) if '<tool_call>' not in content %}"
    "{%- set fn = call['function'] if call['function'] is defined else call %}"
    "{%- if fn['arguments'] is string %}"
    "{{- '<tool_call>{\"name\": ' + (fn['name'] | tojson) + ', \"arguments\": ' + fn['arguments'] + '}</tool_call>' }}"
    "{%- else %}"
    "{{- '<tool_call>' + ({'name': fn['name'], 'arguments': fn['arguments']} | tojson) + '</tool_call>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{{- '" + EOS_TOKEN + "' }}"
    "{%- endgeneration %}"
    "{%- else %}"
    "{{- message['role'] + ': ' + content + '" + EOS_TOKEN + "' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- 'assistant:' }}{%- endif %}"
)

_MAX_DIGIT = 9
# How often a warm-start episode calls the tool; the others answer at once, usually wrongly, so the warm
# model calls the tool in about this share of its samples and RL has a choice to sharpen.
_TOOL_EPISODE_SHARE = 0.5
# Heads of 32 dimensions, not tiny.py's 16: wider heads learn sooner to copy the question's digits into the
# call. Whether they learn it within the warm start still depends on the seed (0, 1 and 2 do, 3 does not).
_HIDDEN_SIZE, _NUM_LAYERS, _NUM_HEADS = 96, 2, 3
_SFT_BATCH_SIZE = 16
_SFT_LEARNING_RATE = 6e-3


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.

    Returns:
        The sum of a and b.
    """
    return a + b


def _question(a: int, b: int) -> list[dict[str, str]]:
    """The conversational prompt asking for ``a + b``."""
    return [{"role": "user", "content": f"add {a} and {b}"}]


def write_agent_toy_dataset(
    path: str | Path, *, num_train: int = 256, num_test: int = 32, seed: int = 0
) -> Path:
    """Write the agent toy dataset to ``path`` as a Hub-style parquet folder and return ``path``.

    Files ``data/train-00000-of-00001.parquet`` and ``data/test-00000-of-00001.parquet``; columns ``prompt``
    (``[{"role": "user", "content": "add 3 and 4"}]``, digits 0 to 9) and ``answer`` (the sum as a string,
    the extra column :func:`tool_use_reward` reads); the test split also has ``completion``, the reference
    answer ``rloo eval`` compares with. Rows come from ``random.Random(seed)``. Raises ``ValueError`` for
    non-positive sizes.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    if num_train < 1 or num_test < 1:
        raise ValueError(f"num_train and num_test must be >= 1 (got {num_train}, {num_test})")
    rng = random.Random(seed)
    message = pa.struct([("role", pa.string()), ("content", pa.string())])

    def table(n: int, reference: bool) -> pa.Table:
        pairs = [(rng.randint(0, _MAX_DIGIT), rng.randint(0, _MAX_DIGIT)) for _ in range(n)]
        prompts = pa.array([_question(a, b) for a, b in pairs], type=pa.list_(message))
        answers = pa.array([str(a + b) for a, b in pairs], type=pa.string())
        columns = {"prompt": prompts, "answer": answers}
        if reference:  # what the judge compares an episode with
            columns["completion"] = pa.array([f"{a} + {b} = {a + b}" for a, b in pairs], type=pa.string())
        return pa.table(columns)

    data = Path(path) / "data"
    data.mkdir(parents=True, exist_ok=True)
    for name, n in (("train", num_train), ("test", num_test)):
        pq.write_table(table(n, reference=name == "test"), data / f"{name}-00000-of-00001.parquet")
    return Path(path)


def _episode_score(completion: Any, answer: str) -> float:
    """1.0 when a tool message holds ``answer``, 0.5 when a tool call succeeded with another value, else 0.0."""
    if isinstance(completion, str):
        return 0.0  # single-turn text: no tool ran
    results = [
        str(m.get("content") or "").strip()
        for m in completion
        if isinstance(m, dict) and m.get("role") == "tool"
    ]
    if str(answer).strip() in results:
        return 1.0
    return 0.5 if any(not r.startswith("error") for r in results) else 0.0


def tool_use_reward(completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
    """Reward each episode for the calculator's result: 1.0 for the right sum, 0.5 for another, else 0.0.

    A completion is the list of an episode's messages after the prompt: ``assistant`` turns and ``tool``
    messages whose ``content`` is the tool's result (an error result starts with "error"). A tool message
    equal to the row's ``answer`` (the dataset column) scores 1.0; a successful call with another value
    0.5; no call, or only failed ones, 0.0. A plain string (a single-turn completion) scores 0.0. Raises
    ``ValueError`` when ``answer`` and ``completions`` differ in length.
    """
    if len(answer) != len(completions):
        raise ValueError(f"got {len(completions)} completions but {len(answer)} answers")
    return [_episode_score(c, a) for c, a in zip(completions, answer, strict=True)]


def _tool_schema() -> dict[str, Any]:
    """:func:`add` as the chat template's tool schema."""
    from transformers.utils import get_json_schema

    return get_json_schema(add)


def _episode(rng: random.Random) -> list[dict[str, Any]]:
    """A warm-start conversation: the question, then a tool call, its result and the answer, or a guess."""
    a, b = rng.randint(0, _MAX_DIGIT), rng.randint(0, _MAX_DIGIT)
    if rng.random() >= _TOOL_EPISODE_SHARE:
        return [*_question(a, b), {"role": "assistant", "content": str(rng.randint(0, 2 * _MAX_DIGIT))}]
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}
    return [
        *_question(a, b),
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "add", "content": str(a + b)},
        {"role": "assistant", "content": str(a + b)},
    ]


def _encode(
    tokenizer: PreTrainedTokenizerFast, messages: list[dict[str, Any]], tools: list[Any]
) -> tuple[list[int], list[int]]:
    """An episode's token ids and its labels: the assistant turns' own tokens, -100 elsewhere."""
    # a BatchEncoding here (return_dict), which the stubs do not say
    out: Any = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids = list(out["input_ids"])
    labels = [t if m else -100 for t, m in zip(ids, out["assistant_masks"], strict=True)]
    return ids, labels


def build_agent_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """Build :mod:`rloo.demo.tiny`'s tokenizer for the agent task, save it to ``path`` and return it.

    :func:`rloo.demo.tiny.build_tokenizer`'s byte-level BPE with a pad token ``<|pad|>`` of its own,
    ``<tool_call>`` and ``</tool_call>`` as single (not special) tokens, and :data:`AGENT_CHAT_TEMPLATE`.
    """
    from tokenizers import AddedToken

    path = Path(path)
    # A pad token of its own: prompts hold EOS tokens here, which padding with EOS would blur.
    tokenizer = build_tokenizer(path, with_pad_token=True, with_chat_template=False)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_CALL_TOKENS])
    tokenizer.chat_template = AGENT_CHAT_TEMPLATE
    _save_tokenizer(tokenizer, path)
    return tokenizer


def build_agent_sft_model(
    path: str | Path,
    *,
    seed: int = 0,
    steps: int = 500,
    hidden_size: int = _HIDDEN_SIZE,
    num_heads: int = _NUM_HEADS,
) -> Path:
    """Build a tiny Qwen2 model, warm it up on toy agent episodes and save it with its tokenizer to ``path``.

    The tokenizer is :func:`build_agent_tokenizer`'s. The model, random-init by
    :func:`rloo.demo.tiny.build_causal_lm`, then takes ``steps`` AdamW steps on the CPU over episodes
    rendered with the template (the tool listed): half call :func:`add` and answer with its result, half
    guess a number at once; the loss is on the assistant turns only. So the saved model starts some of its
    turns with a well-formed call and others with a guess. Deterministic for ``seed``, the caller's RNG state
    untouched; about 20 s on two CPU cores. ``hidden_size`` / ``num_heads``: vLLM's CPU attention needs heads of
    64 dimensions (128 / 2). Returns ``path``.
    """
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    tokenizer = build_agent_tokenizer(path)
    build_causal_lm(
        path,
        path,
        arch="qwen2",
        hidden_size=hidden_size,
        num_layers=_NUM_LAYERS,
        num_heads=num_heads,
        seed=seed,
    )
    rng = random.Random(seed)
    tools = [_tool_schema()]
    pool = [_encode(tokenizer, _episode(rng), tools) for _ in range(1024)]
    # No "Loading weights" nor "Writing model shards" progress bars for a sub-megabyte model.
    with quiet_progress_bars():
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        _train(model, pool, pad_id=tokenizer.pad_token_id, seed=seed, steps=steps)
        model.save_pretrained(str(path))
    honour_umask(path)
    return path


def _train(
    model: Any, pool: Sequence[tuple[list[int], list[int]]], *, pad_id: int, seed: int, steps: int
) -> None:
    """``steps`` AdamW steps on batches drawn from ``pool``, under a private torch RNG seeded with ``seed``."""
    import torch

    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=_SFT_LEARNING_RATE, weight_decay=0.0)
    # warm up, then decay to nothing: the last steps settle the format instead of jittering around it
    warmup = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda i: min((i + 1) / warmup, 0.5 * (1 + math.cos(math.pi * i / steps)))
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in range(steps):
            batch = [pool[i] for i in torch.randint(len(pool), (_SFT_BATCH_SIZE,)).tolist()]
            ids, labels, mask = _right_padded(batch, pad_id)
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # this learning rate spikes now and then
            optimizer.step()
            schedule.step()
    model.eval()


def _right_padded(batch: Sequence[tuple[list[int], list[int]]], pad_id: int) -> tuple[Any, Any, Any]:
    """Token ids, labels and attention mask of ``batch``, right-padded to its longest episode."""
    import torch

    width = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (seq, lab) in enumerate(batch):
        ids[row, : len(seq)] = torch.tensor(seq)
        labels[row, : len(lab)] = torch.tensor(lab)
        mask[row, : len(seq)] = 1
    return ids, labels, mask
