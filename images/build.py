"""Build (and push) the pipeline's images from images/<name>/Dockerfile with docker or podman.

Tags come from the one place the compiled pipeline reads them (``rloo.pipeline.images``: ``RLOO_IMAGE_REGISTRY``,
``RLOO_IMAGE_TAG``). Each image built is written to a record (``--record``, default ``build/images.json``): its
tag, or after ``--push`` its reference by the digest the registry gave, which ``rloo pipeline compile --images``
names in the compiled pipeline (``make pipeline-for-images``). ``--sbom DIR`` writes each image's CycloneDX SBOM
of its Python environment (``cyclonedx-py``, run inside the image). Behind a mirror or an intercepting proxy,
the environment passes through:

- ``PIP_INDEX_URL``, ``PIP_EXTRA_INDEX_URL``, ``PIP_FIND_LINKS``, ``PIP_TRUSTED_HOST``, ``TORCH_INDEX_URL``
  (empty: torch from the indexes above) and ``BASE_IMAGE_<NAME>`` become build arguments;
- ``RLOO_BUILD_CA`` (a CA bundle file) becomes the build secret ``pip_ca``, in no layer;
- ``RLOO_BUILD_OPTS`` (shell words) is added to every build, e.g. ``--network host`` or podman's
  ``-v /opt/wheels:/opt/wheels:ro`` for a local wheel directory named in ``PIP_FIND_LINKS``;
- ``RLOO_PUSH_OPTS`` (shell words) is added to every push, e.g. podman's ``--tls-verify=false`` or
  ``--compression-format zstd``.

    python images/build.py                   # all three, with docker if its daemon answers, else podman
    python images/build.py slim --push       # one image, then push it; build/images.json names its digest
    python images/build.py --ci-base         # the Debian stand-in base of images/ci (no registry needed)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from rloo.pipeline.images import IMAGE_EXTRAS, image  # noqa: E402

RECORD = ROOT / "build" / "images.json"
# the SBOM generator, installed into a throwaway directory of the image itself: its Python reads the metadata
CYCLONEDX = "cyclonedx-bom==7.5.0"
# flavours (rloo.pipeline.images.FLAVOURS): name -> (the image whose tag it shares, Dockerfile, tag suffix)
FLAVOURS = {"train-cpu": ("train", "images/train/cpu.Dockerfile", "-cpu")}
NAMES = [*IMAGE_EXTRAS, *FLAVOURS]  # what can be built
PIP_ARGS = ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_TRUSTED_HOST", "TORCH_INDEX_URL")
CI_DEBIAN = "localhost/debian:bookworm"
CI_BASE = "localhost/rloo-ci-base:bookworm"


def pick_builder(choice: str = "auto") -> str:
    """docker when its daemon answers, else podman; a one-line SystemExit when neither is there."""
    if choice != "auto":
        return choice
    if shutil.which("docker"):
        ok = subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0
        if ok:
            return "docker"
    if shutil.which("podman"):
        return "podman"
    raise SystemExit("images/build.py: no container builder: install docker (with its daemon) or podman.")


def reference(name: str) -> str:
    """The tag image or flavour ``name`` is built with (a flavour: its image's, with the suffix)."""
    if name in FLAVOURS:
        of, _, suffix = FLAVOURS[name]
        return image(of) + suffix
    return image(name)


def dockerfile(name: str) -> Path:
    return ROOT / FLAVOURS[name][1] if name in FLAVOURS else ROOT / "images" / name / "Dockerfile"


def base_image(name: str, env: dict[str, str]) -> str:
    """The image ``name`` is built FROM: ``BASE_IMAGE_<NAME>``, else its Dockerfile's ``ARG BASE_IMAGE=``."""
    override = env.get(f"BASE_IMAGE_{name.upper().replace('-', '_')}")
    if override:
        return override
    for line in dockerfile(name).read_text().splitlines():
        if line.startswith("ARG BASE_IMAGE="):
            return line.split("=", 1)[1].strip()
    return ""


def pull_base(builder: str, name: str, env: dict[str, str]) -> None:
    """Have the base image here before building on it: when it cannot be pulled, one line naming it and the
    ways out, exit 75 (a registry or proxy may come back), not the builder's pages and a traceback."""
    base = base_image(name, env)
    if not base or subprocess.run([builder, "image", "inspect", base], capture_output=True).returncode == 0:
        return
    pulled = subprocess.run([builder, "pull", base], capture_output=True, text=True)
    if pulled.returncode != 0:
        why = (pulled.stderr.strip().splitlines() or ["no output"])[-1][:300]
        var = f"BASE_IMAGE_{name.upper().replace('-', '_')}"
        print(
            f"images/build.py: cannot pull the base image {base} of {name} with {builder} ({why}): check that "
            f"its registry is reachable (behind a proxy: HTTPS_PROXY and NO_PROXY for {builder}), set {var} to "
            f"a mirror's copy, or, offline, load it first ({builder} load -i FILE.tar; images/README.md).",
            file=sys.stderr,
        )
        raise SystemExit(75)


def build_command(builder: str, name: str, env: dict[str, str]) -> list[str]:
    """The ``<builder> build`` command of image ``name``, with the environment's mirror settings."""
    cmd = [builder, "build", "-f", str(dockerfile(name)), "-t", reference(name)]
    for arg in PIP_ARGS:
        if arg in env:
            cmd += ["--build-arg", f"{arg}={env[arg]}"]
    base = env.get(f"BASE_IMAGE_{name.upper().replace('-', '_')}")
    if base:
        cmd += ["--build-arg", f"BASE_IMAGE={base}"]
    if env.get("RLOO_BUILD_CA"):
        cmd += ["--secret", f"id=pip_ca,src={env['RLOO_BUILD_CA']}"]
    cmd += shlex.split(env.get("RLOO_BUILD_OPTS", ""))
    return [*cmd, str(ROOT)]


def host_pip_settings(config_list: str) -> dict[str, str]:
    """Build settings from this machine's pip configuration (``pip config list``): its indexes, find-links
    and CA, with podman volumes for the ones that are local paths (a wheel directory, a file:// index)."""
    values: dict[str, str] = {}
    for line in config_list.splitlines():
        key, _, value = line.partition("=")
        values[key.rsplit(".", 1)[-1]] = value.strip().strip("'\"")
    out = {"TORCH_INDEX_URL": ""}  # torch from the indexes below, like this machine's own pip
    mounts: dict[str, None] = {}  # ordered, no repeats
    for key, arg in (("index-url", "PIP_INDEX_URL"), ("extra-index-url", "PIP_EXTRA_INDEX_URL"),
                     ("find-links", "PIP_FIND_LINKS"), ("trusted-host", "PIP_TRUSTED_HOST")):  # fmt: skip
        if values.get(key):
            out[arg] = values[key]
            for item in values[key].split():
                path = item.removeprefix("file://")
                if path.startswith("/") and Path(path).exists():
                    top = "/".join(path.split("/")[:3])  # /opt/pypi/simple -> /opt/pypi
                    mounts[f"{top}:{top}:ro"] = None
    if values.get("cert") and Path(values["cert"]).is_file():
        out["RLOO_BUILD_CA"] = values["cert"]
    if mounts:
        out["RLOO_BUILD_OPTS"] = shlex.join([word for m in mounts for word in ("-v", m)])
    return out


def push(builder: str, ref: str, env: dict[str, str]) -> str:
    """Push ``ref``; returns it by the digest the registry now serves it under (``repo@sha256:...``)."""
    opts = shlex.split(env.get("RLOO_PUSH_OPTS", ""))
    repo = ref.rsplit(":", 1)[0] if ":" in ref.rsplit("/", 1)[-1] else ref
    if builder == "podman":
        with tempfile.TemporaryDirectory(prefix="rloo-push-") as tmp:
            digest_file = Path(tmp) / "digest"
            subprocess.run([builder, "push", *opts, "--digestfile", str(digest_file), ref], check=True)
            digest = digest_file.read_text().strip()
    else:
        subprocess.run([builder, "push", *opts, ref], check=True)
        listed = subprocess.run(
            [builder, "image", "inspect", "--format", "{{json .RepoDigests}}", ref],
            check=True,
            capture_output=True,
            text=True,
        )
        mine = [d for d in json.loads(listed.stdout) or [] if d.rsplit("@", 1)[0] == repo]
        if not mine:
            raise SystemExit(f"images/build.py: {builder} pushed {ref} but names no digest for {repo}.")
        digest = mine[0].rsplit("@", 1)[1]
    if not digest.startswith("sha256:"):
        raise SystemExit(f"images/build.py: the registry gave {ref} the digest {digest!r}, not sha256:...")
    return f"{repo}@{digest}"


def write_record(path: Path, built: dict[str, str]) -> dict[str, str]:
    """Add ``built`` (name -> reference) to the record at ``path``; what it already names of other images
    stays (``make images IMAGES=slim`` after a whole build keeps the others)."""
    record = json.loads(path.read_text()) if path.is_file() else {}
    record.update(built)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return record


def _run_options(env: dict[str, str]) -> list[str]:
    """What a container started during the build needs of the build's settings to reach the package index:
    pip's variables, the CA (mounted, as the build's secret is) and the volumes and network of
    RLOO_BUILD_OPTS."""
    opts = [f"--env={arg}={env[arg]}" for arg in PIP_ARGS if arg.startswith("PIP_") and env.get(arg)]
    if env.get("RLOO_BUILD_CA"):
        opts += ["-v", f"{env['RLOO_BUILD_CA']}:/run/secrets/pip_ca:ro", "--env=PIP_CERT=/run/secrets/pip_ca"]
    words = shlex.split(env.get("RLOO_BUILD_OPTS", ""))
    for i, word in enumerate(words[:-1]):
        if word in ("-v", "--volume", "--network"):
            opts += [word, words[i + 1]]
    opts += [w for w in words if w.startswith(("--volume=", "--network="))]
    return opts


def sbom_command(builder: str, ref: str, env: dict[str, str]) -> list[str]:
    """The command that prints image ``ref``'s CycloneDX SBOM (JSON): cyclonedx-py, installed into /tmp of a
    throwaway container with the image's own pip, reads the environment of the image's ``python3`` (the
    generator's directory is not on that interpreter's path, so it does not list itself)."""
    script = (
        f"python3 -m pip install -q --disable-pip-version-check --target /tmp/sbom '{CYCLONEDX}' >&2 && "
        'python3 -c \'import runpy, sys; sys.path.insert(0, "/tmp/sbom"); '
        'sys.argv = ["cyclonedx-py", *sys.argv[1:]]; '
        'runpy.run_module("cyclonedx_py", run_name="__main__")\' '
        'environment --of JSON --output-reproducible "$(command -v python3)"'
    )
    return [builder, "run", "--rm", *_run_options(env), "--entrypoint", "sh", ref, "-c", script]


def sbom(builder: str, ref: str, env: dict[str, str], out: Path, *, published: str | None = None) -> Path:
    """Write image ``ref``'s SBOM to ``out`` and return it; its property ``rloo:image`` names the image as
    ``published`` (by digest after a push), else ``ref``."""
    proc = subprocess.run(sbom_command(builder, ref, env), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"images/build.py: the SBOM of {ref} failed: {proc.stderr.strip()[-2000:]}")
    document = json.loads(proc.stdout)
    document.setdefault("metadata", {}).setdefault("properties", []).append(
        {"name": "rloo:image", "value": published or ref}
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=2) + "\n")
    return out


