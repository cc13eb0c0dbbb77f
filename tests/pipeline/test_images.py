"""images/: every image the pipeline references is built here, installs its components' extras, runs as a
non-root user, pins its base and carries no secrets."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rloo.parsing import hf as parsing_hf
from rloo.pipeline.images import DEFAULT_REGISTRY, DEFAULT_TAG, IMAGE_EXTRAS, image

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "images"


def _dockerfile(name: str) -> str:
    """The Dockerfile without its comment lines (comments may mention extras or secrets by name)."""
    lines = (IMAGES / name / "Dockerfile").read_text().splitlines()
    return "\n".join(line for line in lines if not line.lstrip().startswith("#"))


def test_images_and_dockerfiles_match_both_ways() -> None:
    assert {p.parent.name for p in IMAGES.glob("*/Dockerfile")} == set(IMAGE_EXTRAS)


def test_every_image_in_the_compiled_pipeline_has_a_dockerfile() -> None:
    yaml = (ROOT / "pipelines" / "rloo_pipeline.yaml").read_text()
    # container images, and image names passed as constants (the multi-node job's pods)
    used = set(re.findall(r"^\s+image: (\S+)$", yaml, flags=re.M))
    used |= set(re.findall(r"^\s+constant: (\S+/rloo-\w+:\S+)$", yaml, flags=re.M))
    assert used, "no images found in the compiled pipeline"
    names = {
        re.fullmatch(rf"{re.escape(DEFAULT_REGISTRY)}/rloo-(\w+):{re.escape(DEFAULT_TAG)}", u)[1]
        for u in used
    }  # type: ignore[index]
    assert names == set(IMAGE_EXTRAS)
    assert all((IMAGES / n / "Dockerfile").is_file() for n in names)


@pytest.mark.parametrize("name", sorted(IMAGE_EXTRAS))
def test_dockerfile_installs_its_extras(name: str) -> None:
    text = _dockerfile(name)
    installs = re.findall(r"'\.\[([a-z,]+)\]'", text)
    assert len(installs) == 1, f"{name}: expected one '.[extras]' install"
    assert set(installs[0].split(",")) >= set(IMAGE_EXTRAS[name])
    assert "-c " in text and "constraints.txt" in text, "installs must use the pinned constraints"


@pytest.mark.parametrize("name", sorted(IMAGE_EXTRAS))
def test_dockerfile_hygiene(name: str) -> None:
    text = _dockerfile(name)
    base = re.search(r"ARG BASE_IMAGE=(\S+)", text)
    assert base and ":" in base[1] and not base[1].endswith(":latest"), "pin the base image"
    users = re.findall(r"^USER (\S+)", text, flags=re.M)
    assert users and users[-1] not in ("root", "0"), "the image must end as a non-root user"
    # build secrets (mounted for one RUN, in no layer) are how a CA reaches the build: not a baked secret
    baked = re.sub(r"--mount=type=secret,id=\w+|/run/secrets/\w+", "", text)
    for word in ("TOKEN=", "SECRET", "PASSWORD", "AWS_ACCESS_KEY_ID"):
        assert word not in baked.upper(), f"{name}: looks like a secret ({word})"


def test_components_use_the_images_their_work_needs() -> None:
    """The train step needs the train extra, evaluation the eval extra; the rest only tracking."""
    assert "train" in IMAGE_EXTRAS["train"] and "eval" in IMAGE_EXTRAS["eval"]
    assert "train" not in IMAGE_EXTRAS["slim"] and "eval" not in IMAGE_EXTRAS["slim"]
    assert all("kfp" in extras for extras in IMAGE_EXTRAS.values())  # install_kfp_package=False
    assert "deepspeed" in _dockerfile("train") and "vllm" in _dockerfile("eval")


def test_image_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLOO_IMAGE_REGISTRY", "my.reg/x/")
    monkeypatch.setenv("RLOO_IMAGE_TAG", "dev")
    assert image("slim") == "my.reg/x/rloo-slim:dev"
    monkeypatch.setenv("RLOO_IMAGE_TRAIN", "other/train:1")
    assert image("train") == "other/train:1"
    with pytest.raises(KeyError):
        image("gpu")


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"RLOO_IMAGE_TAG": "latest"}, "RLOO_IMAGE_TAG"),
        ({"RLOO_IMAGE_TRAIN": "reg/rloo-train:latest"}, "RLOO_IMAGE_TRAIN"),
        ({"RLOO_IMAGE_TRAIN": "reg/rloo-train"}, "RLOO_IMAGE_TRAIN"),
    ],
)
def test_a_moving_tag_is_refused_as_the_chart_refuses_it(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], names: str
) -> None:
    """helm/templates/_helpers.tpl refuses an image tagged latest (or untagged, which Kubernetes pulls as
    latest: kubernetes pkg/apis/core/v1/defaults.go); a pipeline compiled with one would run whatever the
    registry holds that day, so the compile refuses it too, naming the variable."""
    from rloo.errors import UserError

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(UserError, match=names):
        image("train")


def test_the_slim_image_can_parse_configs() -> None:
    """The validate step (slim image) parses the training config with HfArgumentParser: transformers must come
    with the core dependencies, which every image installs."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(re.match(r"transformers\b", d) for d in project["dependencies"])
    assert "from transformers import HfArgumentParser" in Path(parsing_hf.__file__).read_text()


