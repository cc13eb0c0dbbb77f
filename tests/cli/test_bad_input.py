"""Bad input to the real ``rloo train`` entry point (a subprocess): one line on stderr, exit 2, nothing written.

Every case runs ``python -m rloo.cli train ...`` on the tiny local setup with settings that make one
update take well under a second. The runs start together (session fixture) and each test waits for its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rloo.demo.tiny import TinySetup
from tests.fixtures import recipes, zygote
from tests.fixtures.weights import corrupt_copy

HERE = Path(__file__).resolve().parent  # holds bad_rewards.py, importable by the subprocess
TINY_RUN = [
    "--per_device_train_batch_size", "4",
    "--rloo_k", "2",
    "--response_length", "4",
    "--max_steps", "1",
    "--num_sample_generations", "0",
    "--disable_tqdm",
]  # fmt: skip


@dataclass(frozen=True)
class Case:
    extra: Callable[[Path], list[str]]  # flags appended to the base command line (later flags win)
    expect: tuple[str, ...]  # substrings of the error line: the offending flag/thing and the fix


CASES: dict[str, Case] = {
    "unknown_flag": Case(lambda r: ["--no_such_flag", "3"], ("unknown flag(s) --no_such_flag", "--help")),
    "wrong_type": Case(lambda r: ["--learning_rate", "fast"], ("--learning_rate expects a number", "'fast'")),
    "rloo_k_below_2": Case(lambda r: ["--rloo_k", "1"], ("--rloo_k must be >= 2", "got 1")),
    "indivisible_batch": Case(
        lambda r: ["--per_device_train_batch_size", "3"],
        ("per_device_train_batch_size (3)", "not divisible by rloo_k (2)", "multiple of rloo_k"),
    ),
    "missing_prompt_column": Case(
        lambda r: ["--dataset_name", str(r / "no_prompt_ds")],
        ("no 'prompt' column", "question", "rename"),
    ),
    "empty_dataset": Case(
        lambda r: ["--dataset_name", str(r / "empty_ds")], ("split 'train' is empty", "at least one prompt")
    ),
    "missing_model_dir": Case(
        lambda r: ["--model_name_or_path", str(r / "no_such_model")],
        ("--model_name_or_path", "no_such_model: no such directory", "pass a model directory"),
    ),
    # the model path is checked before the datasets load: a Hub-looking dataset name is never fetched
    # (here it would cost ~26 s of retries before any error) when the model path is already wrong
    "missing_model_dir_before_dataset": Case(
        lambda r: [
            "--model_name_or_path",
            str(r / "no_such_model"),
            "--dataset_name",
            "no-such-org/no-such-ds",
        ],
        ("--model_name_or_path", "no_such_model: no such directory", "pass a model directory"),
    ),
    "corrupt_model_dir": Case(
        lambda r: ["--model_name_or_path", str(r / "corrupt_model")],
        ("--model_name_or_path", "corrupt_model: cannot load it", "save_pretrained"),
    ),
    "non_finite_policy": Case(  # a safetensors file that parses, its data bytes all 0x7f
        lambda r: ["--model_name_or_path", str(r / "nonfinite_policy")],
        ("--model_name_or_path", "nonfinite_policy: tensor '", "magnitude 3.4e+38", "corrupt"),
    ),
    "non_finite_reward_model": Case(
        lambda r: ["--reward_model_path", str(r / "nonfinite_rm")],
        ("--reward_model_path", "nonfinite_rm: tensor '", "magnitude 3.4e+38", "corrupt"),
    ),
    "response_fills_the_model": Case(  # the tiny policy has 512 positions
        lambda r: ["--response_length", "512"],
        ("--response_length 512 leaves no room for a prompt", "512 positions", "below 512"),
    ),
    "reward_func_unresolved": Case(
        lambda r: ["--reward_funcs", "no_such_module_xyz:reward"],
        ("--reward_funcs no_such_module_xyz:reward", "cannot import module", "PYTHONPATH"),
    ),
    "reward_func_wrong_length": Case(
        lambda r: ["--reward_funcs", "bad_rewards:wrong_length"],
        ("--reward_funcs bad_rewards:wrong_length", "returned 5 values for 4 completions", "exactly one"),
    ),
    "reward_func_wrong_type": Case(
        lambda r: ["--reward_funcs", "bad_rewards:wrong_type"],
        ("--reward_funcs bad_rewards:wrong_type", "returned a str", "float or None"),
    ),
    "reward_func_nan": Case(  # also: an existing output_dir is left exactly as it was
        lambda r: ["--reward_funcs", "bad_rewards:nan_reward", "--output_dir", str(r / "existing_out")],
        ("--reward_funcs bad_rewards:nan_reward", "non-finite reward (nan)", "None when"),
    ),
    "reward_func_raises": Case(
        lambda r: ["--reward_funcs", "bad_rewards:raising"],
        ("--reward_funcs bad_rewards:raising raised KeyError", "no_such_column", "bad_rewards.py"),
    ),
}


def _snapshot(root: Path) -> dict[str, tuple[bytes, int] | None]:
    return {
        str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns) if p.is_file() else None
        for p in sorted(root.rglob("*"))
    }


def _prepare(root: Path, setup: TinySetup) -> None:
    """The broken inputs: datasets without prompts, a corrupt checkpoint, an output_dir with a file."""
    data = root / "no_prompt_ds" / "data"
    data.mkdir(parents=True)
    pq.write_table(
        pa.table({"question": ["Write about the sea:"] * 4}), data / "train-00000-of-00001.parquet"
    )
    data = root / "empty_ds" / "data"
    data.mkdir(parents=True)
    empty = pa.table({"prompt": pa.array([], type=pa.string())})
    pq.write_table(empty, data / "train-00000-of-00001.parquet")
    pq.write_table(empty, data / "test-00000-of-00001.parquet")
    corrupt = root / "corrupt_model"
    corrupt.mkdir()
    for f in setup.policy.iterdir():
        if f.suffix != ".safetensors":
            (corrupt / f.name).write_bytes(f.read_bytes())
    (corrupt / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage" + bytes(64))
    corrupt_copy(setup.policy, root / "nonfinite_policy")
    corrupt_copy(setup.reward_model, root / "nonfinite_rm")
    existing = root / "existing_out"
    (existing / "sub").mkdir(parents=True)
    (existing / "notes.txt").write_text("keep me\n")
    (existing / "sub" / "metrics.jsonl").write_text('{"update": 1}\n')


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    output_dir: Path


def _run(root: Path, base: list[str], name: str, case: Case) -> Run:
    extra = case.extra(root)
    out_dir = root / f"out_{name}"
    argv = [*base, "--output_dir", str(out_dir), *TINY_RUN, *extra]
    if "--output_dir" in extra:  # the case's own output_dir wins (the last flag does)
        out_dir = Path(extra[extra.index("--output_dir") + 1])
    env = recipes.subprocess_env(
        PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    )
    proc = zygote.run(["-m", "rloo.cli", "train", *argv], cwd=root, env=env, timeout=300)
    return Run(proc.returncode, proc.stdout, proc.stderr, out_dir)


@pytest.fixture(scope="session")
def bad_input_root(tmp_path_factory: pytest.TempPathFactory, tiny_setup: TinySetup) -> Path:
    root = tmp_path_factory.mktemp("bad_input")
    _prepare(root, tiny_setup)
    return root


@pytest.fixture(scope="session")
def existing_before(bad_input_root: Path) -> dict[str, tuple[bytes, int] | None]:
    return _snapshot(bad_input_root / "existing_out")


@pytest.fixture(scope="session")
def runs(
    bad_input_root: Path,
    tiny_setup: TinySetup,
    toy_dataset: Path,
    existing_before: dict[str, tuple[bytes, int] | None],
) -> Iterator[dict[str, Future[Run]]]:
    base = [
        "--model_name_or_path", str(tiny_setup.policy),
        "--dataset_name", str(toy_dataset),
        "--reward_funcs", "rloo.demo.toy:letter_reward",
    ]  # fmt: skip
    workers = max(2, min(len(CASES), (os.cpu_count() or 2) + 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        yield {name: pool.submit(_run, bad_input_root, base, name, case) for name, case in CASES.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_one_line_exit_2_nothing_written(name: str, runs: dict[str, Future[Run]]) -> None:
    run = runs[name].result()
    report = f"exit {run.returncode}\n--- stderr:\n{run.stderr}\n--- stdout:\n{run.stdout}"
    assert "Traceback" not in run.stderr + run.stdout, report
    assert run.returncode == 2, report
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, report
    (line,) = lines
    assert line.startswith("rloo train: error: "), report
    for part in CASES[name].expect:
        assert part in line, f"{part!r} not in {line!r}"
    if name != "reward_func_nan":
        assert not run.output_dir.exists(), f"{run.output_dir} was created\n{report}"


def test_existing_output_dir_left_as_it_was(
    runs: dict[str, Future[Run]],
    bad_input_root: Path,
    existing_before: dict[str, tuple[bytes, int] | None],
) -> None:
    run = runs["reward_func_nan"].result()
    assert run.returncode == 2, run.stderr
    assert run.output_dir == bad_input_root / "existing_out"
    assert _snapshot(run.output_dir) == existing_before
    assert len(existing_before) == 3  # notes.txt, sub/, sub/metrics.jsonl


def test_python_m_rloo_cli_help() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "rloo.cli", "train", "--help"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert "--rloo_k" in proc.stdout and "--num_generations" in proc.stdout