def ci_base(builder: str) -> None:
    """A Debian root filesystem (debootstrap) imported as an image, and images/ci/base.Dockerfile on it."""
    present = subprocess.run([builder, "image", "exists", CI_DEBIAN], capture_output=True).returncode == 0
    if not present:
        with tempfile.TemporaryDirectory(prefix="rloo-debian-") as root:
            subprocess.run(
                ["debootstrap", "--variant=minbase", "bookworm", root], check=True, capture_output=True
            )
            tar = subprocess.Popen(["tar", "-C", root, "-c", "."], stdout=subprocess.PIPE)
            subprocess.run(
                [builder, "import", "-", CI_DEBIAN], stdin=tar.stdout, check=True, capture_output=True
            )
            tar.wait()
    cmd = [builder, "build", "-f", str(ROOT / "images" / "ci" / "base.Dockerfile"), "-t", CI_BASE]
    subprocess.run([*cmd, str(ROOT / "images" / "ci")], check=True)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "names", nargs="*", help=f"images to build (default: {', '.join(IMAGE_EXTRAS)}): {', '.join(NAMES)}"
    )
    parser.add_argument("--builder", default="auto", choices=("auto", "docker", "podman"))
    parser.add_argument("--push", action="store_true", help="push each image after building it")
    parser.add_argument("--ci-base", action="store_true", help="build the Debian stand-in base and stop")
    parser.add_argument(
        "--host-pip", action="store_true", help="build with this machine's pip configuration (podman: mounts)"
    )
    parser.add_argument(
        "--record",
        type=Path,
        default=RECORD,
        help="JSON file of the references built (by digest after --push), for rloo pipeline compile --images "
        "(default: build/images.json)",
    )
    parser.add_argument(
        "--sbom", type=Path, default=None, metavar="DIR", help="write DIR/<name>.cdx.json, each image's SBOM"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    builder = pick_builder(args.builder)
    if args.ci_base:
        ci_base(builder)
        print(CI_BASE)
        return 0
    unknown = [n for n in args.names if n not in NAMES]
    if unknown:
        parser.error(f"unknown image(s) {', '.join(unknown)}; choose from {', '.join(NAMES)}")
    env = dict(os.environ)
    if args.host_pip:
        listed = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
        )
        env = {**host_pip_settings(listed.stdout), **env}  # what the environment sets wins
    for name in args.names or list(IMAGE_EXTRAS):
        start = time.monotonic()
        pull_base(builder, name, env)
        subprocess.run(build_command(builder, name, env), check=True)
        print(f"built {reference(name)} with {builder} in {time.monotonic() - start:.0f} s", flush=True)
        ref = push(builder, reference(name), env) if args.push else reference(name)
        if args.push:
            print(f"pushed {ref}", flush=True)
        if args.sbom:
            out = sbom(builder, reference(name), env, args.sbom / f"{name}.cdx.json", published=ref)
            print(f"SBOM of {ref}: {out}", flush=True)
        write_record(args.record, {name: ref})
    print(
        f"recorded in {args.record}: rloo pipeline compile --images {args.record} --output PATH", flush=True
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
