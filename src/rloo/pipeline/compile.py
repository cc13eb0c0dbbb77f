"""Compile the pipeline to its YAML (the committed ``pipelines/rloo_pipeline.yaml``) and load it back.

``components/`` and ``pipelines/`` live at the repository root, next to ``src/``: they are imported from the
checkout this package is installed from (an editable install), or from ``RLOO_REPO_ROOT``.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from pathlib import Path
from typing import Any

from rloo.errors import UserError

# The pipeline's name in KFP (what upload and submit look it up by)
PIPELINE_NAME = "rloo-rlhf"
PIPELINE_MODULE = "pipelines.rloo_pipeline"
PIPELINE_FUNC = "rloo_pipeline"


def repo_root() -> Path:
    root = Path(os.environ.get("RLOO_REPO_ROOT") or Path(__file__).resolve().parents[3])
    if not (root / "pipelines" / "rloo_pipeline.py").is_file():
        raise UserError(
            f"no pipelines/rloo_pipeline.py under {root}: run from a checkout (pip install -e .) or set RLOO_REPO_ROOT."
        )
    return root


def default_yaml() -> Path:
    return repo_root() / "pipelines" / "rloo_pipeline.yaml"


def load_pipeline() -> Any:
    """The ``@dsl.pipeline`` function (imports kfp; needs the ``kfp`` extra)."""
    try:
        import kfp  # noqa: F401
    except ImportError:
        raise UserError("the pipeline needs kfp: pip install -c constraints.txt -e '.[client]'.") from None
    root = str(repo_root())
    if root not in sys.path:
        sys.path.insert(0, root)
    return getattr(importlib.import_module(PIPELINE_MODULE), PIPELINE_FUNC)


def chart_copy() -> Path:
    """The Helm chart's copy of the compiled pipeline (its upload Job reads it from a ConfigMap; Helm can only
    read files inside the chart)."""
    return repo_root() / "helm" / "files" / "rloo_pipeline.yaml"


def readme_path() -> Path:
    """``pipelines/README.md``: its parameter table is generated from the pipeline's signature."""
    return repo_root() / "pipelines" / "README.md"


def compile_pipeline(output: str | os.PathLike[str] | None = None) -> list[Path]:
    """Write the compiled pipeline YAML to ``output``; by default to the committed file and, when the chart
    is there, the chart's copy, and refresh the parameter table of ``pipelines/README.md`` and the flag
    reference ``docs/options.md``. Returns the paths written."""
    import tempfile

    from kfp import compiler

    out = Path(output) if output else default_yaml()
    if out.suffix not in (".yaml", ".yml", ".json"):  # the compiler writes by the suffix, or raises
        raise UserError(f"--output {out}: name a .yaml file (or .json).")
    written = [] if output else refresh_validate_component()  # before the pipeline imports it
    func = load_pipeline()
    with tempfile.TemporaryDirectory(prefix="rloo-compile-") as tmp:
        # compiled aside (the compiler picks YAML or JSON by the name's suffix), then put in place whole
        built = Path(tmp) / f"pipeline{out.suffix}"
        compiler.Compiler().compile(pipeline_func=func, package_path=str(built))
        data = built.read_bytes()
    write_whole(out, data, "--output" if output else "the compiled pipeline")
    written.insert(0, out)
    chart = chart_copy()
    if output is None and (chart.parent.parent / "Chart.yaml").is_file():
        write_whole(chart, data, "the chart's copy of the pipeline")
        written.append(chart)
    readme = readme_path()
    if output is None and readme.is_file():
        from rloo.pipeline.params import readme_with_table

        text = readme.read_text()
        if readme_with_table(text) != text:
            write_whole(readme, readme_with_table(text).encode(), "pipelines/README.md")
            written.append(readme)
    if output is None:
        written += write_options_reference()
    return written


def write_options_reference() -> list[Path]:
    """Rewrite ``docs/options.md`` (the commands' flags, from their config fields) when it differs; returns
    the paths written."""
    from rloo.pipeline.reference import options_reference, reference_path

    path, text = reference_path(repo_root()), options_reference()
    if path.parent.is_dir() and (not path.is_file() or path.read_text() != text):
        write_whole(path, text.encode(), "docs/options.md")
        return [path]
    return []


def refresh_validate_component() -> list[Path]:
    """Write ``components/validate/component.py`` from the parameter declarations when it differs
    (:mod:`rloo.pipeline.validate_component`); returns it when written."""
    from rloo.pipeline.validate_component import component_path, render

    path = component_path(repo_root())
    text = render()
    if not path.parent.is_dir() or (path.is_file() and path.read_text() == text):
        return []
    write_whole(path, text.encode(), "components/validate/component.py")
    return [path]


def write_whole(path: Path, data: bytes, what: str) -> None:
    """Write ``data`` to ``path`` through a temporary file beside it and a rename: readers see the old file
    or the new one, never a part. A place that cannot be written is one line (exit 2), with nothing left."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise UserError(
            f"{what} {path}: cannot write it ({e.strerror or e}); give a path you can write."
        ) from None


def load_yaml(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The documents of a compiled pipeline: the pipeline spec, then the platform (Kubernetes) spec."""
    import yaml

    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def parse_params(pairs: list[str], params_file: str | None = None) -> dict[str, Any]:
    """Pipeline parameters from a YAML file and ``key=value`` pairs (values parsed as YAML: ints, floats,
    dicts; the pairs win)."""
    import yaml

    params: dict[str, Any] = {}
    if params_file:
        p = Path(params_file)
        if not p.is_file():
            raise UserError(
                f"--params {params_file}: no such file; pass a YAML mapping of pipeline parameters."
            )
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" (line {mark.line + 1})" if mark is not None else ""
            raise UserError(f"--params {params_file}: not valid YAML{where}; fix the syntax.") from None
        if not isinstance(loaded, dict):
            raise UserError(f"--params {params_file}: expected a mapping of parameter names to values.")
        params.update(loaded)
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UserError(f"--param {pair!r}: expected key=value.")
        try:
            params[key.strip()] = yaml.safe_load(value) if value.strip() else ""
        except yaml.YAMLError:
            raise UserError(
                f"--param {pair!r}: the value is not valid YAML; quote it (key='...') or fix the syntax."
            ) from None
    return params
