"""Whole `rloo train` processes: killed and resumed, preempted with SIGTERM, and run on two ranks.

These run the real CLI in subprocesses (CPU, one thread each, so results are bitwise reproducible).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rloo.training.checkpoint import checkpoint_problem
from tests.fixtures import ranks, recipes, zygote
from tests.fixtures.planted import plant

pytestmark = pytest.mark.slow

TIMING = ("time/", "memory/", "throughput/", "eps", "timestamp")  # measurements, not results


def _args(tiny, toy_data: Path, out: Path, **flags: object) -> list[str]:
    own = {"per_device_train_batch_size": 8, "num_ppo_epochs": 2, "max_steps": 6, "save_steps": 2, "seed": 5}
    return ["train", *recipes.argv(tiny, toy_data, out, recipes.LEARNING, **{**own, **flags})]


KILL_AT = Path(__file__).resolve().parents[1] / "fixtures" / "kill_at.py"


def _run(
    argv: list[str], cwd: Path | None = None, kill_at: str | None = None, **env: str
) -> subprocess.CompletedProcess[str]:
    """``rloo`` in a subprocess; ``kill_at="3:generation"`` SIGKILLs it at that update's phase."""
    launcher = [str(KILL_AT), kill_at] if kill_at else ["-m", "rloo.cli"]
    return zygote.run([*launcher, *argv], env=recipes.subprocess_env(**env), cwd=cwd)


def _metrics(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "model.safetensors"))


