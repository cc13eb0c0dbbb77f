"""The model card (README.md): YAML front matter + Markdown, from plain inputs (pure, deterministic).

No timestamps or registry version numbers go in: the same run renders the same card, so re-publishing it
leaves the storage manifest unchanged (idempotent pushes compare manifests).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from rloo.push.gate import Decision, EvalResults

# The hyperparameters worth a reader's time; the full config ships as rloo_config.json next to the card.
CARD_CONFIG_KEYS = (
    "rloo_k",
    "learning_rate",
    "kl_coef",
    "kl_estimator",
    "token_level_kl",
    "cliprange",
    "num_ppo_epochs",
    "num_mini_batches",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "total_episodes",
    "max_steps",
    "response_length",
    "temperature",
    "missing_eos_penalty",
    "normalize_reward",
    "normalize_advantage",
    "reward_model_path",
    "reward_funcs",
    "seed",
)
CURVE_KEYS = ("objective/scores", "objective/rlhf_reward", "objective/kl", "objective/entropy")


@dataclass(frozen=True)
class CurveSummary:
    key: str
    first: float
    last: float
    minimum: float
    maximum: float


@dataclass(frozen=True)
class CardInputs:
    model_name: str
    base_model: str | None
    datasets: Sequence[str]
    rloo_config: Mapping[str, Any]
    num_updates: int
    curves: Sequence[CurveSummary]
    eval: EvalResults | None
    decision: Decision
    lineage: Mapping[str, str | None]
    digests: Mapping[str, str] = field(default_factory=dict)  # file -> sha256
    base_model_revision: str | None = None  # the Hub commit the SFT model was fetched at


def summarize_curves(
    rows: Sequence[Mapping[str, Any]], keys: Sequence[str] = CURVE_KEYS
) -> list[CurveSummary]:
    """First/last/min/max of each key over the metrics.jsonl rows that have a finite value for it."""
    out = []
    for key in keys:
        vals = [
            float(r[key])
            for r in rows
            if isinstance(r.get(key), (int, float))
            and not isinstance(r.get(key), bool)
            and math.isfinite(r[key])
        ]
        if vals:
            out.append(CurveSummary(key, vals[0], vals[-1], min(vals), max(vals)))
    return out


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list):
        return ", ".join(str(x) for x in v) or "-"
    return "-" if v is None else str(v)


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def render_model_card(inp: CardInputs) -> str:
    front: dict[str, Any] = {"library_name": "transformers", "tags": ["rloo", "rlhf"]}
    if inp.base_model:
        front["base_model"] = inp.base_model
    if inp.base_model_revision:
        # not a Hub metadata key, but kept next to base_model so tools reading the front matter see the pin
        front["base_model_revision"] = inp.base_model_revision
    if inp.datasets:
        front["datasets"] = list(inp.datasets)
    lines = ["---", yaml.safe_dump(front, sort_keys=False).rstrip(), "---", "", f"# {inp.model_name}", ""]
    lines += [
        f"Fine-tuned with RLHF using REINFORCE Leave-One-Out (RLOO) from `{inp.base_model or 'unknown'}` "
        + (f"(revision `{inp.base_model_revision}`) " if inp.base_model_revision else "")
        + f"on {', '.join(f'`{d}`' for d in inp.datasets) or 'an unnamed dataset'}.",
        "",
        f"**Promotion decision: {inp.decision.decision}** — {inp.decision.reason}.",
        "",
        "## Evaluation",
        "",
    ]
    if inp.eval is None:
        lines += ["No evaluation results were available for this model.", ""]
    else:
        e = inp.eval
        # the gate reads complete files only: both are there
        assert e.baseline is not None and e.paired_difference is not None
        lines += [
            "| | win rate | 95% interval |",
            "| --- | --- | --- |",
            f"| trained (RLOO) | {_pct(e.trained.estimate)} | [{_pct(e.trained.low)}, {_pct(e.trained.high)}] |",
            f"| baseline (SFT) | {_pct(e.baseline.estimate)} | [{_pct(e.baseline.low)}, {_pct(e.baseline.high)}] |",
            f"| paired difference (trained - SFT) | {e.paired_difference.estimate:+.3f} | "
            f"[{e.paired_difference.low:+.3f}, {e.paired_difference.high:+.3f}] |",
            "",
            f"Judge: `{e.judge_model}`{f' at {e.judge_base_url}' if e.judge_base_url else ''}; "
            f"{e.num_examples} examples, {e.ties} ties, {e.invalid} invalid judgements.",
            "",
        ]
    lines += ["## Training", "", f"{inp.num_updates} RLOO updates.", ""]
    if inp.curves:
        lines += ["| metric | first | last | min | max |", "| --- | --- | --- | --- | --- |"]
        lines += [
            f"| `{c.key}` | {c.first:.4g} | {c.last:.4g} | {c.minimum:.4g} | {c.maximum:.4g} |"
            for c in inp.curves
        ]
        lines.append("")
    cfg = [(k, inp.rloo_config[k]) for k in CARD_CONFIG_KEYS if k in inp.rloo_config]
    if cfg:
        lines += ["### RLOO configuration", "", "| parameter | value |", "| --- | --- |"]
        lines += [f"| `{k}` | {_fmt(v)} |" for k, v in cfg]
        lines += ["", "The full configuration is in `rloo_config.json`.", ""]
    lines += ["## Lineage", ""]
    lines += [f"- {k}: `{v}`" for k, v in inp.lineage.items() if v]
    if inp.digests:
        lines += ["", "Artifact digests (SHA-256):", ""]
        lines += [f"- `{name}`: `{digest}`" for name, digest in sorted(inp.digests.items())]
    lines.append("")
    return "\n".join(lines)
