"""``rloo``: the package's one command.

Sub-commands: ``train``, ``eval``, ``push``, ``pipeline``, ``demo``, ``ui`` and ``vllm-serve`` (see :data:`USAGE`).
User errors print one line on stderr and exit 2; they never show a traceback.
"""

from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

from rloo.errors import UserError

USAGE = """usage: rloo <command> [flags]

commands:
  train      RLOO training (flags as the classic TRL RLOO trainer; see 'rloo train --help')
  eval       win rates of a trained model and its SFT baseline against references, by an LLM judge
  push       publish a trained model (object storage, MLflow registry, Hub) behind a promotion gate
  pipeline   compile the Kubeflow pipeline, run it locally, or upload and run it on Kubeflow Pipelines
  demo       build a tiny model and toy task locally and train on it for a few updates
  ui         the MLflow UI over a local run's tracking store (what 'make demo' points at)
  vllm-serve a vLLM server for rollouts ('rloo train --use_vllm --vllm_mode server' pushes weights to it)

'rloo <command> --help' lists a command's flags; 'rloo --version' prints the version.
"""


def _train(argv: list[str]) -> int:
    from rloo.config import ALIASES, RLOOConfig
    from rloo.parsing import parse_config

    cfg = parse_config(
        RLOOConfig,
        argv,
        prog="rloo train",
        description=textwrap.fill(
            "RLOO training. Flags follow the classic TRL RLOO trainer; the current trainer's names and verl's "
            "or OpenRLHF's spellings ("
            + ", ".join(f"{a} -> {c}" for a, c in ALIASES.items())
            + ") are accepted as aliases.",
            width=100,
        ),
    )
    _setup_logging()
    from rloo.storage.progress import quiet_library_bars

    quiet_library_bars()
    from rloo.training.trainer import train

    train(cfg)
    return 0


def _setup_logging() -> None:
    from rloo.cli.output import setup_logging
    from rloo.parsing.base import quiet_without_torch

    with quiet_without_torch():  # the first import of transformers
        setup_logging()


def _demo(argv: list[str]) -> int:
    from rloo.demo.cli import main as demo_main

    _setup_logging()
    return demo_main(argv)


def _eval(argv: list[str]) -> int:
    from rloo.cli.eval_cmd import main as eval_main

    _setup_logging()
    return eval_main(argv)


def _push(argv: list[str]) -> int:
    from rloo.cli.push_cmd import main as push_main

    _setup_logging()
    return push_main(argv)


def _pipeline(argv: list[str]) -> int:
    from rloo.cli.pipeline_cmd import main as pipeline_main

    _setup_logging()
    return pipeline_main(argv)


def _ui(argv: list[str]) -> int:
    from rloo.cli.ui_cmd import main as ui_main

    return ui_main(argv)


def _vllm_serve(argv: list[str]) -> int:
    from rloo.cli.vllm_serve_cmd import main as serve_main

    return serve_main(argv)


COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "train": _train,
    "eval": _eval,
    "push": _push,
    "pipeline": _pipeline,
    "demo": _demo,
    "ui": _ui,
    "vllm-serve": _vllm_serve,
}


def _tell_the_launcher(e: UserError) -> None:
    """Record ``e`` where rloo.stages.node asked (it launched this 'rloo train'): accelerate and torchrun exit
    1 whatever their processes exited with, and a retried pipeline step needs the status (rloo.stages.retry)."""
    from rloo.stages.node import FAILURE_FILE_ENV

    path = os.environ.get(FAILURE_FILE_ENV)
    if not path:
        return
    import json

    from rloo.diskspace import write_bytes_atomic

    try:
        body = json.dumps({"exit_code": e.exit_code, "message": str(e)}).encode()
        write_bytes_atomic(Path(path), body, "the failure record")
    except (OSError, UserError):
        pass  # the error itself is on stderr already


def _say(line: str) -> None:
    """One line to stderr in one write: under torchrun every rank shares the stream, and ``print`` writes
    the text and its newline apart, so two ranks' lines could run into one."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


# The extra that brings PyTorch for each command that runs models. The client extra has none: it compiles,
# checks parameters, uploads and submits (rloo pipeline compile/upload/submit/manifest).
_TORCH_EXTRA = {
    "train": "train",
    "demo": "train",
    "eval": "eval",
    "push": "tracking",
    "pipeline": "train,eval",
}


def _needs_torch(command: str) -> str:
    return (
        "this command needs PyTorch, which is not installed (the client extra compiles, uploads and submits "
        f"only): pip install -c constraints.txt -e '.[{_TORCH_EXTRA.get(command, 'train')}]', or make install."
    )


def main(argv: list[str] | None = None) -> int:
    """Run one ``rloo`` command; its exit code. A torchrun rank ends here, with that code, without the
    interpreter's teardown, where gloo's threads can abort it (:func:`rloo.training.process_group.end_rank`)."""
    from rloo.training import process_group

    return process_group.end_rank(_run(list(sys.argv[1:] if argv is None else argv)))


def _run(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0 if argv else 2
    if argv[0] in ("-V", "--version", "version"):
        from importlib.metadata import version

        print(f"rloo {version('rloo-kfp')}")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"rloo: unknown command {command!r}; choose one of: {', '.join(COMMANDS)}.", file=sys.stderr)
        return 2
    try:
        # Before any command reads it: a password in the URI would be printed by MLflow's own log lines, and
        # a URI MLflow has no store for would leave the run untracked without a word.
        from rloo.tracking.server import refuse_credentials_in_uri
        from rloo.tracking.uri import check_tracking_uri

        refuse_credentials_in_uri(os.environ.get("MLFLOW_TRACKING_URI"))
        check_tracking_uri(os.environ.get("MLFLOW_TRACKING_URI"))
        return COMMANDS[command](rest)
    except UserError as e:
        _say(f"rloo {command}: error: {e}")
        _tell_the_launcher(e)
        return e.exit_code
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] != "torch":
            raise
        _say(f"rloo {command}: error: {_needs_torch(command)}")
        return 2
    except SystemExit as e:  # argparse exits after printing --help: return its status, don't raise
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 2
    except KeyboardInterrupt:
        _say(f"rloo {command}: interrupted.")
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
