"""Decode attention that reads each prompt's keys and values once for its K completions.

The K completions of a prompt share its prefix, so repeating the prompt's KV cache K times (what
``DynamicCache.batch_repeat_interleave`` does) stores K copies and makes every decode step read all of
them. Here the prompt part is kept once per prompt, (P, Hkv, L, d), and only the responses' keys and
values per row, (P*K, Hkv, T, d). A decode step attends in two parts: the K rows of a prompt together
against its prompt KV (their queries stacked as extra query heads, one matmul per prompt), and each row
against its own response KV; the two softmax-normalised halves are merged by their log-sum-exps.

It plugs into transformers through its attention-function interface: for the decode loop the model's
``config._attn_implementation`` names a function registered here, and the layers' ``past_key_values``
is a :class:`SharedPrefixCache`, which the function also receives (as the ``shared_prefix`` keyword the
model passes through to attention). Model families whose layers go through that interface and have no
sliding-window layers are listed in ``SUPPORTED_MODEL_TYPES``; others keep the repeated cache.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch

# the families whose attention layers call ALL_ATTENTION_FUNCTIONS with the cache's keys and values
# (checked against each one's output in tests/test_prefix_attention.py)
SUPPORTED_MODEL_TYPES = frozenset({"llama", "qwen2"})
_PREFIX = "rloo_shared_prefix+"


def supports(model: Any, k: int) -> bool:
    """Whether decoding K > 1 completions per prompt from ``model`` can share the prompt's KV."""
    config = getattr(model, "config", None)
    if k < 2 or config is None or getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return False
    # a sliding window would need its own masking of the prompt part
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    return all(t == "full_attention" for t in layer_types)


