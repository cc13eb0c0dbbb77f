"""One training node: download the SFT model, launch ``rloo train`` on this pod's GPUs, publish the result.

``python -m rloo.stages.node --sft_uri S --model_uri M --checkpoint_uri C --nproc_per_node N
--num_nodes K --train_config JSON [-- <more rloo train flags>]``: the JSON mapping is the validate step's
training config, which ``rloo train --config`` reads; the node adds the pod-local locations
(:data:`POD_LOCAL_FIELDS`) on the command line. Used by the single-node train step (``accelerate launch``) and by
every pod of the multi-node TrainJob or PyTorchJob (``torchrun``, rendezvous from the ``PET_*`` variables both
operators set).
Node 0 uploads the final model; re-running after a preemption resumes from ``--checkpoint_uri``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

# The 'rloo train' fields the node sets to this pod's paths and the run's durable names: never the user's.
POD_LOCAL_FIELDS = frozenset(
    {"model_name_or_path", "output_dir", "checkpoint_uri", "model_source", "publish_uri"}
)


def launch_command(
    train_args: list[str],
    *,
    model_dir: str,
    output_dir: str,
    checkpoint_uri: str,
    nproc: int,
    num_nodes: int,
    model_source: str = "",
    publish_uri: str = "",
) -> list[str]:
    """The launcher command: ``accelerate launch`` on one node, ``torchrun`` across nodes.

    ``model_source`` and ``publish_uri`` are the durable names of the local copies (the SFT model's
    store URI, where the output is uploaded): MLflow and the model's files record those, not a pod's
    temporary paths.
    """
    durable = ["--model_source", model_source] if model_source else []
    durable += ["--publish_uri", publish_uri] if publish_uri else []
    rloo = [
        "-m", "rloo.cli", "train",
        "--model_name_or_path", model_dir,
        "--output_dir", output_dir,
        "--checkpoint_uri", checkpoint_uri,
        *durable,
        *train_args,
    ]  # fmt: skip
    # launchers run as modules of this interpreter: their console scripts are only on PATH when the
    # environment is activated, which a pod or a CI job does not promise
    if num_nodes > 1:
        # no --standalone: torchrun takes nnodes / node_rank / master address from the PET_* variables
        return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", *rloo]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1"]
    launch += ["--num_processes", str(max(nproc, 1))]
    launch += ["--multi_gpu"] if nproc > 1 else []
    return [*launch, *rloo]


# Where the launched 'rloo train' records a UserError's status and message (rloo.cli writes it)
FAILURE_FILE_ENV = "RLOO_FAILURE_FILE"


def launcher_status(rc: int, failure_file: Path) -> tuple[int, str]:
    """The exit status and message of a launched ``rloo train``: accelerate and torchrun exit 1 whatever the
    training processes exited with, so a process that failed on a UserError records its status and message in
    ``failure_file`` (:data:`FAILURE_FILE_ENV`), which takes precedence over the launcher's ``rc``."""
    if rc == 0:
        return 0, ""
    try:
        record = json.loads(failure_file.read_text())
        return int(record["exit_code"]), str(record["message"])
    except (OSError, ValueError, KeyError, TypeError):
        return rc, ""


def node_rank() -> int:
    return int(os.environ.get("PET_NODE_RANK") or os.environ.get("RANK") or 0)


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - runs in the training pods
    from rloo.parsing import OneLineParser

    parser = OneLineParser(prog="python -m rloo.stages.node")
    for name in ("sft_uri", "model_uri", "checkpoint_uri"):
        parser.add_argument(f"--{name}", required=True)
    parser.add_argument("--nproc_per_node", type=int, default=1)
    parser.add_argument("--num_nodes", type=int, default=1)
    parser.add_argument("--work_dir", default=os.environ.get("RLOO_WORK_DIR", "/tmp/rloo"))
    parser.add_argument("--train_config", default="{}", help="JSON mapping of 'rloo train' config values")
    parser.add_argument("train_args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    extra = ns.train_args[1:] if ns.train_args[:1] == ["--"] else ns.train_args

    from rloo.storage import download_dir, upload_dir

    work = Path(ns.work_dir)
    sft, out = work / "sft", work / "output"
    download_dir(ns.sft_uri, sft, progress=False, overwrite=True)
    config = work / "train_config.yaml"  # JSON is YAML: 'rloo train --config' reads it as it is
    config.write_text(json.dumps(json.loads(ns.train_config), indent=2, sort_keys=True) + "\n")
    cmd = launch_command(
        ["--config", str(config), *extra],
        model_dir=str(sft),
        output_dir=str(out),
        checkpoint_uri=ns.checkpoint_uri,
        nproc=ns.nproc_per_node,
        num_nodes=ns.num_nodes,
        model_source=ns.sft_uri,
        publish_uri=ns.model_uri,
    )
    print("[rloo] " + " ".join(cmd), flush=True)
    failure_file = work / "failure.json"
    failure_file.unlink(missing_ok=True)  # a retried attempt's work dir may hold the last one's
    rc = subprocess.call(cmd, env={**os.environ, FAILURE_FILE_ENV: str(failure_file)})
    rc, message = launcher_status(rc, failure_file)
    if message:
        print(f"[rloo] training failed (exit {rc}): {message}", file=sys.stderr, flush=True)
    if rc == 0 and node_rank() == 0:
        upload_dir(out, ns.model_uri, progress=False, exclude=["checkpoint-*", "checkpoint-*/*"])
    return rc


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
