"""``rloo pipeline``: compile the Kubeflow pipeline, run it on this machine, or upload and run it on KFP.

- ``rloo pipeline compile [--output PATH] [--images FILE]``: write the compiled YAML (default: the committed
  ``pipelines/rloo_pipeline.yaml`` and the Helm chart's copy, with what is generated from the same
  declarations: ``components/validate/component.py``, the parameter table of ``pipelines/README.md``,
  ``docs/options.md``); ``--images`` names the images a build recorded (``images/build.py``: by digest after a
  push), ``make pipeline-for-images`` does both.
- ``rloo pipeline run --local [--workdir DIR] [--param NAME=VALUE ...] [--params FILE] [-v]``: every step on
  this machine with ``kfp.local``; without a ``model`` parameter on embedded defaults (tiny model, toy data,
  toy judge); step logs in ``<workdir>/logs/`` (``-v`` prints them). ``make demo`` runs exactly this.
- ``rloo pipeline upload --host URL [--package FILE] [--name NAME] [--namespace NS]``: create the pipeline or
  add a version (idempotent: an unchanged package uploads nothing), in a profile's namespace with
  ``--namespace``.
- ``--platform FILE`` (compile, upload, submit, manifest): the cluster's images, image pull secrets,
  environment (proxies) and CA bundle for every step and the multi-node job (``rloo.k8s.platform``, applied
  to the pipeline by ``rloo.pipeline.platform_overlay``; the chart renders the file); ``--stop-istio-sidecar``
  (upload, submit): end the pod's Istio sidecar when done.
- ``rloo pipeline submit --host URL --param NAME=VALUE ...``: upload as above, start a run, print its URL.
- ``rloo pipeline manifest --backend trainjob|pytorchjob [--param NAME=VALUE ...]``: print, as YAML, the
  multi-node job the train step would create for these parameters (placeholders for what is not given), for
  review or ``kubectl apply``.
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
from pathlib import Path
from typing import Any

from rloo.demo.toy import TOY_UPDATES
from rloo.errors import UserError


def _params_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--param", action="append", default=[], help="NAME=VALUE (value parsed as YAML)")
    p.add_argument("--params", default=None, help="YAML file of pipeline parameters (--param wins)")


def _kfp_args(p: argparse.ArgumentParser) -> None:
    from rloo.pipeline.compile import PIPELINE_NAME

    p.add_argument("--host", required=True, help="KFP API URL, e.g. http://localhost:8080 after port-forward")
    p.add_argument("--name", default=PIPELINE_NAME, help=f"pipeline name in KFP (default: {PIPELINE_NAME})")
    p.add_argument("--namespace", default=None, help="KFP profile namespace (multi-user installs)")
    p.add_argument("--package", default=None, help="compiled pipeline YAML (default: compile it now)")


def _images_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--images",
        default=None,
        metavar="FILE",
        help="the images to name: the record images/build.py wrote (make images / make push-images: "
        "build/images.json; by digest after a push); default: RLOO_IMAGE_REGISTRY/RLOO_IMAGE_TAG",
    )


def _platform_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--platform",
        default=None,
        metavar="FILE",
        help="the cluster's images, image pull secrets, environment (proxies) and CA bundle, applied to every "
        "step and training job: JSON, as the chart renders it (platform.json; see helm/README.md)",
    )


def _action(sub: Any, name: str, text: str) -> argparse.ArgumentParser:
    """An action's parser: ``text`` is both its line in 'rloo pipeline --help' and its own --help's."""
    parser: argparse.ArgumentParser = sub.add_parser(name, help=text, description=text)
    return parser


ACTIONS = ("compile", "run", "upload", "submit", "manifest")


def build_parser() -> argparse.ArgumentParser:
    from rloo.parsing import OneLineParser

    parser = OneLineParser(prog="rloo pipeline", description="The Kubeflow pipeline.")
    sub = parser.add_subparsers(dest="action", required=True)
    comp = _action(sub, "compile", "compile the pipeline to YAML")
    comp.add_argument(
        "--output",
        default=None,
        help="where to write (default: the checkout's pipelines/rloo_pipeline.yaml + the chart's copy, and the "
        "files generated from the same declarations: the validate component, pipelines/README.md's parameter "
        "table and docs/options.md)",
    )
    _images_arg(comp)
    _platform_arg(comp)
    run = _action(sub, "run", "run the whole pipeline on this machine (kfp.local)")
    run.add_argument("--local", action="store_true", help="required: run every step here, in subprocesses")
    run.add_argument("--workdir", default="rloo-local", help="where models, results and MLflow runs go")
    run.add_argument(
        "--updates", type=int, default=TOY_UPDATES, help="RLOO updates of the embedded (tiny-model) run"
    )
    run.add_argument(
        "-v", "--verbose", action="store_true", help="print every step's whole log (default: in files)"
    )
    run.add_argument(
        "--containers",
        action="store_true",
        help="run each step in its image (docker, or podman's Docker API at DOCKER_HOST); images from "
        "--images, RLOO_IMAGE_REGISTRY/RLOO_IMAGE_TAG or RLOO_IMAGE_<NAME> (make images)",
    )
    _images_arg(run)
    _params_args(run)
    up = _action(sub, "upload", "upload the pipeline (or a new version of it) to KFP")
    _kfp_args(up)
    submit = _action(sub, "submit", "upload the pipeline and start a run on KFP")
    _kfp_args(submit)
    for p in (up, submit):
        _platform_arg(p)
        p.add_argument(
            "--stop-istio-sidecar",
            action="store_true",
            help="when done (or failed), ask this pod's Istio sidecar to exit, so that a Kubernetes Job running "
            "this command completes (the chart's upload Job with upload.istioSidecar)",
        )
    _params_args(submit)
    submit.add_argument("--experiment", default="rloo", help="KFP experiment of the run")
    submit.add_argument("--run_name", default=None, help="KFP run name (default: <pipeline>-<time>)")
    submit.add_argument("--ui_host", default=None, help="KFP UI URL for the printed link (default: --host)")
    submit.add_argument("--service_account", default=None, help="service account of the run's pods")
    manifest = _action(sub, "manifest", "print the multi-node training job the train step would create")
    manifest.add_argument(
        "--backend",
        choices=["trainjob", "pytorchjob"],
        default=None,
        help="TrainJob (Kubeflow Trainer v2) or PyTorchJob (Training Operator v1); default: multinode_backend",
    )
    manifest.add_argument(
        "--run_id", default="manual", help="run id in the job's name and storage paths (default: manual)"
    )
    _params_args(manifest)
    _platform_arg(manifest)
    return parser


def main(argv: list[str]) -> int:
    if not argv:
        actions = ", ".join(ACTIONS)
        print(
            f"rloo pipeline: error: choose an action: {actions} (see 'rloo pipeline --help').",
            file=sys.stderr,
        )
        return 2
    try:
        ns = build_parser().parse_args(argv)
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 2
    except UserError as e:
        print(f"rloo pipeline: error: {e}", file=sys.stderr)
        return e.exit_code
    try:
        _check_local_paths(ns)
        return _dispatch(ns)
    except UserError as e:
        print(f"rloo pipeline: error: {e}", file=sys.stderr)
        return e.exit_code


def _check_local_paths(ns: argparse.Namespace) -> None:
    """The command's own files are local; object storage is for pipeline parameters (output_uri, model)."""
    from rloo.storage.location import require_local_path

    hint = {
        "output": "compile to a local file and upload it (rloo pipeline upload --package FILE).",
        "workdir": "a local run works in a local directory; give --param output_uri=s3://... for its results.",
        "params": "give a local YAML file (or --param NAME=VALUE).",
        "package": "give the local path of a compiled pipeline YAML.",
        "images": "give the local record images/build.py wrote (build/images.json).",
        "platform": "give the local platform.json (the chart mounts it in its upload Job).",
    }
    for name, why in hint.items():
        require_local_path(f"--{name}", getattr(ns, name, None), why)


