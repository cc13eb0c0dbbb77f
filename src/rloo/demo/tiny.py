"""Tiny, randomly initialised models of real architectures, built locally for tests, the demo and benchmarks.

Nothing here touches the network: the tokenizer is a byte-level BPE trained in a few milliseconds on a small
English corpus generated in code, and the models are random-init ``transformers`` models of real
architectures (GPT-NeoX/Pythia, Llama, Qwen2) sized to a few hundred thousand parameters. Everything is
written with ``save_pretrained`` and is meant to be loaded back through the normal ``Auto*.from_pretrained``
path, exactly like a checkpoint downloaded from the Hub.

The corpus deliberately contains many all-vowel strings ("aeiou", "eau", "oo", ...) so that the vocabulary
holds merged all-vowel tokens: on the toy task of :mod:`rloo.demo.toy` a tiny policy can then raise its reward
quickly by shifting probability mass towards them.
"""

from __future__ import annotations

import contextlib
import functools
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from rloo.diskspace import honour_umask, write_bytes_atomic

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerFast

__all__ = [
    "ARCHITECTURES",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "TinySetup",
    "build_causal_lm",
    "build_letter_judge",
    "build_reward_model",
    "build_tiny_setup",
    "build_tokenizer",
]

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
ARCHITECTURES = ("gpt_neox", "llama", "qwen2")
VOCAB_SIZE = 512
SETUP_MARKER = "tiny_setup.json"
# Bump when what build_tiny_setup writes changes, so stale setups on disk are rebuilt rather than reused.
_SETUP_FORMAT = 2  # 2: files honour the umask

# Qwen2's pre-tokenization regex (GPT-2's, but single digits and a few whitespace refinements).
_PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

# A plain "role: content" transcript; the generation prompt ends with "assistant:" so the completion is the
# assistant's reply. No special tokens inside prompts (an eos in the prompt would look like padding when
# pad == eos).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] + ': ' + message['content'] }}"
    "{% if not loop.last or add_generation_prompt %}{{ '\\n\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)

_SUBJECTS = (
    "the cat", "the dog", "a bird", "the sea", "the old man", "a child", "the moon", "the river",
    "my friend", "the teacher", "a small boat", "the green tree", "the wind", "our house", "the king",
    "a quiet girl", "the farmer", "the sun", "an owl", "the city",
)  # fmt: skip
_VERBS = (
    "sees", "likes", "finds", "follows", "watches", "hears", "loves", "remembers", "carries", "visits",
    "paints", "calls", "greets", "leaves", "reaches", "opens",
)  # fmt: skip
_OBJECTS = (
    "the light", "a red apple", "the door", "the water", "a long road", "the stars", "the field",
    "a warm fire", "the window", "an open book", "the garden", "the mountain", "a blue sky", "the rain",
    "the story", "a song",
)  # fmt: skip
_ENDINGS = (".", ".", ".", "!", "?", " today.", " again.", " at night.", " in the morning.", " by the sea.")
# All-vowel strings, frequent in the corpus so BPE merges them into single tokens (with and without the
# leading space that byte-level BPE attaches to words).
_VOWEL_WORDS = (
    "aeiou", "eau", "ai", "oo", "ee", "aa", "ii", "uu", "ou", "ea", "ie", "io", "oa", "oi", "ue", "ua",
    "eee", "ooo", "aaa", "iou", "oui", "aie", "eai", "ouai", "aoo", "eeoo", "iaeo", "ooee",
)  # fmt: skip
_WORDS = (
    "write", "about", "describe", "tell", "me", "story", "poem", "sea", "sky", "tree", "music", "food",
    "home", "winter", "summer", "friend", "ocean", "forest", "night", "morning", "rain", "snow", "fire",
    "and", "the", "of", "to", "in", "is", "it", "you", "that", "was", "for", "on", "are", "with", "as",
    "one", "two", "three", "yes", "no", "please", "thank", "hello", "world", "question", "answer",
)  # fmt: skip


