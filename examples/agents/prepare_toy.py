"""Build the toy calculator task offline (a tiny model warm-started to call ``add`` in about half its answers,
and its dataset) and print the ``rloo train`` commands that train it, with tools or with an environment.

    python examples/agents/prepare_toy.py /tmp/agent-toy
"""

from __future__ import annotations

import sys
from pathlib import Path

from rloo.demo.agent_toy import build_agent_sft_model, write_agent_toy_dataset


def main(root: Path) -> None:
    model = build_agent_sft_model(root / "model")
    data = write_agent_toy_dataset(root / "data")
    here = Path(__file__).resolve().parent
    common = (
        f"rloo train --model_name_or_path {model} --dataset_name {data} --num_generations 4 "
        "--per_device_train_batch_size 32 --max_completion_length 128 --learning_rate 1e-3 --temperature 1.0 "
        "--max_steps 30 --max_tool_calling_iterations 2"
    )
    print("# with a tool function and a reward function (TRL: tools=[add], reward_funcs=[correct_sum])")
    print(
        f"PYTHONPATH={here} {common} --output_dir {root / 'tools'} --tools calculator:add "
        "--reward_funcs calculator:correct_sum"
    )
    print(
        "# with an environment that keeps state and scores the episode (TRL: environment_factory=CalculatorEnv)"
    )
    print(
        f"PYTHONPATH={here} {common} --output_dir {root / 'env'} --environment_factory calculator:CalculatorEnv"
    )


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "agent-toy"))