def _note(text: str) -> None:
    if text:  # on stderr: stdout carries the command's results
        print(f"rloo pipeline: note: {text}", file=sys.stderr)


def _use_images(ns: argparse.Namespace) -> None:
    """``--images FILE``: the recorded images for every step, said on stderr (stdout: the command's results)."""
    if getattr(ns, "images", None) is None:
        return
    if ns.action == "run" and not ns.containers:
        raise UserError("--images names the images of --containers: add --containers, or leave --images out.")
    if ns.action == "compile" and ns.output is None:
        raise UserError(
            "--images with the committed pipeline would pin it to your build: give --output PATH "
            "(make pipeline-for-images writes build/rloo_pipeline.yaml)."
        )
    from rloo.k8s.images import is_pinned
    from rloo.pipeline.images import use_record

    for name, ref in use_record(ns.images).items():
        _note(f"{name} image: {ref}{'' if is_pinned(ref) else ' (a tag: not pinned by digest)'}")


def _read_platform(ns: argparse.Namespace) -> Any:
    """``--platform FILE``, read before anything is compiled or contacted; None without it."""
    if getattr(ns, "platform", None) is None:
        return None
    if ns.action == "compile" and ns.output is None:
        raise UserError(
            "--platform with the committed pipeline would bake your cluster into it: give --output PATH."
        )
    from rloo.pipeline import platform_overlay

    return platform_overlay.read(ns.platform)