def _corpus(seed: int = 1234) -> list[str]:
    """A few hundred short English lines plus vowel-heavy lines, deterministic for the seed."""
    rng = random.Random(seed)
    lines: list[str] = []
    for _ in range(400):
        s, v, o, e = (rng.choice(x) for x in (_SUBJECTS, _VERBS, _OBJECTS, _ENDINGS))
        sentence = f"{s} {v} {o}{e}"
        lines.append(sentence[0].upper() + sentence[1:])
    for _ in range(150):
        lines.append(" ".join(rng.choices(_WORDS, k=rng.randint(3, 8))) + rng.choice((".", ":", ",", "")))
    for _ in range(300):
        lines.append(" ".join(rng.choices(_VOWEL_WORDS, k=rng.randint(3, 8))))
    # Chat-template scaffolding, prompts of rloo.demo.toy, digits and punctuation so common text is not all bytes.
    lines += [
        "user: Write about the sea:\n\nassistant:",
        "system: You are a helpful assistant.",
        "0 1 2 3 4 5 6 7 8 9 10 42 100 2024",
        'Hello, world! (yes) [no] {maybe} - a; b\' "c"',
    ] * 10
    return lines


@functools.lru_cache(maxsize=1)
def _trained_tokenizer_json() -> str:
    """Train the byte-level BPE once per process (deterministic) and return its JSON serialisation."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # The Qwen2 pre-tokenization (transformers rebuilds exactly this pipeline when it loads a qwen2
    # checkpoint's tokenizer with its own class), so every architecture's folder encodes text identically.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok.to_str()


def build_tokenizer(
    path: str | Path, *, with_pad_token: bool = False, with_chat_template: bool = True
) -> PreTrainedTokenizerFast:
    """Train (or reuse, per process) a byte-level BPE tokenizer and save it to ``path``; return it reloaded.

    The tokenizer has about 512 tokens: the 256 byte tokens, BPE merges learnt on a small built-in English
    corpus (which includes many all-vowel strings such as "aeiou", "eau", "oo", so those are single tokens)
    and the special token ``<|endoftext|>``, used as both bos and eos, like GPT-NeoX/Pythia. Encoding adds no
    special tokens. By default there is no pad token (like Pythia, so callers must fall back to pad = eos);
    ``with_pad_token=True`` appends ``<|pad|>`` as the last id. ``with_chat_template=True`` sets a plain
    "role: content" Jinja chat template whose generation prompt ends with ``assistant:``. Byte-level, so
    ``decode`` then ``encode`` round-trips any text. It is saved with ``save_pretrained(path)`` and the
    returned object is the one ``AutoTokenizer.from_pretrained(path)`` gives, i.e. the normal loading path.
    """
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(path)
    kwargs: dict[str, Any] = {
        "tokenizer_object": Tokenizer.from_str(_trained_tokenizer_json()),
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,  # keep decode exact so text round-trips
        "model_max_length": 512,  # = the default max_position_embeddings of the models
    }
    if with_pad_token:
        kwargs["pad_token"] = PAD_TOKEN
    if with_chat_template:
        kwargs["chat_template"] = CHAT_TEMPLATE
    tokenizer = PreTrainedTokenizerFast(**kwargs)
    _save_tokenizer(tokenizer, path)
    # from_pretrained is typed as fast or SentencePiece; a tokenizer.json always loads as the fast one
    return cast("PreTrainedTokenizerFast", AutoTokenizer.from_pretrained(str(path)))


@contextlib.contextmanager
def quiet_progress_bars() -> Iterator[None]:
    """transformers' progress bars ("Loading weights", "Writing model shards") off for a sub-megabyte model,
    the caller's setting restored after."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _save_tokenizer(tokenizer: PreTrainedTokenizerFast, path: Path) -> None:
    """``save_pretrained``, then record absent special tokens as explicit nulls in ``tokenizer_config.json``.

    Without the nulls, loading a qwen2 folder (where transformers uses its own ``Qwen2Tokenizer`` class)
    would invent ``<|endoftext|>`` as pad/unk token, so the folders of different architectures would
    disagree on whether there is a pad token.
    """
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(path))
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    for name in ("pad_token", "unk_token"):
        if getattr(tokenizer, name) is None:
            config[name] = None
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _load_tokenizer(tokenizer_path: str | Path) -> PreTrainedTokenizerFast:
    from transformers import AutoTokenizer

    return cast("PreTrainedTokenizerFast", AutoTokenizer.from_pretrained(str(tokenizer_path)))


