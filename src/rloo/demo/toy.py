"""A toy prompt dataset and pure-Python reward functions on which a tiny random policy learns quickly.

:func:`write_toy_dataset` writes a folder laid out like a Hugging Face Hub dataset repository
(``data/<split>-00000-of-00001.parquet``), so it loads exactly like a downloaded one. The reward functions
follow TRL's signature (keyword arguments ``prompts``, ``completions``, ``completion_ids``,
``trainer_state``, every extra dataset column, and ``**kwargs``; one ``float | None`` per completion) and
score the *text* of a completion by its letters. The tokenizer of :mod:`rloo.demo.tiny` has many all-vowel
tokens ("aeiou", " eau", "oo", ...), so a policy raises :func:`letter_reward` simply by moving probability
mass towards them.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "VOWELS",
    "letter_reward",
    "sometimes_none_reward",
    "target_letter_reward",
    "write_toy_dataset",
    "write_toy_eval_dataset",
]

VOWELS = frozenset("aeiou")
TARGET_LETTERS = "aeiou"

# How the toy task is trained by `rloo demo` and by `make demo` (the local pipeline): a tiny policy learns
# it in about TOY_UPDATES updates of 32 completions on a laptop CPU. Keys are `rloo train` flags; the tiny
# reward model comes first in the weights, at 0, so its code path runs while the letters decide.
TOY_UPDATES = 30
TOY_TRAINING: dict[str, Any] = {
    "per_device_train_batch_size": 32,
    "rloo_k": 4,
    "num_ppo_epochs": 2,
    "response_length": 8,
    "learning_rate": 5e-3,
    "temperature": 1.0,
    "kl_coef": 0.01,
    "reward_funcs": ["rloo.demo.toy:letter_reward"],
    "reward_weights": [0.0, 1.0],
    "num_sample_generations": 3,
    "save_steps": 0,
}

_INSTRUCTIONS = (
    "Write about", "Describe", "Tell me about", "Sing of", "Say something about", "Write a poem about",
    "Talk about", "Think of", "Dream of", "Write a line about",
)  # fmt: skip
_TOPICS = (
    "the sea", "the moon", "a cat", "the rain", "an old tree", "the river", "a small boat", "the wind",
    "winter", "summer", "the city", "a garden", "the stars", "music", "a friend", "the mountain", "bread",
    "the morning", "a quiet night", "the ocean", "a red apple", "the forest", "snow", "fire",
)  # fmt: skip
_SPLIT_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")


def _prompts(rng: random.Random, n: int, context_words: int = 0) -> list[str]:
    out = []
    for _ in range(n):
        prompt = f"{rng.choice(_INSTRUCTIONS)} {rng.choice(_TOPICS)}:"
        if context_words:
            # TL;DR-shaped: a long post, then the instruction (the reference's benchmark workload)
            words = " ".join(rng.choice(_TOPICS) for _ in range(context_words // 2))
            prompt = f"POST: {words}\n\nTL;DR: {prompt}"
        out.append(prompt)
    return out


def write_toy_dataset(
    path: str | Path,
    *,
    num_train: int = 256,
    num_test: int = 32,
    seed: int = 0,
    conversational: bool = False,
    extra_split: str | None = None,
    context_words: int = 0,
) -> Path:
    """Write the toy prompt dataset to ``path`` as a Hub-style parquet folder and return ``path``.

    Files: ``data/train-00000-of-00001.parquet`` (``num_train`` rows), ``data/test-00000-of-00001.parquet``
    (``num_test`` rows) and, when ``extra_split`` is given (e.g. "descriptiveness"),
    ``data/<extra_split>-00000-of-00001.parquet`` holding the same rows as train. Columns: ``prompt``, a
    short instruction such as "Write about the sea:" (or, with ``conversational=True``, a one-message list
    ``[{"role": "user", "content": ...}]``), and ``target``, one vowel per row (the extra column that
    :func:`target_letter_reward` reads). ``context_words > 0`` puts a "POST: ..." of about that many
    words before each instruction, for workloads shaped like TL;DR (long prompt, short answer). Rows are drawn from ``random.Random(seed)``, so the same arguments
    write identical data. Raises ``ValueError`` for non-positive sizes or a bad/duplicate split name.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    if num_train < 1 or num_test < 1:
        raise ValueError(f"num_train and num_test must be >= 1 (got {num_train}, {num_test})")
    if extra_split is not None and (not _SPLIT_NAME.match(extra_split) or extra_split in ("train", "test")):
        raise ValueError(
            f"extra_split must be a name of letters, digits and '_' other than 'train'/'test' (got {extra_split!r})"
        )
    rng = random.Random(seed)

    def table(n: int) -> pa.Table:
        prompts = _prompts(rng, n, context_words)
        targets = [rng.choice(TARGET_LETTERS) for _ in range(n)]
        if conversational:
            prompt_col: Any = pa.array(
                [[{"role": "user", "content": p}] for p in prompts],
                type=pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])),
            )
        else:
            prompt_col = pa.array(prompts, type=pa.string())
        return pa.table({"prompt": prompt_col, "target": pa.array(targets, type=pa.string())})

    splits = {"train": table(num_train), "test": table(num_test)}
    if extra_split is not None:
        splits[extra_split] = splits["train"]
    path = Path(path)
    data = path / "data"
    data.mkdir(parents=True, exist_ok=True)
    for name, tbl in splits.items():
        pq.write_table(tbl, data / f"{name}-00000-of-00001.parquet")
    return path


