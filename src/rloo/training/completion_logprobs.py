"""Log-probs of sampled completions under a model: the producer's no-grad "old" and reference passes and the
update's forward with gradients read them the same way, at the sampling temperature."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from rloo import algo
from rloo.errors import UserError
from rloo.forward import response_logits, takes_block_mask
from rloo.generation import scoring_temperature
from rloo.training import deepspeed_utils
from rloo.training.collectives import Collectives

# Packed rows under compiled decoder layers are padded to a multiple of this many columns: the layers'
# shape-generic graph then meets few distinct widths, and the same alignment at every call.
COMPILED_WIDTH_MULTIPLE = 64


class Completions(Protocol):
    """What a log-prob forward reads: prompts once per group and the completions of each."""

    @property
    def prompt_ids(self) -> torch.Tensor: ...  # (P, L) left-padded
    @property
    def prompt_mask(self) -> torch.Tensor: ...  # (P, L)
    @property
    def rows(self) -> torch.Tensor: ...  # (B,) prompt of each completion
    @property
    def responses(self) -> torch.Tensor: ...  # (B, T)


class LogProbs:
    """Forwards of ``policy`` (or another model: the reference, the LoRA base) over completions."""

    def __init__(
        self,
        accelerator: Any,
        policy: Any,
        *,
        temperature: float,
        cache_free: bool,
        compiled_layers: bool = False,
        rloo_k: int,
        chunk_size: int,
    ) -> None:
        self.accelerator = accelerator
        self.policy = policy
        self.temperature = temperature
        # Activation checkpointing and a KV cache do not mix in transformers, and a compiled layer runs a
        # cache call eager (--gradient_checkpointing, --torch_compile): the policy shares prompts through
        # packed rows only, which take no cache, and runs plain rows where the attention takes no 4D mask.
        self.cache_free = cache_free
        # --torch_compile compiles the policy's layers (the LoRA reference is the policy: compiled too)
        self.compiled_layers = compiled_layers
        self.rloo_k = rloo_k
        self.chunk_size = chunk_size

    def forward(
        self,
        model: Any,
        ro: Completions,
        idx: torch.Tensor,
        *,
        entropy: bool = False,
        entropy_grad: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (b, T) of completions ``idx`` at the sampling temperature, optionally entropies (with
        their gradient for the entropy bonus)."""
        # None: sharing each prompt decided by cost
        packs = takes_block_mask(model)
        share = False if model is self.policy and self.cache_free and not packs else None
        # compiled layers: always packed rows, always a 4D mask, widths in steps, so their graphs replay
        compiled = model is self.policy and self.compiled_layers
        multiple = COMPILED_WIDTH_MULTIPLE if packs and compiled else 1
        # one autocast region for the micro-batch: the KV-cache path's two model calls cast each weight
        # once, not once per call (autocast caches a weight's cast within its region)
        with self.accelerator.autocast():
            logits = response_logits(
                model,
                ro.prompt_ids,
                ro.prompt_mask,
                ro.rows[idx],
                ro.responses[idx],
                share_prefix=share,
                width_multiple=multiple,
            )  # (b, T, V)
        # (b, T, V) in the compute dtype: the log-prob and entropy functions divide by the temperature and
        # upcast one chunk of rows at a time, never the whole tensor (2 GB of fp32 at 64 x 53 x 151,936)
        divisor = scoring_temperature(self.temperature)
        logprobs = algo.selective_log_softmax(logits, ro.responses[idx], temperature=divisor)  # (b, T)
        ent = None
        if entropy and entropy_grad:
            ent = algo.entropy_with_grad(logits, temperature=divisor)  # (b, T)
        elif entropy:
            with torch.no_grad():
                ent = algo.entropy_from_logits(logits.detach(), temperature=divisor)  # (b, T)
        return logprobs, ent

    def batched(self, model: Any, ro: Completions) -> torch.Tensor:
        """No-grad log-probs (B, T), whole prompt groups per chunk of ~local_rollout_forward_batch_size."""
        k = self.rloo_k
        bs = max(k, self.chunk_size // k * k)
        b = ro.responses.size(0)
        # inference_mode dispatches cheaper than no_grad, but under ZeRO-3 a small (persistent) parameter
        # first gathered here would stay an inference tensor, which the training forward cannot save
        no_grad = torch.no_grad if deepspeed_utils.is_zero3(self.accelerator) else torch.inference_mode
        with no_grad():
            out = torch.cat(
                [self.forward(model, ro, torch.arange(i, min(i + bs, b)))[0] for i in range(0, b, bs)]
            )
        return out.clone()  # a normal tensor again: inference tensors may not meet autograd later


# what each check of NonFiniteGuard.check measures, in its one-line error
_CHECKED = {
    "rollout/logprobs": "policy or reference log-probs of the rollout",
    "rollout/teacher_logprobs": "teacher log-probs of the rollout",
    "loss": "policy loss",
    "grad norm": "gradient norm",
}


class NonFiniteGuard:
    """Stops training (one line) when a value that would poison the weights is not finite on any rank."""

    def __init__(self, comm: Collectives, device: torch.device, *, num_updates: int, learning_rate: float):
        self.comm = comm
        self.device = device
        self.num_updates = num_updates
        self.learning_rate = learning_rate

    def check(self, update: int, checks: dict[str, torch.Tensor]) -> None:
        """Raise when a check of ``checks`` (phase -> 0-dim bool "is bad") is true on any rank; one host sync
        and, on several processes, one all-reduce, so every rank stops together."""
        flags = torch.stack([c.reshape(()).to(self.device, torch.float32) for c in checks.values()])
        flags = self.comm.sum(flags)
        bad = [phase for phase, f in zip(checks, flags.tolist(), strict=True) if f > 0]
        if bad:
            raise UserError(
                f"update {update + 1} of {self.num_updates}: non-finite {_CHECKED[bad[0]]} (phase {bad[0]}); "
                "training stopped, no model saved (checkpoints written before it are intact): lower "
                f"--learning_rate (got {self.learning_rate:g}) or check the model and the rewards."
            )
