#!/usr/bin/env bash
# The next GPU session, in three calls of under 10 minutes each, on a bare, air-gapped GPU node with the
# wheels of `make gpu-wheels` carried in gpu-wheels/ (see benchmarks/README.md, "The next GPU session").
#
#   benchmarks/gpu_session.sh STAGE OUT          STAGE: 1, 2 or 3; everything it writes goes under OUT
#   DRY_RUN=1 benchmarks/gpu_session.sh STAGE OUT    print the stage's steps, budgets (as STAGE_LIMIT cuts
#                                                    them) and commands, run nothing
#
# Stage 1: decode A/B at 0.5B (bench_decode.py: fp32 under autocast, bf16 rollout copy, whole-step graph,
#          dynamic),
#          ours at 0.5B with the compiled generation (bench_gpu.py), then a profile of it (profile_gpu.py)
#          if time is left.
# Stage 2: the GPU tests (pytest -m gpu, -p no:logging, a per-test timeout where pytest-timeout imports,
#          else a traceback dump after it; the DeepSpeed tests are left to the next two steps), then ZeRO-2
#          and ZeRO-3 trainings launched directly (accelerate launch, rloo train, a tiny rloo.demo model:
#          2 updates, then resumed to 4), their stdout and stderr kept.
# Stage 3: ours and TRL at 0.5B (the same-machine ratio), then ours at 1.5B, then ours at 0.5B with
#          --torch_compile (each decoder layer compiled: against stage 3's own run of ours without it; the
#          summary gives the ratio of their steady episodes/s).
#
# Every step runs under `timeout` with a budget (STEPS below; the whole stage, wheel installation and
# environment report included, keeps within STAGE_LIMIT, 510 s by default), writes OUT/<step>.out and
# OUT/<step>.err (plus its JSON/markdown files), and a step with less than MIN_STEP (45 s) left is
# skipped. The stage ends by printing a summary table (step, status, seconds, headline figure; a step that
# failed with no figure shows the last line of its .err), also written to OUT/summary.md.
# Exit status: 0, 1 when a step failed or ran out of time (every step still runs), 2 for a usage error
# (STAGE_LIMIT and MIN_STEP: whole seconds above 0), wheels pip cannot install, or a PYTHON that cannot
# import torch (checked before any step, not in a dry run). WHEELS (default gpu-wheels) and PYTHON
# (default python3: on a node whose CUDA torch is another interpreter's, PYTHON=/usr/bin/python3.12 or
# the like) as gpu_check.sh.
set -uo pipefail
USAGE="usage: benchmarks/gpu_session.sh STAGE OUT (STAGE: 1, 2 or 3)"
STAGE=${1:-}
OUT_ARG=${2:-}
case "$STAGE" in
  1 | 2 | 3) ;;
  *)
    echo "gpu_session: STAGE must be 1, 2 or 3, not '$STAGE'; $USAGE" >&2
    exit 2
    ;;
esac
if [ -z "$OUT_ARG" ]; then
  echo "gpu_session: no OUT folder given; $USAGE" >&2
  exit 2
