# Sourced (bash) by gpu_check.sh: what every run on a bare, air-gapped GPU node starts
# with. Expects $PY (the node's python) and the checkout's root as the working directory.
#
#   gpu_env_install NAME WHEELS_DIR   install WHEELS_DIR/*.whl into a scratch folder ($GPU_ENV_SITE, removed
#                                     when the calling script exits) with --no-index --no-deps, so that the
#                                     node's own torch, transformers and accelerate are used as they are;
#                                     export PYTHONPATH (this checkout's src/ first, then the wheels) and the
#                                     offline switches. A folder with no wheels is a warning; a wheel pip
#                                     cannot install ends the calling script: "NAME: installing the wheels in
#                                     WHEELS_DIR failed", exit 2.
#   gpu_env_report FILE               write the environment (wheels installed, date, versions, GPU) to FILE
#                                     and print it.
#   gpu_env_has_cuda FILE             whether the report in FILE found a CUDA GPU.

gpu_env_install() {
  local name=$1 wheels=$2
  GPU_ENV_SITE=$(mktemp -d "${TMPDIR:-/tmp}/gpu-env-site.XXXXXX")
  # shellcheck disable=SC2064  # expand now: the folder of this call
  trap "rm -rf '$GPU_ENV_SITE'" EXIT
  if compgen -G "$wheels/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$GPU_ENV_SITE" "$wheels"/*.whl \
      || { echo "$name: installing the wheels in $wheels failed" >&2; exit 2; }
  else
    echo "$name: no wheels in $wheels: TRL's side of the benchmark and the DeepSpeed tests will be skipped" >&2
  fi
  export PYTHONPATH="$PWD/src:$GPU_ENV_SITE${PYTHONPATH:+:$PYTHONPATH}"
  export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
}

gpu_env_report() {
  local file=$1
  GPU_CHECK_SITE=$GPU_ENV_SITE "$PY" - >"$file" 2>&1 <<'PYEOF'
import datetime, importlib, importlib.metadata, os, platform
import torch
carried = sorted(f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions(path=[os.environ["GPU_CHECK_SITE"]]))
print("wheels installed from the folder:", ", ".join(carried) or "none")
print("date:", datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
print("python:", platform.python_version())
for name in ("torch", "transformers", "accelerate", "peft", "trl", "datasets", "deepspeed", "vllm"):
    try:
        print(f"{name}: {importlib.import_module(name).__version__}")
    except Exception as e:  # absent, or broken against the node's torch: say which
        print(f"{name}: not available ({type(e).__name__})")
print("cuda:", torch.version.cuda, "available:", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"gpu: {p.name}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs")
PYEOF
  cat "$file"
}

gpu_env_has_cuda() {
  grep -q "available: True" "$1" 2>/dev/null
}
