"""The node command every training pod runs: accelerate on one node, torchrun across nodes."""

from __future__ import annotations

import sys

from rloo.stages.node import launch_command


def test_launch_commands() -> None:
    kw = dict(model_dir="/w/sft", output_dir="/w/out", checkpoint_uri="s3://b/ck")
    one = launch_command(["--rloo_k", "4"], nproc=4, num_nodes=1, model_source="s3://b/sft", **kw)
    launcher = [sys.executable, "-m", "accelerate.commands.launch"]
    assert one[:8] == [*launcher, "--num_machines", "1", "--num_processes", "4", "--multi_gpu"]
    assert one[one.index("--checkpoint_uri") + 1] == "s3://b/ck" and one[-2:] == ["--rloo_k", "4"]
    assert one[one.index("--model_source") + 1] == "s3://b/sft" and "--publish_uri" not in one
    assert "--multi_gpu" not in launch_command([], nproc=1, num_nodes=1, **kw)
    multi = launch_command([], nproc=8, num_nodes=2, **kw)
    assert multi[:7] == [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=8",
        "-m",
        "rloo.cli",
        "train",
    ]
    assert "--standalone" not in multi  # the rendezvous comes from the operator's PET_* variables
