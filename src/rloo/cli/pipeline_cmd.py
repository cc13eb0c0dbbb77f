"""``rloo pipeline``: compile the Kubeflow pipeline (and, later, run it locally or submit it).

``rloo pipeline compile [--output PATH]`` writes the compiled YAML (default: the committed
``pipelines/rloo_pipeline.yaml``). ``rloo pipeline run --local --param NAME=VALUE ... [--params FILE]`` runs
every step on this machine with ``kfp.local`` (subprocesses of this interpreter). ``submit`` is not
implemented yet and says so.
"""

from __future__ import annotations

import argparse
import sys

from rloo.errors import UserError


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rloo pipeline", description="The Kubeflow pipeline.")
    sub = parser.add_subparsers(dest="action", required=True)
    comp = sub.add_parser("compile", help="compile the pipeline to YAML")
    comp.add_argument("--output", default=None, help="where to write (default: pipelines/rloo_pipeline.yaml)")
    run = sub.add_parser("run", help="run the pipeline (--local: on this machine, with kfp.local)")
    run.add_argument("--local", action="store_true", help="required: only local runs are supported")
    run.add_argument("--param", action="append", default=[], help="NAME=VALUE (value parsed as YAML)")
    run.add_argument("--params", default=None, help="YAML file of pipeline parameters")
    run.add_argument("--pipeline_root", default="runs/pipeline", help="where local outputs go")
    sub.add_parser("submit", help="submit the compiled pipeline to a KFP endpoint")
    try:
        ns = parser.parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    try:
        if ns.action == "compile":
            from rloo.pipeline.compile import compile_pipeline

            print(compile_pipeline(ns.output))
            return 0
        if ns.action == "run":
            if not ns.local:
                raise UserError("only local runs are supported: pass --local (or submit the compiled YAML).")
            from rloo.pipeline.compile import parse_params, run_local

            run_local(parse_params(ns.param, ns.params), ns.pipeline_root)
            return 0
        raise UserError(f"'rloo pipeline {ns.action}' is not implemented yet; use 'rloo pipeline compile'.")
    except UserError as e:
        print(f"rloo pipeline: error: {e}", file=sys.stderr)
        return e.exit_code