def _apply_platform(source: Path, dest: Path, settings: Any) -> None:
    """Write ``source`` with ``settings`` applied to ``dest`` (which may be ``source``)."""
    from rloo.pipeline import platform_overlay

    dest.write_text(platform_overlay.apply(source.read_text(), settings))
    for name, ref in sorted(settings.images.items()):
        _note(f"{name} image (--platform): {ref}")


def _dispatch(ns: argparse.Namespace) -> int:
    if getattr(ns, "stop_istio_sidecar", False):
        from rloo.pipeline.submit import stop_istio_sidecar

        try:
            return _dispatch_action(ns)
        finally:
            _note(stop_istio_sidecar())
    return _dispatch_action(ns)


def _dispatch_action(ns: argparse.Namespace) -> int:
    from rloo.pipeline.compile import parse_params

    _use_images(ns)
    settings = _read_platform(ns)
    if ns.action == "compile":
        from rloo.pipeline.compile import compile_pipeline

        for path in compile_pipeline(ns.output):
            if settings is not None:
                _apply_platform(Path(path), Path(path), settings)
            print(path)
        return 0
    if ns.action == "manifest":
        from rloo.pipeline.multinode_manifest import manifest_yaml, placeholders_left

        params = parse_params(ns.param, ns.params)
        if ns.backend:
            params["multinode_backend"] = ns.backend
        sys.stdout.write(manifest_yaml(params, run_id=ns.run_id, platform=settings))
        left = placeholders_left(params)
        if left:  # on stderr: stdout stays the YAML, for a pipe into kubectl
            verb = "is a placeholder" if len(left) == 1 else "are placeholders"
            print(
                f"rloo pipeline: note: {', '.join(left)} {verb} in this job: pass --param NAME=VALUE for "
                f"{'it' if len(left) == 1 else 'each'} before applying it.",
                file=sys.stderr,
            )
        return 0
    if ns.action == "run":
        if not ns.local:
            raise UserError(
                "'rloo pipeline run' runs on this machine: pass --local (or use 'rloo pipeline submit')."
            )
        if ns.updates < 1:
            raise UserError(f"--updates must be >= 1 (got {ns.updates}).")
        from rloo.demo.pipeline import embedded_params, toy_judge
        from rloo.pipeline.local import run_pipeline_locally, summary

        # the demo fixtures come in from here (the CLI layer): the pipeline layer does not import rloo.demo
        result = run_pipeline_locally(
            ns.workdir,
            parse_params(ns.param, ns.params),
            defaults=functools.partial(embedded_params, updates=ns.updates),
            judge=toy_judge,
            verbose=ns.verbose,
            containers=ns.containers,
        )
        print("\n".join(summary(result)))
        return 0
    params = parse_params(ns.param, ns.params) if ns.action == "submit" else {}
    from rloo.pipeline import submit as S

    if ns.action == "submit":
        params = S.params_for_submit(params, settings)  # before contacting anything
        _note(
            "the SFT model, datasets, bucket and Secrets are checked by the run's validate step, in the cluster"
        )
    with tempfile.TemporaryDirectory(prefix="rloo-pipeline-") as tmp:
        package = ns.package
        if package is None:
            from rloo.pipeline.compile import compile_pipeline

            (package,) = compile_pipeline(Path(tmp) / "rloo_pipeline.yaml")
        if settings is not None:  # the package as the cluster runs it: its digest names the version
            applied = Path(tmp) / "rloo_pipeline.platform.yaml"
            _apply_platform(Path(package), applied, settings)
            package = applied
        with S.api_errors(ns.host):
            client = S.connect(ns.host, namespace=ns.namespace, ui_host=getattr(ns, "ui_host", None))
            # before anything is uploaded: an older KFP would refuse every run of this pipeline
            _note(S.check_kfp_version(S.kfp_version(client), ns.host))
            if ns.action == "submit":
                _note(S.check_training_runtime(params, S.kube_custom_api(), ns.namespace or "kubeflow"))
            up = S.ensure_uploaded(client, package, ns.name, namespace=ns.namespace)
    what = {"pipeline": "created pipeline", "version": "added version", "nothing": "unchanged, using version"}
    print(
        f"{what[up.created]} {ns.name} / {up.version_name} (pipeline {up.pipeline_id}, version {up.version_id})"
    )
    if ns.action == "upload":
        return 0
    import time

    run_name = ns.run_name or f"{ns.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    with S.api_errors(ns.host):
        run_id = S.start_run(
            client,
            up,
            params,
            experiment=ns.experiment,
            run_name=run_name,
            namespace=ns.namespace,
            service_account=ns.service_account,
        )
    print(f"started run {run_name}: {S.run_url(ns.ui_host or ns.host, run_id)}")
    return 0