def _make_config(
    arch: str,
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    max_position_embeddings: int,
    num_key_value_heads: int | None = None,
    intermediate_size: int | None = None,
    **extra: Any,
) -> PretrainedConfig:
    from transformers import GPTNeoXConfig, LlamaConfig, Qwen2Config

    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}: choose one of {', '.join(ARCHITECTURES)}")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads})")
    kv_heads = num_heads if num_key_value_heads is None else num_key_value_heads
    # grouped-query attention: each key/value head serves num_heads / kv_heads query heads
    if kv_heads <= 0 or num_heads % kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_key_value_heads ({kv_heads})")
    if arch == "gpt_neox" and kv_heads != num_heads:
        raise ValueError("gpt_neox has no grouped-query attention: leave num_key_value_heads unset")
    common: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "intermediate_size": 4 * hidden_size if intermediate_size is None else intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "dtype": "float32",
        **extra,
    }
    if arch == "gpt_neox":  # Pythia: untied embed/unembed, partial rotary
        # rotary_pct: transformers 4.x's name, which 5.x maps to rope_parameters but leaves out of its signature
        return GPTNeoXConfig(**common, tie_word_embeddings=False, rotary_pct=0.25)  # type: ignore[call-arg]
    if arch == "llama":
        return LlamaConfig(**common, num_key_value_heads=kv_heads, tie_word_embeddings=False)
    # Small Qwen2 checkpoints tie their embeddings.
    return Qwen2Config(**common, num_key_value_heads=kv_heads, tie_word_embeddings=True)


def _build(
    auto_cls_name: str,
    path: str | Path,
    tokenizer_path: str | Path,
    *,
    arch: str,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    seed: int,
    max_position_embeddings: int,
    **extra: Any,
) -> Path:
    import torch
    import transformers

    tokenizer = _load_tokenizer(tokenizer_path)
    config = _make_config(
        arch,
        tokenizer,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        **extra,
    )
    auto_cls = getattr(transformers, auto_cls_name)
    # Seed a private RNG scope so the build is reproducible and leaves the caller's global RNG untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = auto_cls.from_config(config, dtype=torch.float32)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None and tokenizer.pad_token_id is None:
        generation_config.pad_token_id = tokenizer.eos_token_id
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with quiet_progress_bars():  # no "Writing model shards" bar for a sub-megabyte model
        model.save_pretrained(str(path))
    _save_tokenizer(tokenizer, path)
    honour_umask(path)  # safetensors writes its weights 0600
    return path


def build_causal_lm(
    path: str | Path,
    tokenizer_path: str | Path,
    *,
    arch: str = "gpt_neox",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    seed: int = 0,
    max_position_embeddings: int = 512,
    vocab_size: int | None = None,
    num_key_value_heads: int | None = None,
    intermediate_size: int | None = None,
) -> Path:
    """Build a random-init causal LM of a real architecture and save it, with its tokenizer, to ``path``.

    ``arch`` is one of "gpt_neox" (Pythia-like, untied embeddings), "llama" (untied) or "qwen2" (tied
    embeddings, as small Qwen2 checkpoints do); anything else raises ``ValueError`` naming the choices. The
    config takes vocab size = ``len(tokenizer)`` and bos/eos/pad ids from the tokenizer at
    ``tokenizer_path``; intermediate size is ``intermediate_size`` (default ``4 * hidden_size``), key/value
    heads ``num_key_value_heads`` (default ``num_heads``; a divisor of it: grouped-query attention, not for
    gpt_neox), dtype float32. Weights are initialised under ``torch.manual_seed(seed)`` inside a forked RNG, so the same seed
    gives identical weights and the caller's RNG state is untouched. Model (safetensors) and tokenizer are
    written with ``save_pretrained``, loadable via ``AutoModelForCausalLM``/``AutoTokenizer``; returns the
    ``Path``. ``vocab_size`` widens the embedding and output layers beyond the tokenizer (rows no token
    reaches, as real checkpoints pad theirs, e.g. Pythia's 50,304): the vocabulary cost of a real model
    without a real tokenizer.
    """
    extra: dict[str, Any] = {
        "num_key_value_heads": num_key_value_heads,
        "intermediate_size": intermediate_size,
    }
    if vocab_size is not None:
        n = len(_load_tokenizer(tokenizer_path))
        if vocab_size < n:
            raise ValueError(f"vocab_size ({vocab_size}) must be >= the tokenizer's {n} tokens")
        extra["vocab_size"] = vocab_size
    return _build(
        "AutoModelForCausalLM",
        path,
        tokenizer_path,
        arch=arch,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        seed=seed,
        max_position_embeddings=max_position_embeddings,
        **extra,
    )