# The words of the toy evaluation's references: all vowels (each a token of rloo.demo.tiny's tokenizer) or no
# vowel at all ("y" is no vowel to letter_reward), 2 to 6 letters, so any count of either kind >= 2 is spelt.
_VOWEL_WORDS = ("eau", "aie", "oui", "ou", "ai", "io", "oo", "ee", "ea", "ie", "aa", "uu")
_CONSONANT_WORDS = (
    "hmm", "shh", "brr", "psst", "tsk", "nth", "pfft", "dry", "sky", "why", "shy", "fly", "gym", "lynx",
    "myth", "crypt", "rhythm", "hm", "sh", "by", "my",
)  # fmt: skip
_REFERENCE_LETTERS = range(48, 65)  # a reference's length in letters: about a 16-token answer


def _spell(rng: random.Random, letters: int, words: tuple[str, ...]) -> list[str]:
    """Words from ``words`` (all of 2 letters or more) holding exactly ``letters`` letters (0 or >= 2)."""
    out: list[str] = []
    while letters:
        fits = [w for w in words if len(w) == letters or len(w) <= letters - 2]
        out.append(rng.choice(fits))
        letters -= len(out[-1])
    return out


def _graded_reference(rng: random.Random, fraction: float) -> str:
    """A reference whose vowel fraction (:func:`letter_reward`) is as close to ``fraction`` as a length in
    :data:`_REFERENCE_LETTERS` allows: vowel-only and vowel-free words in random order ("hmm eau dry oui")."""
    spelt = [
        (abs(v / n - fraction), n, v)
        for n in _REFERENCE_LETTERS
        for v in {math.floor(fraction * n), math.ceil(fraction * n)}
        if 1 not in (v, n - v)  # no word has a single letter
    ]
    _, n, v = min(spelt)
    words = _spell(rng, v, _VOWEL_WORDS) + _spell(rng, n - v, _CONSONANT_WORDS)
    rng.shuffle(words)
    return " ".join(words)


