"""Loading the policy, the frozen reference and the reward model, with one-line errors for bad paths."""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import Any

import torch

from rloo.errors import UserError
from rloo.storage.location import local_source_path, source_kind

log = logging.getLogger(__name__)

# What `rloo train --use_peft` writes: the adapter in output_dir (its config names the base model) and,
# with --merge_adapter, the merged model below it. Training, eval and push all read these names.
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MERGED_SUBDIR = "merged"

# Above this magnitude a weight is corrupt, not trained: its square overflows float32 (max 3.4e38), so the
# first norm layer it reaches turns the whole forward into inf/NaN. Bytes overwritten with 0x7f read back as
# 3.39e38 in float32 and bfloat16: finite, so a plain isfinite() check would let them through.
MAX_WEIGHT_MAGNITUDE = 1.8e19


def _bad_value(t: torch.Tensor) -> float | None:
    """The largest magnitude in ``t`` if it is non-finite or above MAX_WEIGHT_MAGNITUDE, else None."""
    if not t.is_floating_point() or t.numel() == 0:
        return None
    # the inf-norm is the max |x| in one reduction without an |x| copy; a NaN anywhere makes it NaN
    peak = float(torch.linalg.vector_norm(t.detach(), ord=float("inf")))
    return None if peak <= MAX_WEIGHT_MAGNITUDE else peak


def describe_value(peak: float) -> str:
    """How a bad value of :func:`find_bad_tensor` reads in an error line."""
    return "NaN" if math.isnan(peak) else "inf" if math.isinf(peak) else f"a value of magnitude {peak:.3g}"


def _refuse(flag: str, path: str, name: str, peak: float) -> UserError:
    return UserError(
        f"--{flag} {path}: tensor {name!r} holds {describe_value(peak)} (non-finite or overflowing weights); "
        "the checkpoint is corrupt or diverged: re-download or re-save it."
    )