fi
DRY_RUN=${DRY_RUN:-0}
case "$OUT_ARG" in /*) OUT=$OUT_ARG ;; *) OUT=$PWD/$OUT_ARG ;; esac
cd "$(dirname "$0")/.." || exit 2
WHEELS=${WHEELS:-gpu-wheels}
PY=${PYTHON:-python3}
STAGE_LIMIT=${STAGE_LIMIT:-510} # seconds: 8.5 minutes, inside a 10-minute command with room to spare
MIN_STEP=${MIN_STEP:-45}         # a step with less time left than this is skipped
SETUP_S=30                       # the dry run's estimate of the wheel installation and environment report
for var in STAGE_LIMIT MIN_STEP; do
  value=${!var}
  case "$value" in
    '' | *[!0-9]*) value=0 ;; # not a whole number (a sign, a point, a space, a letter): refused below
    *) value=$((10#$value)) ;; # 010 is ten seconds, not octal
  esac
  if ((value <= 0)); then
    echo "gpu_session: $var must be a whole number of seconds above 0, not '${!var}'" >&2
    exit 2
  fi
  printf -v "$var" '%s' "$value"
done
T0=$SECONDS

# ---------------------------------------------------------------------------------------------------------
# budgets (seconds) and steps, in order. Measured on the last H100 session (benchmarks/RESULTS.md): ours at
# 0.5B, compiled decode, 8 updates ~25 s of training + ~30 s of model build and load; TRL at 0.5B ~40 s;
# ours at 1.5B ~115 s of training + ~60 s to build, save and load 1.4B fp32 weights; the GPU tests 170 s
# with the DeepSpeed ones (which failed early), since joined by 4 compiled decode tests; a DeepSpeed launch
# of the tiny model ~30 s (two a step). Compilation (CUDA graphs) is ~15-30 s per decode variant.
STEPS_1="decode:200 bench-0.5b-ours:150 profile-0.5b:120"
STEPS_2="tests:260 zero-setup:20 zero2:100 zero3:100"
STEPS_3="bench-0.5b-vs-trl:170 bench-1.5b-ours:220 bench-0.5b-ours-layers:90"
eval "STEPS=\$STEPS_$STAGE"

# ---------------------------------------------------------------------------------------------------------
# running commands: x LOG CMD... runs CMD under the step's deadline, stdout to OUT/LOG.out, stderr to
# OUT/LOG.err; in a dry run it prints "  $ CMD" (shell-quoted, readably: see shell_word) instead.
STEP_RC=0
STEP_DEADLINE=0
SAFE_WORD='^[A-Za-z0-9_@%+=:,./-]+$'
WORK_WORD='^[$]WORK(/[A-Za-z0-9_@%+=:,./-]*)?$'
# one argument as a shell word: as it is when nothing in it is special ($WORK/... left for the shell to
# expand), else in single quotes, else in double quotes, else as printf %q writes it
shell_word() {
  local a=$1
  if [[ $a =~ $SAFE_WORD || $a =~ $WORK_WORD ]]; then
    printf '%s' "$a"
  elif [[ -n $a && $a != *"'"* ]]; then
    printf "'%s'" "$a"
  elif [[ -n $a && $a != *[\"\$\`\\!]* ]]; then
    printf '"%s"' "$a"
  else
    printf '%q' "$a"
  fi
}
x() {
  local log=$1
  shift
  if [ "$DRY_RUN" = 1 ]; then
    printf '  $'
    local a
    for a in "$@"; do
      printf ' '
      shell_word "$a"
    done
    printf '\n'
    return 0
  fi
  local left=$((STEP_DEADLINE - SECONDS))
  if ((left < 5)); then
    echo "gpu_session: $log: no time left in the step" >>"$OUT/$log.err"
    STEP_RC=124
    return 124
  fi
  timeout -k 15 "$left" "$@" >"$OUT/$log.out" 2>"$OUT/$log.err"
  local rc=$?
  ((rc != 0 && STEP_RC == 0)) && STEP_RC=$rc
  return $rc
}

# ---------------------------------------------------------------------------------------------------------
# the steps
# one function a step: step_<name with - and . as _>
step_decode() {
  x decode "$PY" benchmarks/bench_decode.py --preset 0.5b --json "$OUT/decode.json"
}
step_bench_0_5b_ours() {
  x bench-0.5b-ours "$PY" benchmarks/bench_gpu.py --sizes 0.5b --only ours --generation compiled \
    --json "$OUT/bench-0.5b-ours.json"
}
step_profile_0_5b() {
  x profile-0.5b "$PY" benchmarks/profile_gpu.py --size 0.5b --generation compiled \
    --out "$OUT/profile-0.5b.md" --json "$OUT/profile-0.5b.json"
}
step_tests() {
  # pytest-timeout fails one hung test; without it, faulthandler dumps the stacks of one that hangs
  local timeout_flag=(-o faulthandler_timeout=120)
  "$PY" -c "import pytest_timeout" 2>/dev/null && timeout_flag=(--timeout 120)
  # the DeepSpeed tests are the zero2 and zero3 steps below, launched directly with their stderr kept
  x tests "$PY" -m pytest -m gpu tests/gpu -q -rs -p no:cacheprovider -p no:logging "${timeout_flag[@]}" \
    -k "not deepspeed" --junitxml "$OUT/gpu-tests.xml"
  if ((STEP_RC == 5)); then STEP_RC=0; fi # nothing collected: every module skipped (no CUDA)
}
step_zero_setup() {
  # the tiny rloo.demo model (Qwen2-shaped, 64 x 2) and the toy prompts both ZeRO steps train on
  x zero-setup "$PY" -c "import sys; from rloo.demo.tiny import build_tiny_setup; from rloo.demo.toy import write_toy_dataset; build_tiny_setup(sys.argv[1], arch='qwen2'); write_toy_dataset(sys.argv[2])" \
    "$WORK/tiny" "$WORK/toy"
}
zero() {
  local stage=$1 run="$WORK/zero$1"
  if [ "$DRY_RUN" != 1 ]; then
    if ! gpu_env_has_cuda "$OUT/environment.txt"; then
      STEP_NOTE="skipped: no CUDA GPU"
      return
    fi
    if grep -q "^deepspeed: not available" "$OUT/environment.txt"; then
      STEP_NOTE="skipped: deepspeed not importable (carry gpu-wheels)"
      return
    fi
  fi
  local launch=(
    "$PY" -m accelerate.commands.launch
    --config_file "configs/accelerate/deepspeed_zero$stage.yaml" --num_processes 1
    -m rloo.cli train
    --model_name_or_path "$WORK/tiny/policy" --reward_funcs rloo.demo.toy:letter_reward
    --dataset_name "$WORK/toy" --output_dir "$run"
    --per_device_train_batch_size 16 --rloo_k 4 --response_length 16 --learning_rate 1e-5 --bf16
    --save_steps 1 --num_sample_generations 0 --disable_tqdm
  )
  x "zero$stage-first" "${launch[@]}" --max_steps 2 || return
  x "zero$stage-resume" "${launch[@]}" --max_steps 4 # resumes from the checkpoint of update 2
  [ "$DRY_RUN" = 1 ] && return
  local updates=0
  if [ -f "$run/metrics.jsonl" ]; then
    cp "$run/metrics.jsonl" "$OUT/zero$stage-metrics.jsonl"
    updates=$(wc -l <"$run/metrics.jsonl")
  fi
  if [ "$updates" -ne 4 ] || [ ! -f "$run/training_complete.json" ]; then
    STEP_NOTE="expected 4 updates and training_complete.json, got $updates updates"
    ((STEP_RC == 0)) && STEP_RC=1
  fi
}
step_zero2() { zero 2; }
step_zero3() { zero 3; }
step_bench_0_5b_vs_trl() {
  # first: the ratio at 0.5B is bounded in time; 1.5B takes what is left
  x bench-0.5b-vs-trl "$PY" benchmarks/bench_gpu.py --sizes 0.5b --generation compiled \
    --json "$OUT/bench-0.5b-vs-trl.json"
}
step_bench_1_5b_ours() {
  x bench-1.5b-ours "$PY" benchmarks/bench_gpu.py --sizes 1.5b --only ours --generation compiled \
    --json "$OUT/bench-1.5b-ours.json"
}
step_bench_0_5b_ours_layers() {
  # 6 updates: the layers' compilation (~30-60 s) sits in the first, which the steady figures leave out
  x bench-0.5b-ours-layers "$PY" benchmarks/bench_gpu.py --sizes 0.5b --only ours --generation compiled \
    --torch-compile --updates 6 --json "$OUT/bench-0.5b-ours-layers.json"
}

# ---------------------------------------------------------------------------------------------------------
# the stage
if [ "$DRY_RUN" = 1 ]; then
  WORK='$WORK'
  echo "gpu_session: stage $STAGE (dry run): OUT=$OUT, stage limit ${STAGE_LIMIT} s, PYTHON=$PY"
  echo "setup (~$SETUP_S s): wheels from $WHEELS into a scratch folder, a check that $PY imports torch," \
    "environment report to $OUT/environment.txt"
  if [ "$STAGE" = 2 ]; then
    echo "\$WORK: a scratch folder for the tiny model, the toy prompts and the checkpoints, made at run time" \
      "(mktemp -d in ${TMPDIR:-/tmp}) and removed when the stage ends"
  fi
  echo "budgets: as the stage cuts them if every step before takes its whole budget; a step with less" \
    "than $MIN_STEP s left is skipped"
  used=$SETUP_S
  for entry in $STEPS; do
    name=${entry%%:*}
    budget=${entry##*:}
    left=$((STAGE_LIMIT - used))
    if ((left < MIN_STEP)); then
      echo "step $name (skipped: no time left, $((left > 0 ? left : 0)) s of the stage)"
      continue
    fi
    ((budget > left)) && budget=$left
    used=$((used + budget))
    echo "step $name (budget $budget s)"
    "step_${name//[^a-zA-Z0-9]/_}" || exit 1
  done
  exit 0
fi

mkdir -p "$OUT"
# shellcheck source=benchmarks/gpu_env.sh
source benchmarks/gpu_env.sh
gpu_env_install gpu_session "$WHEELS"
# pre-flight: the node's default python may not be the one with its CUDA torch; every step would fail
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "gpu_session: $PY cannot import torch: set PYTHON to the interpreter with the node's CUDA torch" \
    "(e.g. PYTHON=/usr/bin/python3.12)" >&2
  exit 2
fi
gpu_env_report "$OUT/environment.txt"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-session-work.XXXXXX") # models and checkpoints: not results
trap 'rm -rf "$GPU_ENV_SITE" "$WORK"' EXIT

status=0
: >"$OUT/steps.tsv"
for entry in $STEPS; do
  name=${entry%%:*}
  budget=${entry##*:}
  left=$((STAGE_LIMIT - (SECONDS - T0)))
  STEP_RC=0
  STEP_NOTE=""
  if ((left < MIN_STEP)); then
    printf '%s\tskipped\t0\tno time left (%s s)\n' "$name" "$left" >>"$OUT/steps.tsv"
    continue
  fi
  ((budget > left)) && budget=$left
  echo "== $name (budget $budget s, $left s left in the stage) =="
  STEP_DEADLINE=$((SECONDS + budget))
  start=$SECONDS
  "step_${name//[^a-zA-Z0-9]/_}" # bench-0.5b-ours -> step_bench_0_5b_ours
  seconds=$((SECONDS - start))
  if ((STEP_RC == 124 || STEP_RC == 137)); then
    result="TIMEOUT"
    status=1
  elif ((STEP_RC != 0)); then
    result="FAILED (exit $STEP_RC)"
    status=1
  elif [[ "$STEP_NOTE" == skipped* ]]; then
    result="skipped"
  else
    result="ok"
  fi
  printf '%s\t%s\t%s\t%s\n' "$name" "$result" "$seconds" "$STEP_NOTE" >>"$OUT/steps.tsv"
  echo "   $name: $result in $seconds s"
done

# the summary: one headline figure per step, read from what the step wrote
GPU_SESSION_OUT=$OUT "$PY" - >"$OUT/summary.md" 2>>"$OUT/summary.err" <<'PYEOF'
import json, os, re
from pathlib import Path

out = Path(os.environ["GPU_SESSION_OUT"])


def load(name):
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError):
        return None


def pct(x):
    return "n/a" if x is None or x != x else f"{x:.0%}"


def bench(name):
    data = load(f"{name}.json")
    if not data:
        text = (out / f"{name}.out").read_text().strip() if (out / f"{name}.out").is_file() else ""
        return text.splitlines()[-1][:80] if text else ""
    parts = []
    for size, runs in data.get("figures", {}).items():
        for trainer, f in runs.items():
            parts.append(
                f"{size} {trainer}: {f['steady_episodes_per_s']:.1f} ep/s steady, gen {pct(f.get('generation_fraction_of_read_bound'))} "
                f"of read bound, MFU {pct(f.get('training_mfu_executed'))} exec / {pct(f.get('training_mfu'))} nominal"
            )
        if {"ours", "trl"} <= set(runs):
            parts.append(f"ratio {runs['ours']['steady_episodes_per_s'] / runs['trl']['steady_episodes_per_s']:.2f}x steady")
    return "; ".join(parts)


def decode():
    data = load("decode.json")
    if not data:
        return ""
    cells = [
        f"{n} {v['figures']['decode_ms_per_step']:.2f}" for n, v in data["variants"].items() if "figures" in v
    ]
    checks = ", ".join(
        ("greedy ok" if c["ok"] else "greedy MISMATCH")
        + (f" ({c['greedy']:.1%} equal)" if isinstance(c.get("greedy"), (int, float)) else "")
        for c in data.get("checks", [])
    )
    return "decode ms/step: " + ", ".join(cells) + (f"; {checks}" if checks else "")


def profile():
    data = load("profile-0.5b.json")
    if not data:
        return ""
    return ", ".join(f"{p} {s['wall_ms'] / s['occurrences']:.0f} ms ({pct(s['gpu_busy_fraction'])} busy)" for p, s in data.items())


def tests():
    log = out / "tests.out"
    lines = [l for l in log.read_text().splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", l)] if log.is_file() else []
    return lines[-1].strip("= ") if lines else ""


def zero(stage):
    metrics = out / f"zero{stage}-metrics.jsonl"
    if metrics.is_file():
        records = [json.loads(l) for l in metrics.read_text().splitlines() if l.strip()]
        return f"{len(records)} updates, episodes {[r.get('episode') for r in records]}"
    for log in (f"zero{stage}-resume.err", f"zero{stage}-first.err"):
        p = out / log
        if p.is_file():
            ours = [l for l in p.read_text(errors="replace").splitlines() if "[rloo]" in l or "Error" in l]
            if ours:
                return ours[-1].strip()[:100]
    return ""


def steady(name, trainer="ours"):
    """Steady episodes/s of one trainer in a bench step's JSON (its first size), or None."""
    data = load(f"{name}.json")
    for runs in (data or {}).get("figures", {}).values():
        value = runs.get(trainer, {}).get("steady_episodes_per_s")
        if isinstance(value, (int, float)) and value == value:
            return float(value)
    return None


def layers_ratio():
    """Ours with --torch_compile (bench-0.5b-ours-layers) over ours without (bench-0.5b-vs-trl), steady
    episodes/s: "" unless both ran."""
    with_layers, without = steady("bench-0.5b-ours-layers"), steady("bench-0.5b-vs-trl")
    if with_layers is None or not without:
        return ""
    return f"--torch_compile / without (bench-0.5b-vs-trl ours): {with_layers / without:.2f}x steady"


def layers():
    return "; ".join(x for x in (bench("bench-0.5b-ours-layers"), layers_ratio()) if x)


def last_line(*names):
    """The last non-empty line of the last of these files in OUT that has one, cut to 100 characters."""
    for name in reversed(names):
        p = out / name
        lines = [l.strip() for l in p.read_text(errors="replace").splitlines() if l.strip()] if p.is_file() else []
        if lines:
            return lines[-1][:100] + ("..." if len(lines[-1]) > 100 else "")
    return ""


HEADLINES = {
    "decode": decode,
    "bench-0.5b-ours": lambda: bench("bench-0.5b-ours"),
    "profile-0.5b": profile,
    "tests": tests,
    "zero2": lambda: zero(2),
    "zero3": lambda: zero(3),
    "bench-0.5b-vs-trl": lambda: bench("bench-0.5b-vs-trl"),
    "bench-1.5b-ours": lambda: bench("bench-1.5b-ours"),
    "bench-0.5b-ours-layers": layers,
}
print("| step | status | seconds | headline |")
print("|---|---|---:|---|")
for line in (out / "steps.tsv").read_text().splitlines():
    name, status, seconds, note = (line.split("\t") + [""] * 4)[:4]
    try:
        head = HEADLINES.get(name, lambda: "")()
    except Exception as e:  # a figure missing from a partial result: say so, keep the table
        head = f"(no headline: {type(e).__name__})"
    if not head and status.startswith(("FAILED", "TIMEOUT")):  # why it failed: the last line of its stderr
        head = last_line(f"{name}.err") or last_line(*(p.name for p in sorted(out.glob(f"{name}-*.err"), key=os.path.getmtime)))
        head = f"stderr: {head}" if head else ""
    if not head:
        head = last_line(f"{name}.out")  # e.g. "no GPU: skipped"
    cell = "; ".join(x for x in (note, head) if x).replace("|", "\\|")  # a | from a log: not a new column
    print(f"| {name} | {status} | {seconds} | {cell} |")
PYEOF
echo
echo "gpu_session: stage $STAGE, $((SECONDS - T0)) s, results in $OUT (exit $status)"
cat "$OUT/summary.md"
exit $status