def write_toy_eval_dataset(path: str | Path, *, num_test: int = 32, seed: int = 1) -> Path:
    """Write toy evaluation rows to ``path`` (``data/test-00000-of-00001.parquet``) and return ``path``.

    Columns ``prompt`` and ``completion``, the layout ``rloo eval`` reads: ``num_test`` distinct prompts of the
    toy task and a reference answer each, graded: the references' vowel fractions (:func:`letter_reward`)
    are spread evenly over the whole range, one at each ``i / (num_test - 1)`` (rows in shuffled order), from
    a vowel-free "hmm shh dry" to an all-vowel "eau oui aie". A judge preferring the higher vowel fraction
    (:mod:`rloo.demo.judge`) then gives a model whose answers have vowel fraction ``s`` a win rate of about
    ``s``: the win rate reads on the toy reward's own scale, so an untrained model lands near its 0.35 or so,
    a half-trained one in between, and one that writes vowels and nothing else ties the all-vowel reference
    and beats the rest (31.5 / 32). (Against references of one level, e.g. ordinary words at 0.3, every model above the
    level would win everywhere: runs that learnt a little and a lot would look the same.) Rows come from
    ``random.Random(seed)``. Raises ``ValueError`` for a ``num_test`` outside [1, number of distinct prompts].
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    pairs = [(i, t) for t in _TOPICS for i in _INSTRUCTIONS]
    if not 1 <= num_test <= len(pairs):
        raise ValueError(f"num_test must be in [1, {len(pairs)}] (got {num_test})")
    rng = random.Random(seed)
    # distinct prompts: a repeated one would be judged twice and count twice in the win rates
    prompts = [f"{instruction} {topic}:" for instruction, topic in rng.sample(pairs, num_test)]
    levels = [i / (num_test - 1) if num_test > 1 else 0.5 for i in range(num_test)]
    rng.shuffle(levels)
    refs = [_graded_reference(rng, level) for level in levels]
    data = Path(path) / "data"
    data.mkdir(parents=True, exist_ok=True)
    table = pa.table({"prompt": pa.array(prompts, type=pa.string()), "completion": pa.array(refs)})
    pq.write_table(table, data / "test-00000-of-00001.parquet")
    return Path(path)


def _text(completion: Any) -> str:
    """The text of a completion: a string, or the ``content`` of the last message of a message list."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content") or "")
    if isinstance(completion, Sequence) and not completion:
        return ""
    raise TypeError(f"a completion must be a string or a list of messages, got {type(completion).__name__}")


def _fraction(text: str, letters: frozenset[str]) -> float:
    chars = [c for c in text.lower() if not c.isspace()]
    return sum(c in letters for c in chars) / len(chars) if chars else 0.0


def letter_reward(completions: list[Any], **kwargs: Any) -> list[float | None]:
    """Reward each completion with the fraction of its non-space characters that are vowels.

    The letters counted are "a", "e", "i", "o", "u", case-insensitively; whitespace is ignored, every other
    character (consonants, digits, punctuation, replacement characters from broken UTF-8) counts against.
    So "aXe b" scores 2/4 = 0.5. A completion with no non-space character scores 0.0. Completions are strings
    or, for conversational data, message lists (the last message's ``content`` is scored). Pure Python,
    values in [0, 1]; other keyword arguments (prompts, completion_ids, trainer_state, dataset columns) are
    accepted and ignored.
    """
    return [_fraction(_text(c), VOWELS) for c in completions]


def vowel_majority_reward(completions: list[Any], **kwargs: Any) -> list[float | None]:
    """1.0 when more than half of a completion's non-space characters are vowels (:func:`letter_reward` >
    0.5), else 0.0: a pass/fail reward, like a verifier's. A random policy seldom passes, so many of its
    prompt groups score all 0 (no spread: nothing to learn), which is what ``--filter_groups`` is for."""
    return [float(r is not None and r > 0.5) for r in letter_reward(completions)]


def target_letter_reward(completions: list[Any], target: list[str], **kwargs: Any) -> list[float | None]:
    """Reward each completion with the fraction of its non-space characters equal to its row's ``target``.

    ``target`` is the dataset's extra column of the same name (one letter per completion, passed by the
    trainer as a keyword argument), which makes this the reward that exercises extra columns. Matching is
    case-insensitive and whitespace is ignored, as in :func:`letter_reward`: "aXa b" with target "a" scores
    2/4 = 0.5. A completion with no non-space character scores 0.0. Raises ``ValueError`` when ``target``
    and ``completions`` differ in length.
    """
    if len(target) != len(completions):
        raise ValueError(f"got {len(completions)} completions but {len(target)} targets")
    return [_fraction(_text(c), frozenset(str(t).lower())) for c, t in zip(completions, target, strict=True)]


def sometimes_none_reward(completions: list[Any], **kwargs: Any) -> list[float | None]:
    """Return ``None`` for completions whose text has an even number of characters, else :func:`letter_reward`.

    The length is ``len`` of the completion's text, spaces included, so an empty completion (length 0) gives
    ``None``. Exists to exercise the trainer's handling of rewards a function declines to give.
    """
    texts = [_text(c) for c in completions]
    return [None if len(t) % 2 == 0 else _fraction(t, VOWELS) for t in texts]
