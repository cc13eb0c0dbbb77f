"""What the project asks of vLLM exists in the installed vLLM: every keyword, method and argument.

Runs wherever ``vllm`` imports, GPU or not (``make test-vllm``: vLLM's CPU build, same version numbers as
the GPU build). Method signatures are read from vLLM's source files, the GPU model runner's included (the
CPU build ships it), and the calls the stand-in engine of test_vllm_backend.py records are bound to them:
what the real engine does with those calls is tests/vllm_engine's business.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path
from typing import Any

import pytest
import torch

vllm = pytest.importorskip("vllm")

from vllm import SamplingParams as VSamplingParams  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402

from rloo.demo.tiny import TinySetup  # noqa: E402
from rloo.eval.config import EvalConfig  # noqa: E402
from rloo.eval.generation import vllm_llm_kwargs, vllm_prompts, vllm_sampling_kwargs  # noqa: E402
from rloo.generation import SamplingParams, left_pad, row_seeds  # noqa: E402
from rloo.training import vllm_backend as vb  # noqa: E402
from tests.training import test_vllm_backend as shell  # noqa: E402

VLLM_DIR = Path(vllm.__file__).parent
PARAMS = [
    SamplingParams(max_new_tokens=9, temperature=0.7, top_k=0, top_p=0.9, stop_token_id=3, pad_token_id=0),
    SamplingParams(max_new_tokens=4, temperature=1.0, top_k=5, pad_token_id=0),
    SamplingParams(max_new_tokens=2, greedy=True, pad_token_id=0),
]


def test_the_installed_vllm_is_in_the_supported_range() -> None:
    from tests.test_vllm_versions import vllm_extra

    assert vllm_extra().contains(vllm.__version__), vllm.__version__


@pytest.mark.parametrize("params", PARAMS, ids=["sampled", "top_k", "greedy"])
@pytest.mark.parametrize("logprobs", [True, False])
def test_sampling_kwargs_are_real_sampling_params_fields(params: SamplingParams, logprobs: bool) -> None:
    kw = vb.sampling_kwargs(params, 123, return_logprobs=logprobs)
    assert set(kw) <= set(VSamplingParams.__struct_fields__), set(kw) - set(VSamplingParams.__struct_fields__)
    sp = VSamplingParams(**kw)  # validates the values too (e.g. top_k=-1, temperature=0)
    # vLLM resets the filters of a greedy request (temperature 0) itself
    normalised = {"top_k", "top_p"} if params.greedy else set()
    for name, value in kw.items():
        assert name in normalised or getattr(sp, name) == value, name
    assert sp.ignore_eos and sp.seed == 123


def _engine_kwargs(model_path: str = "/m") -> dict[str, Any]:
    return vb.engine_kwargs(
        model_path=model_path,
        gpu_memory_utilization=0.4,
        enable_sleep_mode=True,
        dtype="float32",
        seed=3,
        max_model_len=600,
        max_num_seqs=24,
    )


def test_engine_kwargs_are_real_engine_args_fields(tiny_setup: TinySetup) -> None:
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    model = str(tiny_setup.policy)  # EngineArgs resolves the model: a real local checkpoint
    for kw in (_engine_kwargs(model), vllm_llm_kwargs(EvalConfig(**_eval_base()), model)):
        assert set(kw) <= fields, set(kw) - fields
        args = EngineArgs(**kw)  # LLM(**kw) builds exactly this
        for name, value in kw.items():
            assert getattr(args, name) == value, name


def test_engine_choices_are_among_vllms_literals() -> None:
    """external_launcher and processed_logprobs are accepted values, not just accepted keywords."""
    from typing import get_args

    from vllm.config.model import LogprobsMode
    from vllm.config.parallel import DistributedExecutorBackend

    kw = _engine_kwargs()
    assert kw["distributed_executor_backend"] in get_args(DistributedExecutorBackend)
    assert kw["logprobs_mode"] in get_args(LogprobsMode)


def _eval_base() -> dict[str, Any]:
    return dict(model_name_or_path="m", dataset_name="d", judge_base_url="http://x/v1", judge_model="j")


def test_eval_sampling_and_prompts_are_real() -> None:
    from vllm.inputs import TokensPrompt

    for cfg in (EvalConfig(**_eval_base()), EvalConfig(**_eval_base(), temperature=0.7)):
        kw = vllm_sampling_kwargs(cfg)
        sp = VSamplingParams(**kw)
        assert all(getattr(sp, k) == v for k, v in kw.items())
    (prompt,) = vllm_prompts([[1, 2, 3]])
    assert set(prompt) <= set(TokensPrompt.__annotations__)


def test_batch_invariance_switch_is_vllms_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.envs as envs

    for value, expected in ((True, True), (False, False)):
        for name, text in vb.engine_env(batch_invariant=value).items():
            monkeypatch.setenv(name, text)
            assert name in envs.environment_variables
            assert envs.environment_variables[name]() is expected


# ------------------------------------------------------------------------------------------------------
# methods of vllm.LLM and of the worker, from their source
def _signature(path: Path, cls: str, method: str) -> inspect.Signature:
    """The signature of ``cls.method`` in ``path``, built from its AST (defaults as placeholders)."""
    tree = ast.parse(path.read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
    (fn,) = [n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == method]
    a, params, kind = fn.args, [], inspect.Parameter
    positional = [*a.posonlyargs, *a.args]
    first_default = len(positional) - len(a.defaults)
    for i, arg in enumerate(positional):
        k = kind.POSITIONAL_ONLY if i < len(a.posonlyargs) else kind.POSITIONAL_OR_KEYWORD
        params.append(kind(arg.arg, k, default=None if i >= first_default else kind.empty))
    if a.vararg:
        params.append(kind(a.vararg.arg, kind.VAR_POSITIONAL))
    for arg, default in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        params.append(kind(arg.arg, kind.KEYWORD_ONLY, default=kind.empty if default is None else None))
    if a.kwarg:
        params.append(kind(a.kwarg.arg, kind.VAR_KEYWORD))
    sig = inspect.Signature(params)
    ret = ast.unparse(fn.returns) if fn.returns else ""
    return sig.replace(return_annotation=ret)


LLM_PY = VLLM_DIR / "entrypoints" / "llm.py"


def test_every_call_the_backend_makes_binds_to_the_real_llm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vb, "_empty_cache", lambda: None)
    model = torch.nn.Linear(2, 2)
    llm = shell.StandInLLM()
    gen = vb.VLLMGenerator(llm, model, enable_sleep_mode=True)  # the real SamplingParams class by default
    ids, mask = left_pad([[5, 6], [7]], 0)
    params = SamplingParams(max_new_tokens=3, temperature=1.0, pad_token_id=0)
    gen.generate(ids, mask, 2, params, row_seeds(1, 0, torch.tensor([0, 1]), 2), return_logprobs=True)
    methods = {name for name, _, _ in llm.calls}
    assert methods == {"collective_rpc", "sleep", "wake_up", "reset_prefix_cache", "generate"}
    for name, args, kwargs in llm.calls:
        _signature(LLM_PY, "LLM", name).bind(None, *args, **kwargs)
    assert all(isinstance(sp, VSamplingParams) for _, sp in llm.requests)
    # wake_up tags are among vLLM's
    assert {t for n, _, kw in llm.calls if n == "wake_up" for t in kw["tags"]} <= {"weights", "kv_cache"}
    assert "weights" in LLM_PY.read_text() and "kv_cache" in LLM_PY.read_text()


def test_reset_prefix_cache_reports_success_as_a_bool() -> None:
    assert _signature(LLM_PY, "LLM", "reset_prefix_cache").return_annotation == "bool"


def test_reload_weights_takes_a_weights_iterator_in_every_model_runner() -> None:
    """collective_rpc('reload_weights') reaches Worker.reload_weights, which forwards to the model runner."""
    worker = _signature(VLLM_DIR / "v1" / "worker" / "gpu_worker.py", "Worker", "reload_weights")
    assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in worker.parameters.values())
    runner = _signature(
        VLLM_DIR / "v1" / "worker" / "gpu_model_runner.py", "GPUModelRunner", "reload_weights"
    )
    runner.bind(None, weights_iterator=iter([]))
    assert "weights_iterator" in runner.parameters
    new_runner = VLLM_DIR / "v1" / "worker" / "gpu" / "model_runner.py"
    if new_runner.is_file():  # the new model runner delegates to the old one's implementation
        assert "GPUModelRunnerV1.reload_weights(self, *args, **kwargs)" in new_runner.read_text()


def test_external_launcher_runs_rpcs_in_this_process() -> None:
    """So the weights iterator is consumed here, lazily, not pickled to another process."""
    source = (VLLM_DIR / "config" / "parallel.py").read_text()
    assert 'os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"' in source
    executor = (VLLM_DIR / "v1" / "executor" / "uniproc_executor.py").read_text()
    assert "class ExecutorWithExternalLauncher" in executor
    assert "run_method(self.driver_worker, method, args, kwargs)" in executor