DIGEST = "sha256:" + "ab" * 32


def _record(tmp_path: Path, content: object) -> Path:
    import json

    path = tmp_path / "images.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def test_a_flavour_in_the_record_serves_its_images_unless_they_are_named() -> None:
    from rloo.pipeline.images import FLAVOURS, read_record

    assert FLAVOURS["train-cpu"] == ("train", "eval")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        slim, cpu = f"reg:5000/ml/rloo-slim@{DIGEST}", f"reg:5000/ml/rloo-train@{DIGEST}"
        assert read_record(_record(Path(tmp), {"slim": slim, "train-cpu": cpu})) == {
            "slim": slim,
            "train": cpu,
            "eval": cpu,
        }
        gpu = "reg/ml/rloo-train:1.0"
        chosen = read_record(_record(Path(tmp), {"train": gpu, "train-cpu": cpu}))
        assert chosen == {"train": gpu, "eval": cpu}  # slim: not recorded, keeps its usual reference


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (None, "no such file; run 'make images'"),
        ("{not json", "not JSON"),
        ([], "expected a JSON mapping"),
        ({"gpu": "reg/x:1"}, "unknown image 'gpu'; the names are train, eval, slim, train-cpu"),
        ({"slim": "Reg/UPPER:1"}, "is not an image reference"),
        ({"slim": "reg/x@sha256:123"}, "is not an image reference"),
        ({"slim": 3}, "is not an image reference"),
    ],
)
def test_a_wrong_record_is_one_line(tmp_path: Path, content: object, says: str) -> None:
    from rloo.errors import UserError
    from rloo.pipeline.images import read_record

    path = tmp_path / "missing.json" if content is None else _record(tmp_path, content)
    with pytest.raises(UserError, match=re.escape(says)) as e:
        read_record(path)
    assert "\n" not in str(e.value)


def test_compile_with_a_record_names_its_images_everywhere(tmp_path: Path) -> None:
    """``rloo pipeline compile --images``: every step's image and the multi-node job's image are the record's
    (a fresh process, as make pipeline-for-images runs it: the components take their image on import)."""
    import os
    import subprocess
    import sys

    slim, train, evals = (
        f"registry.corp:5000/ml/rloo-{n}@sha256:{c * 64}"
        for n, c in zip(("slim", "train", "eval"), "123", strict=True)
    )
    record = _record(tmp_path, {"slim": slim, "train": train, "eval": evals})
    out = tmp_path / "pinned.yaml"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLOO_IMAGE_")}
    cmd = [
        sys.executable,
        "-m",
        "rloo.cli",
        "pipeline",
        "compile",
        "--images",
        str(record),
        "--output",
        str(out),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(out)]
    assert f"rloo pipeline: note: train image: {train}\n" in proc.stderr
    text = out.read_text()
    used = set(re.findall(r"^\s+image: (\S+)$", text, flags=re.M))
    assert used == {slim, train, evals}
    assert re.search(rf"^\s+constant: {re.escape(train)}$", text, flags=re.M)  # the TrainJob's pods
    assert DEFAULT_REGISTRY not in text


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["compile", "--images", "{record}"], "give --output PATH"),
        (["run", "--local", "--images", "{record}"], "--images names the images of --containers"),
        (["compile", "--images", "{missing}", "--output", "x.yaml"], "no such file"),
    ],
)
def test_images_flag_misuse_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    from rloo.cli.pipeline_cmd import main

    record = _record(tmp_path, {"slim": f"reg/rloo-slim@{DIGEST}"})
    argv = [a.format(record=record, missing=tmp_path / "nope.json") for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1, err


def test_the_images_tag_is_the_packages_version() -> None:
    """The pipeline names images tagged with the package's version (pyproject.toml, the version pip records
    and ``rloo --version`` prints): a pipeline compiled from this code runs only in images built from it."""
    from importlib.metadata import version
    from pathlib import Path

    import rloo

    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    declared = re.search(r'^version = "([^"]+)"$', pyproject, re.MULTILINE)
    assert declared and declared[1] == rloo.__version__ == DEFAULT_TAG == version("rloo-kfp")