def build_vowel_teacher(path: str | Path, tokenizer_path: str | Path, *, seed: int = 7) -> Path:
    """A teacher for on-policy distillation on the toy task: the tiny GPT-NeoX of :func:`build_causal_lm`
    (another seed than the policy's) with a taste a tiny policy can learn in a few updates, every all-vowel
    token 5 logits up whatever the context (a random tiny model is near uniform, and matching a random
    function of the context takes far longer), so distilling it alone raises the toy's vowel reward."""
    import torch
    from transformers import AutoModelForCausalLM

    from rloo.demo.toy import VOWELS

    out = build_causal_lm(path, tokenizer_path, seed=seed)
    tok = _load_tokenizer(tokenizer_path)
    vowels = [
        i
        for token, i in tok.get_vocab().items()
        if (text := tok.convert_tokens_to_string([token]).strip()) and set(text) <= VOWELS
    ]
    with quiet_progress_bars():
        model: Any = AutoModelForCausalLM.from_pretrained(out)
        with torch.no_grad():
            norm = model.gpt_neox.final_layer_norm
            norm.weight[0], norm.bias[0] = 0.0, 1.0  # the last hidden state's dimension 0: always 1
            head = model.get_output_embeddings().weight  # (V, H)
            head[:, 0] = 0.0
            head[vowels, 0] = 5.0  # so each vowel token's logit is 5 more than the model would give it
        model.save_pretrained(str(out))
    return out


def build_letter_judge(
    path: str | Path, tokenizer_path: str | Path, *, letter: str = "A", hidden_size: int = 256
) -> Path:
    """A Llama-shaped model that answers every chat with ``letter`` and stops: a judge any server can serve.

    Random weights would answer the judge's question with noise, which the judge counts as unusable. Here
    each layer's attention and MLP outputs are zero, so the last hidden state is the current token's
    embedding, and the model is a bigram table: after any token but ``letter`` comes ``letter``, after
    ``letter`` the end-of-text token. ``hidden_size`` 256 with 4 heads gives head_dim 64, which vLLM's CPU
    attention supports (16 is not).
    """
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = _load_tokenizer(tokenizer_path)
    (letter_id,) = tokenizer(letter, add_special_tokens=False)["input_ids"]
    eos_id = tokenizer.eos_token_id
    path = build_causal_lm(
        path, tokenizer_path, arch="llama", hidden_size=hidden_size, max_position_embeddings=4096
    )

    with quiet_progress_bars():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        _make_bigram(model, letter_id, eos_id)
        model.save_pretrained(str(path))
    honour_umask(path)
    return path


def _make_bigram(model: Any, letter_id: int, eos_id: int) -> None:
    import torch

    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        embed.zero_()
        embed[:, 0] = 1.0  # every token: direction 0 ...
        embed[letter_id, 0], embed[letter_id, 1] = 0.0, 1.0  # ... but the letter: direction 1
        head.zero_()
        head[letter_id, 0] = 1.0  # direction 0 -> the letter
        head[eos_id, 1] = 1.0  # direction 1 -> end of text


