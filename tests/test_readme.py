"""The README's commands and quoted output agree with the code, checked without running ``make demo``; the
README stays an overview, and the documents it points to hold, with links that resolve.

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
# The project's prose documents (the generated flag reference among them)
DOCS = [
    ROOT / "README.md",
    ROOT / "pipelines" / "README.md",
    ROOT / "helm" / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "examples").glob("*/README.md")),
]


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
    named = set()
    for path in DOCS:
        for group in re.findall(r"(?:'\.|rloo-kfp)\[([\w,]+)\]", path.read_text()):
            named |= set(group.split(","))
    assert "client" in named
    assert named <= extras


def test_the_readme_is_an_overview() -> None:
    """The README says what the project is and where the rest is; what grows (flags, cluster details, the
    behaviour of each stage) belongs in the documents it links to."""
    lines = README.count("\n")
    assert lines <= 300, (
        f"README.md has {lines} lines: move details to docs/ (the index is 'Where the rest is')"
    )
    index = _section("Where the rest is")
    for doc in sorted((ROOT / "docs").glob("*.md")):
        assert f"(docs/{doc.name})" in index, f"docs/{doc.name} is missing from the README's index"


@pytest.mark.parametrize(
    "argv",
    [
        argv
        for doc in DOCS[1:]
        if doc.name != "platform-walkthrough.md"
        for argv in rloo_commands(doc.read_text())
    ],
    ids=lambda argv: " ".join(argv[:2]),
)
def test_every_rloo_command_of_the_docs_is_accepted(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """The commands moved out of the README stay checked (docs/platform-walkthrough.md has its own test)."""
    check_rloo_command(argv, capsys)


_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    """The anchor GitHub gives a heading (gjtorikian/html-pipeline ``lib/html/pipeline/toc_filter.rb``:
    ``text.downcase.gsub(/[^\\p{Word}\\- ]/u, '').tr(' ', '-')``)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.DOTALL | re.MULTILINE)  # no '#' comments
    return {_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.MULTILINE)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc: Path) -> None:
    """A relative link names a file of the repository and, after '#', a heading of that file."""
    for target in _LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        resolved = (doc.parent / path).resolve() if path else doc
        assert resolved.exists(), f"{doc.relative_to(ROOT)}: {target}: no such file"
        if anchor:
            assert anchor in _anchors(resolved), f"{doc.relative_to(ROOT)}: {target}: no such heading"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_docs_describe_the_code_not_its_history(doc: Path) -> None:
    """No line names a tracker issue of this project ('#' or 'issue' with its number) or a round in which
    options came (an upstream issue, 'kubeflow/pipelines#9702', is a citation and stays)."""
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        where = f"{doc.relative_to(ROOT)}:{number}"
        assert not re.search(r"(?<![\w/.-])#\d+\b|\bissues? \d+", line, re.IGNORECASE), f"{where}: {line}"
        assert not re.search(r"\bround (?:one|two|three|\d+)\b|\brounds? of options", line, re.IGNORECASE), (
            f"{where}: {line}"
        )