@pytest.fixture(scope="module")
def uninterrupted(tiny, toy_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("straight") / "out"
    proc = _run(_args(tiny, toy_data, out))
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.mark.parametrize("phase", ["generation", "optimization"])
def test_sigkill_then_resume_matches_an_uninterrupted_run(
    tiny, toy_data: Path, tmp_path: Path, uninterrupted: Path, phase: str
) -> None:
    out = tmp_path / "out"
    # killed in update index 3 (the 4th): checkpoint-2 is the newest complete one, update 3 was logged
    killed = _run(_args(tiny, toy_data, out), kill_at=f"3:{phase}")
    assert killed.returncode == -signal.SIGKILL
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-2"]
    assert len(_metrics(out)) == 3
    resumed = _run(_args(tiny, toy_data, out))
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout
    # the same weights, bit for bit, and the same metrics (timings aside), with no duplicated updates
    w_straight, w_resumed = _weights(uninterrupted), _weights(out)
    assert all(torch.equal(w_straight[k], w_resumed[k]) for k in w_straight)
    assert _metrics(out) == _metrics(uninterrupted)
    assert [m["update"] for m in _metrics(out)] == [1, 2, 3, 4, 5, 6]


def test_resume_refuses_a_planted_pickle_in_one_line(tiny, toy_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    killed = _run(_args(tiny, toy_data, out), kill_at="3:generation")
    assert killed.returncode == -signal.SIGKILL
    marker = tmp_path / "marker"
    plant(out / "checkpoint-2", "rng_state.pt", marker)  # manifest rewritten: the checkpoint looks complete
    resumed = _run(_args(tiny, toy_data, out))
    assert "Traceback" not in resumed.stderr and resumed.returncode == 2, resumed.stderr
    errors = [line for line in resumed.stderr.splitlines() if line.startswith("rloo train: error:")]
    assert errors == [
        f"rloo train: error: cannot resume from {out / 'checkpoint-2'}: rng_state.pt holds more than tensors "
        "and plain containers (it names getattr), and unpickling it could run code, so it was not loaded; "
        "resume only from checkpoints this trainer wrote, or pass --resume_from_checkpoint none to start over."
    ], resumed.stderr
    assert not marker.exists()
    assert not (out / "training_complete.json").exists()


def test_sigterm_checkpoints_and_exits_then_resumes(tiny, toy_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = _args(tiny, toy_data, out, max_steps=400, save_steps=1000, preemption_grace_seconds=20)
    proc = zygote.popen(["-m", "rloo.cli", *argv], env=recipes.subprocess_env())
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "training never got going"
        time.sleep(0.2)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    took = time.monotonic() - sent
    assert proc.returncode == 143, stderr
    assert took < 20  # within the grace period
    (ckpt,) = out.glob("checkpoint-*")
    assert checkpoint_problem(ckpt) is None
    done = int(ckpt.name.split("-")[1])
    assert 2 <= done < 400
    # metrics.jsonl holds exactly the updates the checkpoint covers once the run resumes
    resumed = _run(_args(tiny, toy_data, out, max_steps=done + 1, save_steps=1000))
    assert resumed.returncode == 0, resumed.stderr
    assert [m["update"] for m in _metrics(out)] == list(range(1, done + 2))


# What a run on N processes promises against one process with the same global batch (README, "Many
# processes"): the same samples and rewards, the same optimizer steps over the same completions, and so
# the same first-update statistics up to float summation order. After that the trajectories agree only
# as closely as float summation order allows: Adam turns order noise in near-zero gradients into steps
# of up to one learning rate, and how much noise there is depends on the CPU's kernels. So the yardstick
# is measured in the same run: one process with the batch cut into smaller micro-batches takes the same
# optimizer steps in another summation order, and two processes must stay as close as that.
LAYOUT_FLAGS = dict(
    max_steps=3,
    save_steps=0,
    normalize_advantage=True,
    num_mini_batches=2,  # two optimizer steps per epoch: each must hold the same completions
    num_ppo_epochs=2,
    learning_rate=1e-3,
)
ROLLOUT_STATS = (
    "objective/scores",
    "objective/rlhf_reward",
    "objective/kl",
    "objective/entropy",
    "reward_std",
)
OPTIMIZATION_STATS = ("loss/policy_avg", "grad_norm", "val/ratio", "policy/approxkl_avg")


def _two_ranks(tiny, toy_data: Path, out: Path, **flags: object) -> subprocess.CompletedProcess[str]:
    """Two ranks, as ``torchrun --nproc_per_node 2 -m rloo.cli`` starts them (tests/fixtures/ranks.py)."""
    args = ["-m", "rloo.cli", *_args(tiny, toy_data, out, **flags)]
    return ranks.launch(2, args, env=recipes.subprocess_env(), timeout=600)


def _apart(w1: dict[str, torch.Tensor], w2: dict[str, torch.Tensor]) -> float:
    return float(torch.cat([(w1[k] - w2[k]).flatten() for k in w1]).norm())


def _metric_gap(m1: list[dict], m2: list[dict]) -> float:
    """Largest relative difference of any statistic at any update."""
    return max(
        abs(a[k] - b[k]) / max(abs(a[k]), 1e-3)
        for a, b in zip(m1, m2, strict=True)
        for k in ROLLOUT_STATS + OPTIMIZATION_STATS
    )


# Non-default loss options: KL as a k2 loss term, token-mean over the global mini-batch,
# clip-higher. They are config, so resume and layouts must honour them. (Masking truncated completions
# is left out: the tiny random policy seldom samples EOS, so it would mask nearly everything here.)
LOSS_OPTION_FLAGS: dict[str, object] = dict(
    kl_estimator="k2",
    kl_in_loss="true",
    loss_agg_mode="token-mean",
    cliprange_high=0.3,
    stop_token="eos",
)


# The algorithm variants all at once (DAPO's group filtering and overlong penalty, GSPO, dual clip,
# entropy terms, a moving reference), on a pass/fail reward so that groups without spread occur (for
# --filter_groups and its resampling); the reference moves every 2 updates, so the checkpoint taken after
# update 2 holds a moved reference that the resumed run must restore.
ALGORITHM_VARIANT_FLAGS: dict[str, object] = dict(
    reward_funcs="rloo.demo.toy:vowel_majority_reward",
    filter_groups="true",
    max_num_gen_batches=2,
    scale_rewards="group",
    importance_sampling_level="sequence",
    loss_agg_mode="seq-mean-token-mean",
    clip_ratio_c=3.0,
    delta=1.5,
    entropy_coef=0.01,
    top_entropy_quantile=0.5,
    overlong_buffer_len=2,
    stop_token="eos",
    sync_ref_model="true",
    ref_model_sync_steps=2,
)
ALGORITHM_VARIANT_METRICS = (
    "filter_groups/kept_frac",
    "filter_groups/rounds",
    "clip_ratio/dual_clip_frac",
    "loss/entropy_bonus_avg",
    "policy/top_entropy_kept_frac",
    "monitor/score_length_corr",
)


# The newer options together: two reward sources normalised per group (GDPO), SAPO's soft gates, the
# off-policy sequence mask (the second epoch has drifted), the bias-corrected KL in the loss, and the adaptive
# entropy coefficient, whose state (coefficient and last entropy) the checkpoint must carry: a target above
# any entropy makes it climb each optimizer step, so a resume that restarted it would log other values.
NEWER_OPTION_FLAGS: dict[str, object] = dict(
    reward_funcs=["rloo.demo.toy:vowel_majority_reward", "rloo.demo.toy:letter_reward"],
    multi_objective_aggregation="normalize_then_sum",
    loss_type="sapo",
    loss_agg_mode="seq-mean-token-mean",
    off_policy_mask_threshold=0.001,
    kl_estimator="k3",
    kl_in_loss="true",
    use_bias_correction_kl="true",
    entropy_coef=0.01,
    use_adaptive_entropy="true",
    entropy_target=100.0,
)
NEWER_OPTION_METRICS = (
    "entropy_coef",
    "policy/off_policy_masked_frac",
    "loss/kl_avg",
    "loss/entropy_bonus_avg",
)


@pytest.mark.parametrize(
    ("options", "logged"),
    [
        (LOSS_OPTION_FLAGS, ("loss/kl_avg",)),
        (ALGORITHM_VARIANT_FLAGS, ALGORITHM_VARIANT_METRICS),
        (NEWER_OPTION_FLAGS, NEWER_OPTION_METRICS),
    ],
    ids=["loss_options", "algorithm_variants", "newer_options"],
)
def test_loss_options_resume_exactly(
    tiny, toy_data: Path, tmp_path: Path, options: dict[str, object], logged: tuple[str, ...]
) -> None:
    out = _killed_then_resumed_as_straight(tiny, toy_data, tmp_path, options, "3:optimization")
    assert all(key in m for m in _metrics(out) for key in logged)
    if options is NEWER_OPTION_FLAGS:  # 2 optimizer steps per update, each 0.005 up from 0.01
        assert [m["entropy_coef"] for m in _metrics(out)] == pytest.approx(
            [0.01 + 0.01 * u for u in range(1, 7)]
        )


def _killed_then_resumed_as_straight(
    tiny,
    toy_data: Path,
    tmp_path: Path,
    options: dict[str, object],
    kill_at: str,
    after_kill: Callable[[Path], None] | None = None,
) -> Path:
    """A run with ``options`` SIGKILLed at ``kill_at`` (``after_kill`` then sees its output) and resumed ends
    as the uninterrupted one, bit for bit (weights and metrics); the resumed output."""
    straight, out = tmp_path / "straight", tmp_path / "out"
    proc = _run(_args(tiny, toy_data, straight, **options))
    assert proc.returncode == 0, proc.stderr
    killed = _run(_args(tiny, toy_data, out, **options), kill_at=kill_at)
    assert killed.returncode == -signal.SIGKILL
    checkpoints = sorted(p.name for p in out.glob("checkpoint-*"))
    if after_kill is not None:
        after_kill(out)
    resumed = _run(_args(tiny, toy_data, out, **options))
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout
    w_straight, w_resumed = _weights(straight), _weights(out)
    assert all(torch.equal(w_straight[k], w_resumed[k]) for k in w_straight)
    assert _metrics(out) == _metrics(straight)
    assert checkpoints  # it resumed from one, not from scratch
    return out


# the newer options on two ranks: the adaptive entropy reads the entropy over all ranks, the group
# normalisation of the reward sources runs on each rank's whole groups (the off-policy mask is per completion,
# and a threshold decision that a summation order flips would make the trajectories part, so it stays out)
NEWER_OPTIONS_ON_RANKS = {k: v for k, v in NEWER_OPTION_FLAGS.items() if k != "off_policy_mask_threshold"}


@pytest.mark.parametrize(
    "options",
    [{}, LOSS_OPTION_FLAGS, ALGORITHM_VARIANT_FLAGS, NEWER_OPTIONS_ON_RANKS],
    ids=["classic", "loss_options", "algorithm_variants", "newer_options"],
)
def test_two_processes_match_one(tiny, toy_data: Path, tmp_path: Path, options: dict[str, object]) -> None:
    # 16 completions per update (4 prompts x k=4, two mini-batches of 2 prompts): 1 process x 16 in
    # micro-batches of 8, the same in micro-batches of 4 (the float-order yardstick), 2 processes x 8.
    # (The tiny policy's completions all run to full length here, so every micro-batch holds as many
    # tokens; tests/integration/test_train.py::test_token_mean_does_not_depend_on_the_micro_batch_size
    # covers unequal ones.)
    one, one_small, two = tmp_path / "one", tmp_path / "one_small", tmp_path / "two"
    for out, flags in ((one, {}), (one_small, {"gradient_accumulation_steps": 2})):
        pdtbs = 8 // flags.get("gradient_accumulation_steps", 1)
        argv = _args(
            tiny, toy_data, out, per_device_train_batch_size=pdtbs, **LAYOUT_FLAGS, **options, **flags
        )
        proc = _run(argv)
        assert proc.returncode == 0, proc.stderr
    proc2 = _two_ranks(tiny, toy_data, two, per_device_train_batch_size=4, **LAYOUT_FLAGS, **options)
    assert proc2.returncode == 0, proc2.stderr[-3000:]
    m1, m1_small, m2 = _metrics(one), _metrics(one_small), _metrics(two)
    assert [m["episode"] for m in m2] == [16, 32, 48]
    # update 1: identical samples and rollout statistics (computed before any optimizer step)
    for key in ROLLOUT_STATS:
        assert m1[0][key] == pytest.approx(m2[0][key], rel=1e-6, abs=1e-7), key
    # the trajectory: as close as a different summation order on one process, with a floor for CPUs
    # whose order noise is tiny (here both gaps are ~1e-5 with global mini-batches; with mini-batches
    # shuffled per rank the two-process gap was 8e-2)
    yardstick = _metric_gap(m1, m1_small)
    if options is LOSS_OPTION_FLAGS:  # the loss options too: micro-batch size changes only summation order
        assert yardstick < 1e-3, yardstick
    if options is ALGORITHM_VARIANT_FLAGS:
        # not the yardstick: --top_entropy_quantile takes its threshold over a micro-batch on all ranks,
        # which smaller micro-batches on one process change (two ranks x 4 = one x 8 do not). The rollouts
        # of every update (so the weights they were sampled with) agree; the loss statistics are means of
        # per-micro-batch means, which completions of unequal lengths (a stop token) weigh by layout
        for a, b in zip(m1, m2, strict=True):
            for key in ROLLOUT_STATS:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["update"], key)
            assert a["filter_groups/replaced"] == b["filter_groups/replaced"]
            assert a["loss/policy_avg"] == pytest.approx(b["loss/policy_avg"], rel=1e-3, abs=1e-5)
    else:
        assert _metric_gap(m1, m2) <= max(10 * yardstick, 1e-3), (_metric_gap(m1, m2), yardstick)
    w0, w1, w1_small, w2 = _weights_init(tiny), _weights(one), _weights(one_small), _weights(two)
    moved = _apart(w1, w0)
    assert moved > 0.05  # training did move the weights...
    # ...and the two layouts moved them the same way, up to summation order
    assert _apart(w1, w2) <= max(10 * _apart(w1, w1_small), 1e-3 * moved), (_apart(w1, w2), moved)


def test_lora_two_processes_match_one(tiny, toy_data: Path, tmp_path: Path) -> None:
    # LoRA on N processes: only the adapters' gradients are all-reduced (the frozen base has none); the
    # same samples on update 1 and the same adapters up to summation order, as for full fine-tuning
    pytest.importorskip("peft")
    lora = dict(use_peft="true", lora_r=4, lora_alpha=8.0)
    one, one_small, two = tmp_path / "one", tmp_path / "one_small", tmp_path / "two"
    for out, accum in ((one, 1), (one_small, 2)):
        argv = _args(
            tiny,
            toy_data,
            out,
            per_device_train_batch_size=8 // accum,
            gradient_accumulation_steps=accum,
            **LAYOUT_FLAGS,
            **lora,
        )
        proc = _run(argv)
        assert proc.returncode == 0, proc.stderr
    proc2 = _two_ranks(tiny, toy_data, two, per_device_train_batch_size=4, **LAYOUT_FLAGS, **lora)
    assert proc2.returncode == 0, proc2.stderr[-3000:]
    m1, m1_small, m2 = _metrics(one), _metrics(one_small), _metrics(two)
    for key in ROLLOUT_STATS:
        assert m1[0][key] == pytest.approx(m2[0][key], rel=1e-6, abs=1e-7), key
    assert _metric_gap(m1, m2) <= max(10 * _metric_gap(m1, m1_small), 1e-3)
    adapter = "adapter_model.safetensors"
    a1, a1_small, a2 = (load_file(str(d / adapter)) for d in (one, one_small, two))
    moved = float(torch.cat([a1[k].flatten() for k in a1 if "lora_B" in k]).norm())  # B starts at 0
    assert moved > 0
    assert _apart(a1, a2) <= max(10 * _apart(a1, a1_small), 1e-3 * moved), (_apart(a1, a2), moved)


def _weights_init(tiny) -> dict[str, torch.Tensor]:
    return load_file(str(Path(tiny.policy) / "model.safetensors"))


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory):
    from tests.fixtures.servers import release, shared_s3

    server = shared_s3(tmp_path_factory.mktemp("s3"))
    yield server
    release("s3")


def test_fresh_machine_resumes_from_the_s3_mirror(
    tiny, toy_data: Path, tmp_path: Path, uninterrupted: Path, s3
) -> None:
    # pod 1 mirrors its checkpoints to S3 and is killed; pod 2 starts with an empty disk, finds the newest
    # complete checkpoint (and the metrics so far) in S3, and ends where an uninterrupted run ends
    uri = f"s3://{s3.bucket}/runs/{tmp_path.name}"
    pod1, pod2 = tmp_path / "pod1", tmp_path / "pod2"
    killed = _run(_args(tiny, toy_data, pod1, checkpoint_uri=uri), kill_at="5:generation", **s3.env())
    assert killed.returncode == -signal.SIGKILL
    resumed = _run(_args(tiny, toy_data, pod2, checkpoint_uri=uri), **s3.env())
    assert resumed.returncode == 0, resumed.stderr
    assert "restored checkpoint-" in resumed.stdout
    w_straight, w_resumed = _weights(uninterrupted), _weights(pod2)
    assert all(torch.equal(w_straight[k], w_resumed[k]) for k in w_straight)
    assert _metrics(pod2) == _metrics(uninterrupted)


def test_s3_output_dir_trains_publishes_and_resumes_on_a_fresh_machine(
    tiny, toy_data: Path, tmp_path: Path, uninterrupted: Path, s3, mlflow_server, monkeypatch
) -> None:
    # --output_dir s3://...: staged locally, checkpoints mirrored to <prefix>/checkpoints, the result uploaded
    # with its manifest; a pod killed mid-run is replaced by one with an empty disk that resumes from S3
    from mlflow.tracking import MlflowClient

    from rloo.storage import download_dir, read_manifest
    from tests.fixtures.servers import use_s3

    use_s3(s3, monkeypatch)  # this process reads the prefix too
    uri = f"s3://{s3.bucket}/outputs/{tmp_path.name}"
    experiment = f"s3-output-{tmp_path.name}"
    env = {**s3.env(), "MLFLOW_TRACKING_URI": mlflow_server.uri, "MLFLOW_EXPERIMENT_NAME": experiment}
    pod1, pod2, pod3 = tmp_path / "pod1", tmp_path / "pod2", tmp_path / "pod3"
    for pod in (pod1, pod2, pod3):
        pod.mkdir()
    killed = _run(
        _args(tiny, toy_data, uri, local_dir=pod1 / "stage"),
        pod1,
        kill_at="5:generation",
        **env,
    )
    assert killed.returncode == -signal.SIGKILL
    resumed = _run(_args(tiny, toy_data, uri, local_dir=pod2 / "stage"), pod2, **env)
    assert resumed.returncode == 0, resumed.stderr
    assert "restored checkpoint-" in resumed.stdout
    assert not list(tmp_path.rglob("s3:"))  # the URI is never taken for a local path
    # the prefix holds the final model, metrics and samples, with a manifest; the checkpoints are below it
    listed = {f.path for f in read_manifest(uri).files}
    assert {"model.safetensors", "metrics.jsonl", "training_complete.json", "config.json"} <= listed
    assert not any(p.startswith("checkpoint-") for p in listed)
    got = download_dir(uri, tmp_path / "downloaded", progress=False)
    assert got.files
    w_straight, w_s3 = _weights(uninterrupted), _weights(tmp_path / "downloaded")
    assert all(torch.equal(w_straight[k], w_s3[k]) for k in w_straight)
    assert _metrics(tmp_path / "downloaded") == _metrics(uninterrupted)
    # MLflow: the finished run is in MLFLOW_EXPERIMENT_NAME, identified by the prefix
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None
    runs = client.search_runs([exp.experiment_id], filter_string="attributes.status = 'FINISHED'")
    assert [r.data.tags.get("rloo.output_dir") for r in runs] == [uri]
    # completeness is decided by the prefix: a fresh disk trains nothing...
    again = _run(_args(tiny, toy_data, uri, local_dir=pod3 / "stage"), pod3, **env)
    assert again.returncode == 0, again.stderr
    assert "already holds a completed run" in again.stdout
    assert not (pod3 / "stage" / "model.safetensors").exists()
    # ...and wrong credentials are one line, not "complete"
    bad = _run(
        _args(tiny, toy_data, uri, local_dir=pod3 / "stage"),
        pod3,
        **{**env, "AWS_SECRET_ACCESS_KEY": "wrong"},
    )
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0 and "credentials" in bad.stderr
    assert "Traceback" not in bad.stderr and s3.secret_key not in bad.stderr


ASYNC_FLAGS: dict[str, object] = dict(async_generation="true")


@pytest.mark.parametrize("phase", ["generation", "optimization"])
def test_async_generation_resumes_exactly(tiny, toy_data: Path, tmp_path: Path, phase: str) -> None:
    """--async_generation (rloo.training.async_rollout): checkpoint-2 holds the batch of update 3 that was
    generated during update 2 from update 2's weights, so the resumed run trains on the very batches of the
    uninterrupted one, bit for bit, though its weights have moved on since."""
    held: list[list[int]] = []

    def look(out: Path) -> None:  # what the killed run left for the resumed one
        ahead = torch.load(out / "checkpoint-2" / "rollouts_ahead.pt", weights_only=True)
        held.extend(sorted(part) for part in ahead["parts"])

    out = _killed_then_resumed_as_straight(
        tiny, toy_data, tmp_path, ASYNC_FLAGS, f"3:{phase}", after_kill=look
    )
    assert held == [[2]]  # one rank, the batch of update index 2
    assert [m["async/staleness"] for m in _metrics(out)] == [0.0] + [2.0] * 5  # 2 epochs: 2 steps an update


def test_async_generation_on_two_processes_matches_one(tiny, toy_data: Path, tmp_path: Path) -> None:
    """Each rank generates its slice of the batch ahead on its own worker; failures and checkpoints are
    agreed on the training thread. Two ranks train as one process does, up to summation order."""
    one, two = tmp_path / "one", tmp_path / "two"
    proc = _run(_args(tiny, toy_data, one, per_device_train_batch_size=8, **LAYOUT_FLAGS, **ASYNC_FLAGS))
    assert proc.returncode == 0, proc.stderr
    proc2 = _two_ranks(tiny, toy_data, two, per_device_train_batch_size=4, **LAYOUT_FLAGS, **ASYNC_FLAGS)
    assert proc2.returncode == 0, proc2.stderr[-3000:]
    m1, m2 = _metrics(one), _metrics(two)
    assert [m["async/staleness"] for m in m2] == [0.0, 4.0, 4.0]
    for a, b in zip(m1, m2, strict=True):
        for key in ROLLOUT_STATS:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["update"], key)
    w0, w1, w2 = _weights_init(tiny), _weights(one), _weights(two)
    assert _apart(w1, w2) <= 1e-3 * _apart(w1, w0), (_apart(w1, w2), _apart(w1, w0))