def causal_lm_config(
    tokenizer_path: str | Path,
    *,
    arch: str = "gpt_neox",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    max_position_embeddings: int = 512,
    vocab_size: int | None = None,
    num_key_value_heads: int | None = None,
    intermediate_size: int | None = None,
) -> PretrainedConfig:
    """The config :func:`build_causal_lm` builds its model from, without building it (for counting)."""
    extra: dict[str, Any] = {
        "num_key_value_heads": num_key_value_heads,
        "intermediate_size": intermediate_size,
    }
    if vocab_size is not None:
        extra["vocab_size"] = vocab_size
    return _make_config(
        arch,
        _load_tokenizer(tokenizer_path),
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        **extra,
    )


def build_reward_model(
    path: str | Path,
    tokenizer_path: str | Path,
    *,
    arch: str = "gpt_neox",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    seed: int = 1,
    max_position_embeddings: int = 512,
) -> Path:
    """Build a random-init scalar reward model (sequence classification, one label) and save it to ``path``.

    Same architectures, sizes, seeding and saving as :func:`build_causal_lm`, but the model is an
    ``AutoModelForSequenceClassification`` with ``num_labels=1``. ``config.pad_token_id`` is always set
    (the tokenizer's pad id, or its eos id when it has no pad token) because sequence-classification heads
    use it to find the last real token of each row. Returns the ``Path``.
    """
    tokenizer = _load_tokenizer(tokenizer_path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return _build(
        "AutoModelForSequenceClassification",
        path,
        tokenizer_path,
        arch=arch,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        seed=seed,
        max_position_embeddings=max_position_embeddings,
        num_labels=1,
        pad_token_id=pad_id,
    )


@dataclass(frozen=True)
class TinySetup:
    """Paths of a tiny setup built by :func:`build_tiny_setup`."""

    root: Path
    tokenizer: Path
    policy: Path
    reward_model: Path


def build_tiny_setup(
    root: str | Path,
    *,
    arch: str = "gpt_neox",
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    vocab_size: int | None = None,
) -> TinySetup:
    """Build a tokenizer, a policy and a reward model under ``root`` (or reuse them) and return their paths.

    Layout: ``root/tokenizer/`` (no pad token, chat template), ``root/policy/`` (causal LM of ``arch``,
    weights seeded with ``seed``, plus the tokenizer) and ``root/reward_model/`` (one-label
    sequence classifier seeded with ``seed + 1``, plus the tokenizer). A ``tiny_setup.json`` marker holding
    the parameters is written last; a later call with the same parameters finds it and reuses the files
    without rewriting anything, while different parameters rebuild in place. Takes well under two seconds
    on a CPU. ``vocab_size`` widens the policy's vocabulary (see :func:`build_causal_lm`). Raises
    ``ValueError`` for an unknown ``arch``.
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}: choose one of {', '.join(ARCHITECTURES)}")
    root = Path(root)
    setup = TinySetup(
        root=root, tokenizer=root / "tokenizer", policy=root / "policy", reward_model=root / "reward_model"
    )
    params = {
        "format": _SETUP_FORMAT,
        "arch": arch,
        "seed": seed,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        **({"vocab_size": vocab_size} if vocab_size is not None else {}),
    }
    marker = root / SETUP_MARKER
    if marker.is_file() and all(p.is_dir() for p in (setup.tokenizer, setup.policy, setup.reward_model)):
        try:
            if json.loads(marker.read_text()) == params:
                return setup
        except (OSError, ValueError):
            pass  # unreadable marker: rebuild
    marker.unlink(missing_ok=True)
    build_tokenizer(setup.tokenizer)
    build_causal_lm(
        setup.policy,
        setup.tokenizer,
        seed=seed,
        arch=arch,
        hidden_size=hidden_size,
        num_layers=num_layers,
        vocab_size=vocab_size,
    )
    build_reward_model(
        setup.reward_model,
        setup.tokenizer,
        seed=seed + 1,
        arch=arch,
        hidden_size=hidden_size,
        num_layers=num_layers,
    )
    # atomic: a concurrent reader never sees a half-written marker
    write_bytes_atomic(marker, json.dumps(params, indent=2, sort_keys=True).encode(), marker.name)
    return setup
