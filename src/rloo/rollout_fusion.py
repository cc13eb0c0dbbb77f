"""Fused projections for a rollout copy: one matmul for q, k and v, one for the MLP's gate and up.

At decode batch sizes each projection is a thin matmul bound by reading its weight and by its launch; the
three attention projections (and the two MLP input projections) read the same input, so one matmul over
their concatenated weight reads the input once and launches once. The concatenated weight is the only
storage: each original projection's weight (and bias) becomes a parameter that is a view into it, so the
copy keeps the policy's parameter list, in order, and ``sync_rollout_copy`` copying into those views
refreshes the fused weight too.

Only for the layer classes whose forward is reproduced here (``FUSIBLE_ATTENTION``/``FUSIBLE_MLP``,
checked against the unfused copy's logits in tests/test_rollout_fusion.py); others are left unfused.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.nn import functional

FUSIBLE_ATTENTION = frozenset({"Qwen2Attention", "LlamaAttention"})
FUSIBLE_MLP = frozenset({"Qwen2MLP", "LlamaMLP"})
_FUSED_CLASSES: dict[type, type] = {}


def fuse_projections(model: torch.nn.Module) -> int:
    """Fuse q/k/v and gate/up of every fusible layer of ``model`` in place; returns how many modules were
    fused. Call it on a copy that is not trained: the fused weight is not a parameter."""
    fused = 0
    for module in model.modules():
        name = type(module).__name__
        if name in FUSIBLE_ATTENTION:
            fused += _fuse(module, ("q_proj", "k_proj", "v_proj"), "qkv", _attention_forward)
        elif name in FUSIBLE_MLP:
            fused += _fuse(module, ("gate_proj", "up_proj"), "gate_up", _mlp_forward)
    return fused


def is_fused(module: torch.nn.Module) -> bool:
    return type(module) in _FUSED_CLASSES.values()


def _fuse(module: torch.nn.Module, names: tuple[str, ...], group: str, forward: Any) -> bool:
    found = [getattr(module, n, None) for n in names]
    # exactly nn.Linear: an adapter-wrapped projection (LoRA) adds its own term, which a fused matmul
    # over the base weights would drop
    linears = [lin for lin in found if type(lin) is torch.nn.Linear]
    if len(linears) != len(names):
        return False
    has_bias = [lin.bias is not None for lin in linears]
    if any(has_bias) and not all(has_bias):
        return False  # a mixed layout has no one fused bias
    sizes = [lin.out_features for lin in linears]
    # (sum of out, in): the one storage; each projection's weight becomes a view into it
    weight = torch.cat([lin.weight.detach() for lin in linears])
    bias = torch.cat([lin.bias.detach() for lin in linears]) if all(has_bias) else None
    for lin, w in zip(linears, weight.split(sizes), strict=True):
        lin.weight = torch.nn.Parameter(w, requires_grad=False)
    if bias is not None:
        for lin, b in zip(linears, bias.split(sizes), strict=True):
            lin.bias = torch.nn.Parameter(b, requires_grad=False)
    # plain attributes, not buffers or parameters: the copy's parameters and state stay the policy's. A
    # recorded CUDA graph reads them in place (no copy into its own input buffers at every replay).
    torch._dynamo.mark_static_address(weight)
    if bias is not None:
        torch._dynamo.mark_static_address(bias)
    module.__dict__[f"fused_{group}_weight"] = weight
    module.__dict__[f"fused_{group}_bias"] = bias
    module.__dict__[f"fused_{group}_sizes"] = sizes
    module.__class__ = _fused_class(type(module), forward)
    return True


def _fused_class(cls: type, forward: Any) -> type:
    if cls not in _FUSED_CLASSES:
        _FUSED_CLASSES[cls] = type(f"Fused{cls.__name__}", (cls,), {"forward": forward})
    return _FUSED_CLASSES[cls]


def _attention_forward(
    self: Any,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None = None,
    past_key_values: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Qwen2Attention/LlamaAttention.forward (transformers 5) with q, k and v from one matmul."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    modeling = sys.modules[type(self).__mro__[1].__module__]  # the unfused class's modelling file
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    qkv = functional.linear(hidden_states, self.fused_qkv_weight, self.fused_qkv_bias)  # (B, S, (Hq+2Hkv)*d)
    query, key, value = (x.view(hidden_shape).transpose(1, 2) for x in qkv.split(self.fused_qkv_sizes, -1))
    cos, sin = position_embeddings
    query, key = modeling.apply_rotary_pos_emb(query, key, cos, sin)
    if past_key_values is not None:
        key, value = past_key_values.update(key, value, self.layer_idx)
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, modeling.eager_attention_forward
    )
    if hasattr(self, "sliding_window"):  # Qwen2 passes its window (None on full-attention layers)
        kwargs["sliding_window"] = self.sliding_window
    out, weights = attend(
        self,
        query,
        key,
        value,
        attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling,
        **kwargs,
    )
    out = out.reshape(*input_shape, -1).contiguous()
    return self.o_proj(out), weights


def _mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """Qwen2MLP/LlamaMLP.forward with gate and up from one matmul."""
    gate, up = functional.linear(x, self.fused_gate_up_weight, self.fused_gate_up_bias).split(
        self.fused_gate_up_sizes, -1
    )  # (..., I) each
    return self.down_proj(self.act_fn(gate) * up)
