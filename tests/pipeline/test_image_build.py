"""images/build.py: the build commands it gives docker or podman, and the Dockerfiles taking what it passes."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from rloo.pipeline.images import IMAGE_EXTRAS

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("images_build", ROOT / "images" / "build.py")
assert _spec and _spec.loader
build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build)


def test_tags_follow_the_variables_the_compiled_pipeline_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLOO_IMAGE_REGISTRY", "registry.corp/ml")
    monkeypatch.setenv("RLOO_IMAGE_TAG", "1.2.3")
    cmd = build.build_command("podman", "slim", {})
    assert cmd[:2] == ["podman", "build"] and cmd[cmd.index("-t") + 1] == "registry.corp/ml/rloo-slim:1.2.3"
    assert cmd[cmd.index("-f") + 1] == str(ROOT / "images" / "slim" / "Dockerfile") and cmd[-1] == str(ROOT)


def test_mirror_settings_pass_through_as_build_args_and_the_ca_as_a_secret() -> None:
    env = {
        "PIP_INDEX_URL": "https://mirror.corp/simple",
        "TORCH_INDEX_URL": "",
        "BASE_IMAGE_TRAIN": "mirror.corp/pytorch/pytorch:2.13.0",
        "RLOO_BUILD_CA": "/etc/corp-ca.pem",
        "RLOO_BUILD_OPTS": "--network host -v '/opt/wheels:/opt/wheels:ro'",
        "HOME": "/root",  # not a build setting: not passed
    }
    cmd = build.build_command("docker", "train", env)
    args = [cmd[i + 1] for i, word in enumerate(cmd) if word == "--build-arg"]
    assert args == [
        "PIP_INDEX_URL=https://mirror.corp/simple",
        "TORCH_INDEX_URL=",  # set but empty means something (torch from the indexes above): passed
        "BASE_IMAGE=mirror.corp/pytorch/pytorch:2.13.0",
    ]
    assert cmd[cmd.index("--secret") + 1] == "id=pip_ca,src=/etc/corp-ca.pem"
    assert cmd[-5:] == ["--network", "host", "-v", "/opt/wheels:/opt/wheels:ro", str(ROOT)]
    assert "HOME" not in " ".join(cmd)


@pytest.mark.parametrize("name", [*sorted(IMAGE_EXTRAS), *build.FLAVOURS])
def test_every_dockerfile_takes_the_mirror_settings(name: str) -> None:
    text = build.dockerfile(name).read_text()
    declared = set(re.findall(r"^ARG (\w+)", text, flags=re.M))
    # one ARG per line: older builders (podman 4's buildah) read only the first name of a multi-name ARG
    assert not re.search(r"^ARG \w+(=\S*)? \w", text, flags=re.M)
    assert {"PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_TRUSTED_HOST"} <= declared
    installs = [line for line in text.splitlines() if "pip install" in line]
    assert installs
    # every RUN that installs mounts the CA secret and uses it when it is there
    for run in re.split(r"\n(?=RUN )", text):
        if "pip install" in run:
            assert "--mount=type=secret,id=pip_ca" in run and "PIP_CERT=/run/secrets/pip_ca" in run, run


def test_no_builder_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit, match="no container builder"):
        build.pick_builder()
    assert build.pick_builder("podman") == "podman"


def test_the_cpu_train_flavour_serves_the_train_and_eval_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLOO_IMAGE_REGISTRY", "localhost/rloo")
    monkeypatch.setenv("RLOO_IMAGE_TAG", "dev")
    assert build.reference("train-cpu") == "localhost/rloo/rloo-train:dev-cpu"
    cmd = build.build_command("podman", "train-cpu", {"BASE_IMAGE_TRAIN_CPU": "localhost/base:1"})
    assert cmd[cmd.index("-f") + 1] == str(ROOT / "images" / "train" / "cpu.Dockerfile")
    assert "BASE_IMAGE=localhost/base:1" in cmd
    lines = build.dockerfile("train-cpu").read_text().splitlines()
    text = "\n".join(line for line in lines if not line.lstrip().startswith("#"))
    (extras,) = re.findall(r"'\.\[([a-z,]+)\]'", text)
    assert set(extras.split(",")) >= (set(IMAGE_EXTRAS["train"]) | set(IMAGE_EXTRAS["eval"])) - {"vllm"}
    assert "vllm" not in extras and re.findall(r"^USER (\S+)", text, flags=re.M)[-1] == "1000"


def test_flavours_are_the_ones_the_pipeline_knows() -> None:
    from rloo.pipeline.images import FLAVOURS

    assert set(build.FLAVOURS) == set(FLAVOURS)
    assert all(build.FLAVOURS[name][0] in FLAVOURS[name] for name in FLAVOURS)


def test_the_record_keeps_what_other_builds_wrote(tmp_path: Path) -> None:
    import json

    record = tmp_path / "build" / "images.json"
    build.write_record(record, {"slim": "reg/rloo-slim@sha256:" + "1" * 64})
    build.write_record(record, {"train-cpu": "reg/rloo-train:dev-cpu"})
    assert json.loads(record.read_text()) == {
        "slim": "reg/rloo-slim@sha256:" + "1" * 64,
        "train-cpu": "reg/rloo-train:dev-cpu",
    }
    # and what it writes is what rloo pipeline compile --images reads
    from rloo.pipeline.images import read_record

    assert read_record(record)["eval"] == "reg/rloo-train:dev-cpu"


def test_the_sbom_runs_in_the_image_with_the_build_s_way_to_the_index() -> None:
    env = {
        "PIP_INDEX_URL": "https://mirror.corp/simple",
        "TORCH_INDEX_URL": "",
        "RLOO_BUILD_CA": "/etc/corp-ca.pem",
        "RLOO_BUILD_OPTS": "--network host -v /opt/wheels:/opt/wheels:ro --no-cache",
    }
    cmd = build.sbom_command("podman", "reg/rloo-slim:1", env)
    assert cmd[:3] == ["podman", "run", "--rm"]
    assert "--env=PIP_INDEX_URL=https://mirror.corp/simple" in cmd and not any("TORCH" in w for w in cmd)
    assert cmd[cmd.index("/etc/corp-ca.pem:/run/secrets/pip_ca:ro") - 1] == "-v"
    assert "--env=PIP_CERT=/run/secrets/pip_ca" in cmd
    assert cmd[cmd.index("--network") + 1] == "host" and "/opt/wheels:/opt/wheels:ro" in cmd
    assert "--no-cache" not in cmd  # a build flag, not one for run
    assert cmd[cmd.index("--entrypoint") + 1 :][:2] == ["sh", "reg/rloo-slim:1"]
    assert build.CYCLONEDX in cmd[-1] and "environment" in cmd[-1]


def _fake_builder(tmp_path: Path, *, has_image: bool, pull_error: str = "") -> Path:
    """A stand-in for podman/docker answering ``image inspect`` and ``pull`` as they do (exit 125 and the
    reason on stderr when the registry cannot be reached) and logging its calls."""
    script = tmp_path / "podman"
    log = tmp_path / "calls"
    pull = f'echo "{pull_error}" >&2; exit 125' if pull_error else "exit 0"
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> {log}\n'
        f'case "$1 $2" in "image inspect") exit {0 if has_image else 125};; esac\n'
        f'case "$1" in pull) {pull};; esac\n'
    )
    script.chmod(0o755)
    return script


def test_a_base_that_cannot_be_pulled_is_one_line_and_exit_75(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """podman/docker print pages and exit 125 when the registry is out of reach; the build says which base
    could not be pulled and the ways out (proxy, mirror, an offline load) in one line, exit 75."""
    reason = "Error: pinging container registry registry-1.docker.io: dial tcp: no such host"
    fake = _fake_builder(tmp_path, has_image=False, pull_error=reason)
    with pytest.raises(SystemExit) as exit_info:
        build.pull_base(str(fake), "slim", {})
    assert exit_info.value.code == 75
    (line,) = capsys.readouterr().err.strip().splitlines()
    base = build.base_image("slim", {})
    assert base and base in line and reason in line and "BASE_IMAGE_SLIM" in line and "load -i" in line


def test_a_base_already_here_or_pulled_builds_on(tmp_path: Path) -> None:
    here = _fake_builder(tmp_path, has_image=True)
    build.pull_base(str(here), "train-cpu", {"BASE_IMAGE_TRAIN_CPU": "localhost/ci-base:1"})
    assert (tmp_path / "calls").read_text().split("\n")[0] == "image inspect localhost/ci-base:1"
    (tmp_path / "calls").unlink()
    pulled = _fake_builder(tmp_path, has_image=False)
    build.pull_base(str(pulled), "eval", {})
    assert (tmp_path / "calls").read_text().splitlines()[-1] == f"pull {build.base_image('eval', {})}"
