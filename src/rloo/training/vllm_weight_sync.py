"""What ``rloo vllm-serve`` adds to each vLLM worker: receiving the policy's weights over HTTP.

vLLM mixes ``--worker-extension-cls`` into its worker class (vllm/v1/worker/worker_base.py,
``WorkerWrapperBase.init_worker``), and its server's ``POST /collective_rpc`` (mounted with
``VLLM_SERVER_DEV_MODE=1``: vllm/entrypoints/serve/dev/rpc/api_router.py) calls a worker method by name with
JSON keyword arguments, between two engine steps, and answers once every worker returned. The trainer sends
the weights that changed as safetensors bytes (base64, a bounded chunk per call), so no shared volume and no
GPU fabric is needed: it works from any pod that reaches the server's port, on CPU as on GPU. The names must
not collide with the worker's own attributes (vLLM asserts it), hence the ``rloo_`` prefix.

Imported in the worker process: stdlib, torch and safetensors only.
"""

from __future__ import annotations

import base64
from typing import Any

STAGE_METHOD = "rloo_stage_weights"
WEIGHTS_METHOD = "rloo_load_weights"
INFO_METHOD = "rloo_model_info"
EXTENSION = f"{__name__}.WeightSync"


class WeightSync:
    """Methods mixed into vLLM's worker (``self`` is the worker: ``reload_weights``, ``model_config``)."""

    model_config: Any
    reload_weights: Any

    def rloo_stage_weights(self, data: str) -> dict[str, Any]:
        """Hold one chunk of weights (base64 safetensors, checkpoint names) until ``rloo_load_weights``."""
        from safetensors.torch import load

        staged: dict[str, Any] = self.__dict__.setdefault("rloo_staged", {})
        tensors = load(base64.b64decode(data))
        staged.update(tensors)
        return {"tensors": len(tensors)}

    def rloo_load_weights(self, version: int | None = None) -> dict[str, Any]:
        """Load every staged tensor into the served model in one go, then drop them.

        One call of the worker's ``reload_weights`` (vllm/v1/worker/gpu_model_runner.py): vLLM's layer-wise
        reload, which runs the post-processing of a fresh load (repacked CPU and quantized kernels). The
        model's plain ``load_weights`` cannot run after that processing (the parameters it made have no
        ``weight_loader``), and a layer must get all its tensors in the same reload: a fused layer (qkv)
        loaded in part is processed with its other parts undefined
        (vllm/model_executor/model_loader/reload/layerwise.py, ``finalize_layerwise_processing``).
        """
        staged: dict[str, Any] = self.__dict__.pop("rloo_staged", {})
        if not staged:
            raise ValueError("no weights staged: call rloo_stage_weights first")
        self.reload_weights(weights_iterator=iter(list(staged.items())))
        self.rloo_weights_version = version
        return {"tensors": len(staged), "version": version}

    def rloo_model_info(self) -> dict[str, Any]:
        """What the trainer checks before the first rollout: the same model, a context long enough."""
        mc = self.model_config
        return {
            "architectures": list(getattr(mc.hf_config, "architectures", None) or []),
            "vocab_size": int(mc.get_vocab_size()),
            "max_model_len": int(mc.max_model_len),
            "dtype": str(mc.dtype).removeprefix("torch."),
            "logprobs_mode": str(getattr(mc, "logprobs_mode", "")),
            "version": getattr(self, "rloo_weights_version", None),
        }