class SharedPrefixCache:
    """The KV cache of a shared-prefix decode: the prefill's prompt keys and values per layer as they are,
    (P, Hkv, L, d), with their (P, L) padding mask, and the responses' keys and values per row in buffers
    preallocated to ``capacity`` steps, (P*K, Hkv, capacity, d), filled one token a step by ``update``
    (what the layers call), so that no step copies the cache."""

    def __init__(self, prefill_cache: Any, prompt_mask: torch.Tensor, k: int, capacity: int) -> None:
        self.prompt_keys = [layer.keys for layer in prefill_cache.layers]  # [(P, Hkv, L, d)]
        self.prompt_values = [layer.values for layer in prefill_cache.layers]
        self.prompt_mask = prompt_mask.bool()  # (P, L)
        self.k = k
        self.capacity = capacity
        n = len(self.prompt_keys)
        self._keys: list[torch.Tensor | None] = [None] * n  # [(P*K, Hkv, capacity, d)]
        self._values: list[torch.Tensor | None] = [None] * n
        self._length = [0] * n
        self.is_compileable = False

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this step's (P*K, Hkv, q, d) keys and values of layer ``layer_idx``; return the layer's
        response keys and values so far, (P*K, Hkv, t, d)."""
        keys, values = self._keys[layer_idx], self._values[layer_idx]
        if keys is None or values is None:
            keys = self._keys[layer_idx] = _empty_like_steps(key_states, self.capacity)
            values = self._values[layer_idx] = _empty_like_steps(value_states, self.capacity)
        start = self._length[layer_idx]
        end = start + key_states.size(2)
        if end > self.capacity:
            raise RuntimeError(f"shared-prefix cache holds {self.capacity} response tokens, step {end} asked")
        keys[:, :, start:end] = key_states
        values[:, :, start:end] = value_states
        self._length[layer_idx] = end
        return keys[:, :, :end], values[:, :, :end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.prompt_keys[layer_idx].size(2) + self._length[layer_idx]

    def response_mask(self) -> torch.Tensor | None:
        """Which response slots a step attends to: None, all that ``update`` returned."""
        return None


class StaticSharedPrefixCache:
    """:class:`SharedPrefixCache` with fixed shapes and addresses, for a decode step recorded once and
    replayed (a CUDA graph): prompt keys and values (P, Hkv, Lb, d) with Lb the prompt width rounded up by
    the caller (so other widths reuse the buffers), their (P, Lb) mask, response keys and values (P*K, Hkv,
    T, d) and a (T,) mask of the response slots written so far. A step writes its token's keys and values
    at response slot ``slot``, a (1,) device counter the decode loop owns and advances."""

    def __init__(
        self,
        prefill_cache: Any,
        k: int,
        prompt_size: int,
        capacity: int,
        dtype: torch.dtype,
        slot: torch.Tensor,
    ) -> None:
        self.k = k
        self.slot = slot  # (1,) long: the response slot this step's input token is written to
        self.prompt_keys: list[torch.Tensor] = []
        self.prompt_values: list[torch.Tensor] = []
        self.response_keys: list[torch.Tensor] = []
        self.response_values: list[torch.Tensor] = []
        for layer in prefill_cache.layers:
            p, h, _, d = layer.keys.shape
            device = layer.keys.device
            self.prompt_keys.append(torch.zeros((p, h, prompt_size, d), dtype=dtype, device=device))
            self.prompt_values.append(torch.zeros((p, h, prompt_size, d), dtype=dtype, device=device))
            self.response_keys.append(torch.zeros((p * k, h, capacity, d), dtype=dtype, device=device))
            self.response_values.append(torch.zeros((p * k, h, capacity, d), dtype=dtype, device=device))
        self.dtype = dtype
        first = self.prompt_keys[0]
        self.prompt_mask = torch.zeros((first.size(0), prompt_size), dtype=torch.bool, device=first.device)
        self.visible = torch.zeros(capacity, dtype=torch.bool, device=first.device)  # (T,)
        for x in (*self.prompt_keys, *self.prompt_values, *self.response_keys, *self.response_values):
            torch._dynamo.mark_static_address(x)
        torch._dynamo.mark_static_address(self.prompt_mask)
        torch._dynamo.mark_static_address(self.visible)
        self.is_compileable = False

    def load(self, prefill_cache: Any, prompt_mask: torch.Tensor) -> None:
        """A new chunk: its prefilled (P, Hkv, L, d) prompt keys and values and (P, L) mask into the first L
        prompt slots (the rest masked), no response slot visible."""
        width = prompt_mask.size(1)
        for layer, keys, values in zip(
            prefill_cache.layers, self.prompt_keys, self.prompt_values, strict=True
        ):
            keys[:, :, :width].copy_(layer.keys)
            values[:, :, :width].copy_(layer.values)
        self.prompt_mask.zero_()
        self.prompt_mask[:, :width] = prompt_mask.bool()
        self.visible.zero_()

    def open_slot(self) -> None:
        """The response slot ``slot`` (this step's input token) becomes visible: no host index."""
        self.visible.index_fill_(0, self.slot, True)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's (P*K, Hkv, 1, d) keys and values written at response slot ``slot``; returns the whole
        (P*K, Hkv, T, d) response buffers (``response_mask`` hides the slots not written yet)."""
        keys, values = self.response_keys[layer_idx], self.response_values[layer_idx]
        keys.index_copy_(2, self.slot, key_states.to(self.dtype))
        values.index_copy_(2, self.slot, value_states.to(self.dtype))
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.prompt_keys[layer_idx].size(2) + self.response_keys[layer_idx].size(2)

    def response_mask(self) -> torch.Tensor | None:
        rows = self.response_keys[0].size(0)
        return self.visible[None, :].expand(rows, -1)  # (P*K, T)


def _empty_like_steps(states: torch.Tensor, capacity: int) -> torch.Tensor:
    b, h, _, d = states.shape
    return torch.zeros((b, h, capacity, d), dtype=states.dtype, device=states.device)


def _part(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of (N, H, M, d) queries over (N, H, S, d) keys and values, with an optional (N, S)
    key mask: the normalised output (N, H, M, d) in fp32 and the log-sum-exp of the scores (N, H, M)."""
    scores = torch.matmul(query, keys.transpose(-1, -2)).float() * scaling  # (N, H, M, S)
    if mask is not None:
        # finite, not -inf: a prompt with no real token gets weight exp(min - lse) = 0 in the merge, not NaN
        scores = scores.masked_fill(~mask[:, None, None, :], torch.finfo(scores.dtype).min)
    lse = scores.logsumexp(-1)  # (N, H, M)
    probs = torch.exp(scores - lse[..., None])
    out = torch.matmul(probs.to(values.dtype), values).float()  # (N, H, M, d)
    return out, lse


def shared_prefix_attention(
    query: torch.Tensor,
    response_keys: torch.Tensor,
    response_values: torch.Tensor,
    prompt_keys: torch.Tensor,
    prompt_values: torch.Tensor,
    prompt_mask: torch.Tensor,
    k: int,
    scaling: float,
    response_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step's attention for P*K rows, prompt-major: query (P*K, Hq, 1, d) against each row's
    prompt, prompt_keys/values (P, Hkv, L, d) masked by prompt_mask (P, L), and its own response,
    response_keys/values (P*K, Hkv, t, d), masked by response_mask (P*K, t) if given. Returns
    (P*K, 1, Hq, d), the layout attention functions return."""
    b, hq, q_len, d = query.shape
    p, hkv, _, _ = prompt_keys.shape
    g = hq // hkv  # query heads per key/value head
    if q_len != 1 or b != p * k:
        raise ValueError(f"shared-prefix attention decodes one token for P*K rows, got {tuple(query.shape)}")
    # the K rows of prompt p as K*g query heads of one (P, Hkv, K*g, d) batch: one pass over its prompt KV
    grouped = query.view(p, k, hkv, g, d).transpose(1, 2).reshape(p, hkv, k * g, d)
    out_p, lse_p = _part(grouped, prompt_keys, prompt_values, scaling, prompt_mask)  # (P, Hkv, K*g, .)
    out_p = out_p.view(p, hkv, k, g, d).transpose(1, 2).reshape(b, hkv, g, d)
    lse_p = lse_p.view(p, hkv, k, g).transpose(1, 2).reshape(b, hkv, g)
    out_r, lse_r = _part(query.view(b, hkv, g, d), response_keys, response_values, scaling, response_mask)
    # softmax over prompt + response keys = the two halves weighted by their share of the total mass
    top = torch.maximum(lse_p, lse_r)  # (B, Hkv, g)
    w_p = torch.exp(lse_p - top)[..., None]
    w_r = torch.exp(lse_r - top)[..., None]
    out = (w_p * out_p + w_r * out_r) / (w_p + w_r)  # (B, Hkv, g, d)
    return out.reshape(b, 1, hq, d).to(query.dtype)


def _attention_function(base: str) -> Any:
    """The registered function for a model whose own implementation is ``base``: shared-prefix attention
    when the model call carries a :class:`SharedPrefixCache` as ``shared_prefix``, else ``base`` itself (a
    forward of the same model that is not a shared-prefix decode is left as it was)."""
    from transformers import AttentionInterface

    def attend(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *args: Any,
        shared_prefix: SharedPrefixCache | StaticSharedPrefixCache | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        if shared_prefix is None:
            # eager is each modelling file's own function, not in the registry
            default = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
            fn = AttentionInterface().get_interface(base, default)  # type: ignore[arg-type]
            return fn(module, query, key, value, attention_mask, *args, **kwargs)
        layer = int(module.layer_idx)  # type: ignore[arg-type]
        scaling = kwargs.get("scaling") or query.size(-1) ** -0.5
        out = shared_prefix_attention(
            query,
            key,
            value,
            shared_prefix.prompt_keys[layer],
            shared_prefix.prompt_values[layer],
            shared_prefix.prompt_mask,
            shared_prefix.k,
            float(scaling),
            shared_prefix.response_mask(),
        )
        return out, None

    return attend


def _registered_name(base: str) -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    name = _PREFIX + base
    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, _attention_function(base))
        # a forward of the model that is not a decode step builds its masks as under ``base``
        mask_function: Any = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(base)
        if mask_function is not None:
            ALL_MASK_ATTENTION_FUNCTIONS.register(name, mask_function)
    return name


@contextlib.contextmanager
def attending_shared_prefix(model: Any) -> Iterator[None]:
    """Within: ``model``'s attention layers call the shared-prefix function (see :func:`step_kwargs`)."""
    config = model.config
    base = config._attn_implementation or "eager"
    config._attn_implementation = _registered_name(base)
    try:
        yield
    finally:
        config._attn_implementation = base


def step_kwargs(
    cache: SharedPrefixCache | StaticSharedPrefixCache, rows: int, device: torch.device
) -> dict[str, Any]:
    """The model-call arguments of a shared-prefix decode step besides ids and positions. The (rows, 1, 1,
    1) mask is a placeholder: a 4D mask passes through transformers' mask building untouched, and the
    attention function masks the prompt's padding itself."""
    placeholder = torch.ones((rows, 1, 1, 1), dtype=torch.bool, device=device)
    return {
        "attention_mask": placeholder,
        "past_key_values": cache,
        "shared_prefix": cache,
        "use_cache": True,
    }
