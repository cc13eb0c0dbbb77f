"""``rloo demo``: a complete RLOO run on this machine, nothing downloaded.

Builds a tiny random-initialised policy and reward model of a real architecture, writes a toy prompt
dataset laid out like a Hub dataset, and trains with ``rloo.demo.toy:letter_reward`` (the fraction of vowels in
a completion) plus the tiny reward model at weight 0 (so the reward-model path runs too). A working run
shows the reward climbing within a minute on a laptop CPU. Everything it writes is under --output_dir: the
trained model and its metrics, and the models and dataset it started from in its assets folder.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from rich.console import Console

from rloo.config import RLOOConfig
from rloo.demo.pipeline import ASSETS_DIR
from rloo.demo.toy import TOY_UPDATES
from rloo.errors import UserError

# What 'rloo demo --help' prints: the module docstring without its reST markup.
DESCRIPTION = " ".join(__doc__.replace("``", "").split())


def build_config(output_dir: Path, *, updates: int, arch: str, seed: int) -> RLOOConfig:
    from rloo.demo.tiny import build_tiny_setup
    from rloo.demo.toy import TOY_TRAINING, write_toy_dataset

    # inside the output directory, not beside it: a run writes nowhere but where it was told to
    assets = output_dir / ASSETS_DIR
    setup = build_tiny_setup(assets / "models", arch=arch, seed=seed)
    data = write_toy_dataset(assets / "dataset", seed=seed)
    return RLOOConfig(
        model_name_or_path=str(setup.policy),
        reward_model_path=str(setup.reward_model),
        dataset_name=str(data),
        output_dir=str(output_dir),
        seed=seed,
        max_steps=updates,
        # the demo builds its models and data anew each time: a rerun (another --updates or --seed included)
        # trains again over the previous demo instead of being refused as a changed run
        overwrite_output_dir=True,
        **TOY_TRAINING,
        # MLflow without a server: a sqlite store under output_dir unless MLFLOW_TRACKING_URI names one
        report_to="mlflow" if importlib.util.find_spec("mlflow") else "none",
    )


def main(argv: list[str]) -> int:
    from rloo.parsing import OneLineParser

    parser = OneLineParser(prog="rloo demo", description=DESCRIPTION)
    parser.add_argument(
        "--output_dir",
        default="runs/demo",
        help="Where the trained model and metrics go (default: runs/demo).",
    )
    parser.add_argument(
        "--updates", type=int, default=TOY_UPDATES, help=f"RLOO updates to run (default: {TOY_UPDATES})."
    )
    parser.add_argument(
        "--arch",
        default="gpt_neox",
        choices=["gpt_neox", "llama", "qwen2"],
        help="Architecture of the tiny policy and reward model (default: gpt_neox).",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="Seed of the models, the toy dataset and training (default: 0)."
    )
    args = parser.parse_args(argv)
    if args.updates < 1:
        raise UserError(f"--updates must be >= 1 (got {args.updates}).")
    from rloo.storage.location import require_local_path, require_not_file

    require_local_path(
        "--output_dir", args.output_dir, "for object storage use 'rloo train --output_dir s3://...'."
    )
    require_not_file("--output_dir", args.output_dir)  # before the models and data are built under it

    from rloo.training.trainer import train

    console = Console(stderr=True)
    out = Path(args.output_dir)
    cfg = build_config(out, updates=args.updates, arch=args.arch, seed=args.seed)
    result = train(cfg)
    hist = result.history
    n = max(1, min(3, len(hist) // 2))  # first and last updates apart, even on a short run
    first = sum(h["objective/scores"] for h in hist[:n]) / n
    last = sum(h["objective/scores"] for h in hist[-n:]) / n
    console.print(
        f"\n[bold]demo done[/] in {result.seconds:.1f}s: {result.episodes} episodes, "
        f"mean reward {first:.3f} (first {_updates(n)}) -> {last:.3f} (last {_updates(n)})\n"
        f"  model + tokenizer: {out.resolve()}\n"
        f"  metrics:           {out.resolve() / 'metrics.jsonl'}\n"
        f"  samples:           {out.resolve() / 'samples'}\n"
        f"  its models, data:  {out.resolve() / ASSETS_DIR}\n"
        f"  train it yourself: rloo train --config {out.resolve() / 'rloo_config.json'} --output_dir OTHER_DIR "
        "[more flags]",
        soft_wrap=True,  # a long path stays one line that can be copied, not folded at the terminal's width
    )
    if cfg.report_to == "mlflow":
        from rloo.storage.redact import redact
        from rloo.tracking.ui import ui_command

        remote = os.environ.get("MLFLOW_TRACKING_URI")
        console.print(f"  MLflow runs:       {redact(remote) if remote else ui_command(out)}", soft_wrap=True)
    return 0


def _updates(n: int) -> str:
    return "update" if n == 1 else f"{n} updates"