def find_bad_tensor(tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[str, float] | None:
    """(name, largest magnitude) of the first tensor holding NaN, inf or an overflowing value, else None."""
    for name, t in tensors:
        peak = _bad_value(t)
        if peak is not None:
            return name, peak
    return None


def check_finite_weights(model: torch.nn.Module, *, flag: str, path: str) -> None:
    """Refuse a loaded model whose parameters hold NaN, inf or overflowing values (one line, the tensor named).

    Without it such a model trains "successfully" to a NaN model: sampling from NaN probabilities does not fail.
    """
    bad = find_bad_tensor(model.named_parameters())
    if bad is not None:
        raise _refuse(flag, path, *bad)


def check_safetensors_weights(model_dir: Path, *, flag: str, shown: str | None = None) -> None:
    """:func:`check_finite_weights` for the ``*.safetensors`` files of a directory, without building the model
    (for a stage that only copies the files, or hands them to vLLM)."""
    from safetensors import SafetensorError, safe_open

    for f in sorted(Path(model_dir).glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                    peak = _bad_value(st.get_tensor(name))
                    if peak is not None:
                        raise _refuse(flag, shown or str(model_dir), f"{f.name}:{name}", peak)
        except SafetensorError as e:
            raise UserError(
                f"--{flag} {shown or model_dir}: {f.name} is not readable safetensors ({e}); re-save it."
            ) from None


# --- the weights files' headers, read without loading a tensor ----------------------------------------------
# safetensors (huggingface/safetensors safetensors/src/tensor.rs, SafeTensors::read_metadata and
# Metadata::validate): 8 bytes little-endian header length N (at most 100 MB), N bytes of UTF-8 JSON (tensor name
# -> dtype, shape, data_offsets; "__metadata__" free text), then the tensors' bytes, which the offsets must
# cover end to end: the last offset is the end of the file.
_ST_MAX_HEADER = 100_000_000
_ST_DTYPE_BYTES = {
    **dict.fromkeys(("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0"), 1),
    **dict.fromkeys(("U16", "I16", "F16", "BF16"), 2),
    **dict.fromkeys(("U32", "I32", "F32"), 4),
    **dict.fromkeys(("U64", "I64", "F64", "C64"), 8),
}
# torch.save (torch/serialization.py): a zip archive (local header "PK\x03\x04" first, _is_zipfile) holding
# <name>/data.pkl, or the legacy format, which begins with the pickled MAGIC_NUMBER (protocol 2)
_ZIP_MAGIC = b"PK\x03\x04"
_LEGACY_TORCH_MAGIC = b"\x80\x02\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def safetensors_header_problem(path: Path) -> str | None:
    """What is wrong with the header of the safetensors file ``path`` (as safetensors' ``read_metadata``
    would refuse it: length, JSON, offsets covering the data exactly), or None when it is sound."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{size} bytes: too short for a safetensors header"
        n = int.from_bytes(head, "little")
        if n > _ST_MAX_HEADER or 8 + n > size:
            return f"its header claims {n} bytes, the file has {size}: truncated or not safetensors"
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return "its header is not JSON: overwritten or not safetensors"
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in info["data_offsets"])
            elements = math.prod(int(d) for d in info["shape"])
            width = _ST_DTYPE_BYTES.get(str(info["dtype"]))
        except (KeyError, TypeError, ValueError):
            return f"tensor {name!r} has no valid dtype, shape and data_offsets"
        if width is not None and end - begin != elements * width:
            return f"tensor {name!r} spans {end - begin} bytes, its shape and dtype need {elements * width}"
        spans.append((begin, end, name))
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at or end < begin:
            return f"tensor {name!r} starts at byte {begin} of the data, expected {at}"
        at = end
    if 8 + n + at != size:
        return f"its tensors need {8 + n + at} bytes, the file has {size}: truncated or padded"
    return None


def torch_pickle_problem(path: Path) -> str | None:
    """What is wrong with the ``torch.save`` file ``path`` (a zip archive with a data.pkl whose central
    directory reads, or the legacy pickle format by its magic number), or None when it is sound."""
    import zipfile

    with open(path, "rb") as f:
        start = f.read(len(_LEGACY_TORCH_MAGIC))
    if start.startswith(_ZIP_MAGIC):
        try:
            with zipfile.ZipFile(path) as z:
                names = z.namelist()
        except (zipfile.BadZipFile, OSError, ValueError) as e:
            return f"its zip archive does not read ({e}): truncated or damaged"
        if not any(n == "data.pkl" or n.endswith("/data.pkl") for n in names):
            return "its zip archive holds no data.pkl: not a torch.save file"
        return None
    if start == _LEGACY_TORCH_MAGIC:
        return None
    return "it starts with neither a zip header nor torch's pickle magic number: not a torch.save file"


def check_weight_headers(model_dir: Path, *, shown: str) -> None:
    """Refuse a model directory whose weights cannot be what ``from_pretrained`` reads, by their headers only
    (seconds for any size): a ``*.safetensors`` (:func:`safetensors_header_problem`) or ``*.bin``/``*.pt``
    (:func:`torch_pickle_problem`) that is truncated or overwritten, or a shard that an ``*.index.json``
    names but that is missing. One line naming ``shown`` (the user's argument, never a
    temporary copy): exit 2, the files must be written again. Which files a model needs is the loader's to say."""
    model_dir = Path(model_dir)
    hint = "re-download or re-save the model (save_pretrained)"
    for index in sorted(model_dir.glob("*.index.json")):
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError):
            raise UserError(
                f"{shown}: {index.name} is not a weights index (no weight_map); {hint}."
            ) from None
        missing = sorted(s for s in shards if not (model_dir / s).is_file())
        if missing:
            raise UserError(
                f"{shown}: {index.name} names {len(missing)} missing shard(s) ({', '.join(missing[:3])}); {hint}."
            )
    for f in sorted(f for f in model_dir.iterdir() if f.is_file() and f.suffix in WEIGHT_SUFFIXES):
        safetensors = f.suffix == ".safetensors"
        problem = safetensors_header_problem(f) if safetensors else torch_pickle_problem(f)
        if problem is not None:
            what = "readable safetensors" if safetensors else "a readable torch.save file"
            raise UserError(f"{shown}: {f.name} is not {what} ({problem}); {hint}.")


def holds_model_config(names: Collection[str], *, adapter: bool = True) -> bool:
    """Whether a directory whose top-level files are ``names`` holds a model: a ``save_pretrained`` output
    (``config.json``) or, with ``adapter``, a LoRA adapter (``adapter_config.json``, what ``rloo train
    --use_peft`` writes; :func:`load_causal_lm` loads the base model it names and merges it in). For a local
    directory and for an upload's manifest alike."""
    return "config.json" in names or (adapter and ADAPTER_CONFIG in names)


def local_model_dir(
    flag: str, value: str, *, adapter: bool = True, hint: str = "pass a model directory or a Hub id"
) -> Path:
    """The directory that the local model argument ``--flag value`` names, when it holds a model
    (:func:`holds_model_config`); else one line naming the argument, ending with ``hint`` (what to pass
    instead). The one rule of every stage for "is this local path a model". A Hub-shaped value is read as a
    path here (the caller decided it wants a directory); an ``s3://`` one is refused by name."""
    if source_kind(value) == "s3":
        raise UserError(f"--{flag} {value}: an s3:// prefix, not a local directory; {hint}.")
    path = local_source_path(value)
    if not path.is_dir():
        raise UserError(f"--{flag} {value}: no such directory; {hint}.")
    present = [name for name in ("config.json", ADAPTER_CONFIG) if (path / name).is_file()]
    if not holds_model_config(present, adapter=adapter):
        what = f"config.json or {ADAPTER_CONFIG}" if adapter else "config.json"
        raise UserError(f"--{flag} {value}: not a model directory (no {what}); {hint}.")
    return path


def check_model_source(flag: str, path: str) -> None:
    """The loader's check: one line for a model argument that cannot be loaded from where it points. A Hub id
    passes (transformers resolves it), an ``s3://`` prefix must hold a model (:func:`check_model_prefix`; it
    is fetched into this machine's scratch before loading), a local path must be a model directory or LoRA
    adapter (:func:`local_model_dir`). Which of the three ``path`` is:
    :func:`rloo.storage.location.source_kind` (``gpt2`` and ``org/name`` are Hub ids, ``./gpt2`` a path)."""
    kind = source_kind(path)
    if kind == "hub":
        from rloo.storage.hub import check_hub_model

        check_hub_model(f"--{flag} {path}", path)  # once per process: an unreachable Hub is one line, exit 75
        return
    if kind == "s3":
        check_model_prefix(flag, path)
        return
    local_model_dir(flag, path)


def model_files(paths: Iterable[str]) -> list[str]:
    """What ``from_pretrained`` reads of a model prefix, from its objects' relative paths: the top-level files
    but hidden ones. Nested prefixes (a run's ``checkpoint-N/``, a Hub repo's ``original/`` weights) stay
    where they are."""
    return sorted(p for p in paths if "/" not in p and not p.startswith("."))


def check_model_prefix(flag: str, uri: str, *, adapter: bool = True) -> None:
    """An ``s3://`` model, whoever wrote it: an rloo upload must match its manifest (every file there with its
    size); a prefix without one (``aws s3 cp --recursive`` of a ``save_pretrained`` directory) must hold a
    ``config.json`` (or, with ``adapter``, an ``adapter_config.json``) at its top. Lists the prefix, reads no
    weights. One line naming ``--flag``: exit 2 for a bad or missing prefix, 75 for a store out of reach."""
    from rloo.storage import MANIFEST_NAME, verify_prefix
    from rloo.storage.errors import prefixed
    from rloo.storage.prefix import list_objects

    try:
        listed = list_objects(uri)
        names = [f.path for f in verify_prefix(uri).files] if MANIFEST_NAME in listed else list(listed)
    except UserError as e:
        raise prefixed(e, f"--{flag} {uri}") from None
    if not names:
        raise UserError(
            f"--{flag} {uri}: no objects under this prefix; check the URI (keys are case-sensitive)."
        )
    if not holds_model_config(model_files(names), adapter=adapter):
        what = f"config.json or {ADAPTER_CONFIG}" if adapter else "config.json"
        raise UserError(
            f"--{flag} {uri}: no {what} at the top of this prefix: not a transformers model; copy a "
            f"save_pretrained directory there (aws s3 cp --recursive DIR {uri.rstrip('/')}/)."
        )


# Where fetched s3:// models are kept on a machine (below its scratch: the step's emptyDir in a pod)
MODEL_CACHE_AREA = "rloo-models"


def local_model_path(flag: str, path: str) -> str:
    """``path`` itself for a Hub id or a local directory; for an ``s3://`` model, the directory on this
    machine it is fetched into first (:func:`check_model_prefix`, then :func:`rloo.storage.prefix.
    cached_prefix`: once per machine, the ranks of a node share it; an rloo upload verified against its
    manifest, any other prefix read as listed)."""
    if source_kind(path) != "s3":
        return path
    from rloo.storage.errors import prefixed
    from rloo.storage.prefix import cached_prefix

    check_model_prefix(flag, path)
    try:
        local, read = cached_prefix(path.strip().rstrip("/"), MODEL_CACHE_AREA, select=model_files)
    except UserError as e:  # a damaged upload (SHA-256), a prefix rewritten during the read (75), ...
        raise prefixed(e, f"--{flag} {path}") from None
    log.info(
        "--%s %s: read %d files (%.1f MB, %s) into %s",
        flag,
        path,
        len(read.files),
        sum(f.size for f in read.files) / 1e6,
        "verified against its manifest" if read.manifest else "no manifest: sizes checked as listed",
        local,
    )
    return str(local)


def check_model_files(
    flag: str, path: str, *, trust_remote_code: bool = False, reward_model: bool = False
) -> None:
    """Seconds-cheap checks that a local model is loadable, without reading its weights: a model directory
    (:func:`check_model_source`), a ``config.json`` that parses, weights files whose safetensors header
    reads and matches their size, and the tokenizer loads (``reward_model``: as :func:`load_reward_model`
    loads it, no EOS token required). For stages that contact other services before they load the model: a
    corrupt model must be reported as one, not as the failure of something else."""
    check_model_source(flag, path)
    kind = source_kind(path)
    if kind == "hub":
        return
    p = Path(local_model_path(flag, path)) if kind == "s3" else local_source_path(path)
    for name in ("config.json", ADAPTER_CONFIG):
        if (p / name).is_file():
            try:
                json.loads((p / name).read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise UserError(
                    f"--{flag} {path}: {name} is not valid JSON ({type(e).__name__}); re-save the model."
                ) from None
    check_weight_headers(p, shown=f"--{flag} {path}")
    if reward_model:
        load_reward_tokenizer(path, flag=flag, trust_remote_code=trust_remote_code)
    else:
        load_tokenizer(path, flag=flag, trust_remote_code=trust_remote_code)


def _wrap_load(flag: str, path: str, fn: Any, *, shown: str | None = None) -> Any:
    """``fn()``, which loads from ``path``, with its failures as one line naming ``--flag`` and ``shown``
    (where the user's argument pointed: the ``s3://`` URI of a fetched copy)."""
    check_model_source(flag, path)
    try:
        return fn()
    except UserError:
        raise
    except Exception as e:  # corrupt weights, missing files, network: all one line for the user
        from rloo.storage.hub import hub_error

        hub = hub_error(e, f"--{flag} {shown or path}")
        if hub is not None:  # the Hub out of reach (75) or refusing the repo: no advice to re-save anything
            raise hub from None
        first = (str(e).strip().splitlines() or [""])[0][:300]
        if shown and shown != path:  # the user's argument, not this machine's copy of it
            first = first.replace(str(Path(path).expanduser()), shown).replace(path, shown)
        raise UserError(
            f"--{flag} {shown or path}: cannot load it ({type(e).__name__}: {first}); check that it is a "
            "complete, uncorrupted save_pretrained output (re-download or re-save it)."
        ) from None


def load_tokenizer(path: str, *, flag: str = "model_name_or_path", trust_remote_code: bool = False) -> Any:
    """The tokenizer, left-padding (for generation), with pad = eos when it has no pad token."""
    from transformers import AutoTokenizer

    local = local_model_path(flag, path)
    tok = _wrap_load(
        flag,
        local,
        lambda: AutoTokenizer.from_pretrained(
            local, padding_side="left", trust_remote_code=trust_remote_code
        ),
        shown=path,
    )
    if tok.eos_token_id is None:
        raise UserError(
            f"--{flag} {path}: the tokenizer has no EOS token; set one (tokenizer.eos_token) and save it."
        )
    if tok.pad_token_id is None:
        log.info(
            "tokenizer at %s has no pad token: using its EOS token (%r) for padding", path, tok.eos_token
        )
        tok.pad_token = tok.eos_token
    return tok


def disable_dropout(model: torch.nn.Module) -> None:
    # RLHF wants the sampling policy, the "old" policy and the trained policy to be one function:
    # dropout would make the importance ratio noisy for nothing.
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0


def load_causal_lm(
    path: str,
    *,
    flag: str,
    trust_remote_code: bool = False,
    dtype: torch.dtype = torch.float32,
    **from_pretrained: Any,
) -> Any:
    """A causal LM from a model directory or Hub id. A LoRA adapter directory (``adapter_config.json``,
    what ``rloo train --use_peft`` writes) loads its base model and merges the adapter in."""
    from transformers import AutoModelForCausalLM

    local = local_model_path(flag, path)
    if (Path(local).expanduser() / ADAPTER_CONFIG).is_file():
        return _load_adapter(local, flag=flag, trust_remote_code=trust_remote_code, dtype=dtype)
    model = _wrap_load(
        flag,
        local,
        lambda: AutoModelForCausalLM.from_pretrained(
            local, dtype=dtype, trust_remote_code=trust_remote_code, **from_pretrained
        ),
        shown=path,
    )
    check_finite_weights(model, flag=flag, path=path)
    disable_dropout(model)
    return model


def _load_adapter(path: str, *, flag: str, trust_remote_code: bool, dtype: torch.dtype) -> Any:
    try:
        from peft import PeftModel
    except ImportError:
        raise UserError(
            f"--{flag} {path} is a LoRA adapter: loading it needs the peft package (pip install peft)."
        ) from None
    try:
        base_path = json.loads((Path(path).expanduser() / ADAPTER_CONFIG).read_text())[
            "base_model_name_or_path"
        ]
    except (ValueError, KeyError):
        raise UserError(
            f"--{flag} {path}: {ADAPTER_CONFIG} names no base_model_name_or_path; re-save the adapter."
        ) from None
    if not base_path:
        raise UserError(f"--{flag} {path}: {ADAPTER_CONFIG} names no base model; re-save the adapter.")
    base = load_causal_lm(
        base_path, flag=f"{flag} (the adapter's base model)", trust_remote_code=trust_remote_code, dtype=dtype
    )
    model = _wrap_load(flag, path, lambda: PeftModel.from_pretrained(base, path))
    merged = model.merge_and_unload()  # a plain model again: generation and push see no adapter
    check_finite_weights(merged, flag=flag, path=path)  # the base was checked; this checks the adapter too
    return merged


def load_reward_model(
    path: str, *, trust_remote_code: bool = False, dtype: torch.dtype = torch.float32
) -> tuple[Any, Any]:
    """A sequence-classification model with one output and its *own* tokenizer
    (:func:`load_reward_tokenizer`), frozen, for :func:`reward_model_scores`."""
    from transformers import AutoModelForSequenceClassification

    flag = "reward_model_path"
    local = local_model_path(flag, path)  # an s3:// reward model: fetched into this machine's scratch first
    model, info = _wrap_load(
        flag,
        local,
        lambda: AutoModelForSequenceClassification.from_pretrained(
            local, num_labels=1, dtype=dtype, trust_remote_code=trust_remote_code, output_loading_info=True
        ),
        shown=path,
    )
    check_reward_head(info.get("missing_keys") or [], path=path)
    check_finite_weights(model, flag=flag, path=path)
    tok = load_reward_tokenizer(local, flag=flag, trust_remote_code=trust_remote_code, shown=path)
    model.config.pad_token_id = tok.pad_token_id
    model.eval().requires_grad_(False)
    return model, tok


def check_reward_head(missing_keys: list[str] | set[str], *, path: str) -> None:
    """Refuse a reward model whose weights do not all come from its checkpoint: transformers fills what the
    checkpoint lacks with random values (a causal LM given as reward model has no score head), and the run
    would train on noise. One line naming the missing weights, exit 2."""
    if missing_keys:
        names = sorted(missing_keys)
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise UserError(
            f"reward_model_path {path}: its checkpoint has no {shown}, which would start random: it is not a "
            "trained reward model (a causal LM has no score head); give a sequence-classification model with "
            "one output trained on preferences, or --reward_funcs."
        )


def load_reward_tokenizer(
    path: str, *, flag: str = "reward_model_path", trust_remote_code: bool = False, shown: str | None = None
) -> Any:
    """A reward model's tokenizer: right padding (:func:`last_token_scores` reads each row's last real
    token), pad = eos when it has no pad token, and long inputs cut on the left: the completion, which is
    what is being scored, sits at the end. ``shown``: the argument to name in errors, when ``path`` is the
    local copy of it."""
    from transformers import AutoTokenizer

    local = local_model_path(flag, path)
    tok = _wrap_load(
        flag,
        local,
        lambda: AutoTokenizer.from_pretrained(
            local, padding_side="right", trust_remote_code=trust_remote_code
        ),
        shown=shown or path,
    )
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.truncation_side = "left"
    return tok


@torch.no_grad()
def reward_model_scores(
    model: Any,
    tokenizer: Any,
    texts: list[str],
    *,
    batch_size: int,
    device: torch.device,
    autocast: Callable[[], Any] = contextlib.nullcontext,
) -> torch.Tensor:
    """(B,) float32 scalar reward of each text, read at its last token, ``batch_size`` texts per forward.

    The texts are read through the reward model's *own* tokenizer (never the policy's ids: the two
    vocabularies may differ) without adding special tokens (the text already holds those the policy
    produced); a text longer than the tokenizer's ``model_max_length`` is cut as the tokenizer's
    ``truncation_side`` says (left, from :func:`load_reward_tokenizer`). Training's reward source and the
    evaluation's judge/reward-model agreement both score through here.
    """
    max_len = tokenizer.model_max_length
    max_len = max_len if isinstance(max_len, int) and max_len < 1_000_000 else None
    out = []
    for i in range(0, len(texts), batch_size):
        enc = tokenizer(
            texts[i : i + batch_size],
            padding=True,
            truncation=max_len is not None,
            max_length=max_len,
            return_tensors="pt",
            add_special_tokens=False,  # the text already holds the special tokens the policy produced
        ).to(device)
        with autocast():
            out.append(last_token_scores(model, enc["input_ids"], enc["attention_mask"]).float().cpu())
    return torch.cat(out) if out else torch.zeros(0)


def last_token_scores(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Score at each row's last real token of a right-padded batch: (B, L) -> (B,).

    Runs the backbone and applies the head to one hidden state per row only, rather than trusting the
    model's own pooling (which locates the last token through pad ids and is wrong when pad == eos).
    """
    last = attention_mask.sum(1) - 1  # (B,)
    rows = torch.arange(input_ids.size(0), device=input_ids.device)
    backbone = getattr(model, model.base_model_prefix, None)
    head = getattr(model, "score", None)
    if backbone is not None and isinstance(head, torch.nn.Module):
        hidden = backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (B, L, H)
        return head(hidden[rows, last]).squeeze(-1)  # (B,)
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # (B, 1) or (B, L, 1)
    if logits.dim() == 3:
        return logits[rows, last, 0]
    return logits[:, 0]


# transformers' "no limit" for tokenizers saved without one (VERY_LARGE_INTEGER is ~1e30)
_NO_TOKENIZER_LIMIT = 10**9


def position_limit(model_config: Any, tokenizer: Any) -> tuple[int, str] | None:
    """The most positions (prompt + completion tokens) the model takes, and where that number comes from:
    ``max_position_embeddings`` of its config and the tokenizer's ``model_max_length``, the smaller of the
    ones that are known; None when neither is."""
    text_config = getattr(model_config, "get_text_config", lambda: model_config)()
    found: list[tuple[int, str]] = []
    positions = getattr(text_config, "max_position_embeddings", None)
    if isinstance(positions, int) and positions > 0:
        found.append((positions, "max_position_embeddings"))
    tok_max = getattr(tokenizer, "model_max_length", None)
    if isinstance(tok_max, int) and 0 < tok_max < _NO_TOKENIZER_LIMIT:
        found.append((tok_max, "the tokenizer's model_max_length"))
    return min(found) if found else None
