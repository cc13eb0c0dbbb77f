"""The README's commands and quoted output agree with the code, checked without running ``make demo``.

``make`` installs the ``rloo`` console script into ``.venv/bin``, which is on ``PATH`` only once the venv's
activate script put it there (python/cpython ``Lib/venv/scripts/common/activate``:
``PATH="$VIRTUAL_ENV/bin:$PATH"``), so a bare ``rloo`` works only after ``source .venv/bin/activate``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.fixtures.doc_commands import SHELLS, check_rloo_command, code_blocks, rloo_commands, shell_commands

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _section(title: str) -> str:
    """The text of the README's ``## title`` section."""
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end != -1 else len(README)]


DEMO = _section("The two commands")


def test_bare_rloo_comes_after_the_venv_is_activated() -> None:
    """A command the README runs on the demo's files (after ``make demo``) calls ``.venv/bin/rloo``; a bare
    ``rloo`` appears only after the README said to activate the venv."""
    activate = README.index("source\n.venv/bin/activate") if "source\n.venv/bin/activate" in README else -1
    activate = max(activate, README.find("source .venv/bin/activate"))
    assert activate != -1, "the README never says how to get rloo on PATH"
    for block in code_blocks(README):
        if block.lang not in SHELLS:
            continue
        for words in shell_commands(block.body):
            if words[0] == "rloo":
                assert block.offset > activate, f"'{' '.join(words)}' comes before the venv is activated"
                assert not any("rloo-local" in w for w in words), (
                    f"'{' '.join(words)}' runs on make demo's files: call .venv/bin/rloo, as make does"
                )


def test_make_demo_is_the_command_the_readme_says() -> None:
    recipe = re.search(r"^demo:.*\n\t(.+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert recipe is not None
    command = recipe[1].replace("$(BIN)", ".venv/bin")
    assert f"`make\ndemo` is `{command}`" in DEMO or f"`make demo` is `{command}`" in DEMO


@pytest.mark.parametrize("argv", rloo_commands(README), ids=lambda argv: " ".join(argv[:2]))
def test_every_rloo_command_of_the_readme_is_accepted(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    check_rloo_command(argv, capsys)


def _printed_templates() -> list[re.Pattern[str]]:
    """What a local run prints, as patterns: every f-string and string of the modules that print it, each
    ``{...}`` standing for any text."""
    patterns = []
    for module in ("local.py", "console.py"):
        tree = ast.parse((ROOT / "src" / "rloo" / "pipeline" / module).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr):
                parts = [re.escape(v.value) if isinstance(v, ast.Constant) else ".+" for v in node.values]
                patterns.append(re.compile("".join(parts)))
    return patterns


def _quoted_output() -> list[str]:
    (block,) = [b for b in code_blocks(DEMO) if b.lang == "" and "succeeded in" in b.body]
    return block.body.splitlines()


def test_the_quoted_summary_is_what_a_local_run_prints() -> None:
    """Each line of the README's sample output is one the code prints (values differ: ``<...>`` in the
    README), and the lines that say where the results are are all there."""
    templates = _printed_templates()
    lines = _quoted_output()
    for line in lines:
        assert any(t.fullmatch(line) for t in templates), f"the code prints no line like {line!r}"
    labels = {line.split(":")[0].strip() for line in lines if ":" in line}
    assert {"trained model", "evaluation", "eval results", "push decision", "MLflow UI"} <= labels


def test_the_demo_section_quotes_no_figures_of_a_run() -> None:
    """Win rates, intervals, rewards and timings move with every release of torch and transformers: the README
    shows where they are, not what they were once. The settings it quotes are the code's."""
    from rloo.demo.toy import TOY_UPDATES

    figures = re.findall(r"(?<![\w.=])[-+−]?\d+\.\d+(?![\d.])", DEMO)
    assert figures == []
    assert re.findall(r"\b\d+s\b", "\n".join(_quoted_output())) == []
    assert [int(n) for n in re.findall(r"demo's (\d+) updates", DEMO)] == [TOY_UPDATES]


def test_the_throughput_ratios_are_the_benchmark_results() -> None:
    """The ratios the introduction quotes are rows of benchmarks/RESULTS.md (rounded)."""
    intro = README[: README.index("\n## ")]
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    ratios = re.findall(r"(\d+\.\d)x", intro)
    assert ratios
    for ratio in ratios:
        assert re.search(rf"\b{re.escape(ratio)}\dx", results), f"{ratio}x is in no row of RESULTS.md"


def test_every_extra_the_docs_install_exists() -> None:
    """``pip install '.[extra,...]'`` and ``rloo-kfp[extra]`` in the README and docs name the project's extras."""
    import tomllib

    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    docs = [ROOT / "README.md", ROOT / "helm" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    named = set()
    for path in docs:
        for group in re.findall(r"(?:'\.|rloo-kfp)\[([\w,]+)\]", path.read_text()):
            named |= set(group.split(","))
    assert "client" in named
    assert named <= extras
