"""The validate component is written from the parameter declarations (``rloo pipeline compile``), so a
parameter declared on a config field reaches the pipeline's first step without anyone listing it by hand.

KFP builds a component's inputs from its Python function's signature and runs the function's own source
(kubeflow/pipelines sdk/python/kfp/dsl/component_factory.py: extract_component_interface reads the
signature, _get_function_source_definition the source): the signature has to be the parameter list, so it
is generated, and the committed file must be what the generator writes now."""

from __future__ import annotations

from pathlib import Path

import pytest

from rloo.pipeline.compile import repo_root
from rloo.pipeline.validate_component import component_path, render


def test_the_committed_validate_component_is_generated() -> None:
    """A field declared with ``pipeline=`` and no ``rloo pipeline compile`` after it fails here."""
    committed = component_path(repo_root()).read_text()
    assert committed == render(), "run: rloo pipeline compile"


def test_the_generated_signature_is_every_parameter() -> None:
    from rloo.stages.plan import pipeline_fields

    source = render()
    for p in pipeline_fields():
        assert f"\n    {p.name}: {p.type.__name__},\n" in source
    assert source.count(": Output[") == 1  # the summary


def test_compile_writes_a_stale_component(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``rloo pipeline compile`` (to the committed files) rewrites a validate component that lags the
    declarations, and leaves a current one alone."""
    from rloo.pipeline.compile import refresh_validate_component

    (tmp_path / "pipelines").mkdir()
    (tmp_path / "pipelines" / "rloo_pipeline.py").write_text("")
    stale = component_path(tmp_path)
    stale.parent.mkdir(parents=True)
    stale.write_text(render().replace("    model: str,\n", ""))
    monkeypatch.setenv("RLOO_REPO_ROOT", str(tmp_path))
    assert refresh_validate_component() == [stale]
    assert stale.read_text() == render()
    assert refresh_validate_component() == []
