#!/bin/sh
# The CUDA stack of the train and eval images, from PyPI only: PyPI's CUDA 13 build of torch, the CUDA
# compiler of the same CUDA release, and vLLM. Both Dockerfiles run it as the same instruction after the same
# ones, so the two images share this layer (~10 GB): a registry stores it once and a node pulls it once.
# Run from /opt/rloo, where constraints.txt, constraints-vllm.txt and images/merge_constraints.py lie.
set -eu

# constraints.txt with vLLM's pins in place of its own, minus torch (installed alone, below)
python3 images/merge_constraints.py constraints.txt constraints-vllm.txt --drop torch > /tmp/constraints.txt

# "torch===X", exactly PyPI's build of the pin, which is the CUDA 13 one: "torch==X" also matches a local
# build "X+cpu" or "X+cu126" that a mirror or find-links directory offers, and that one sorts higher, so pip
# would take it, and vLLM's kernels would not load against it.
torch=$(sed -n 's/^torch==//p' constraints.txt)
pip install -c /tmp/constraints.txt "torch===$torch"

# nvcc and the CUDA headers of the CUDA release torch was built with (its cuda-toolkit pin): what DeepSpeed's
# and FlashInfer's ops compile with when they are first used (nothing here is compiled ahead of time).
cuda=$(python3 -c 'from importlib.metadata import version; print(version("cuda-toolkit"))')
pip install -c /tmp/constraints.txt "cuda-toolkit[nvcc,cccl]==$cuda"

vllm=$(sed -n 's/^vllm==//p' constraints-vllm.txt)
pip install -c /tmp/constraints.txt "vllm==$vllm"

# The wheels' CUDA tree (nvidia/cu13: bin/nvcc, include, lib) as /usr/local/cuda, where
# torch.utils.cpp_extension looks for CUDA_HOME when nvcc is not on PATH. The linker wants the unversioned
# names of the libraries that the JIT ops link (-lcudart, -lcurand); the wheels ship only the versioned ones.
site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
ln -s "$site/nvidia/cu13" /usr/local/cuda
for lib in cudart curand; do
    versioned=$(cd /usr/local/cuda/lib && ls "lib$lib.so."* | sort | head -n 1)
    ln -sf "$versioned" "/usr/local/cuda/lib/lib$lib.so"
done

# a CPU or other-CUDA torch that slipped in (a dependency asking for another version) fails the build here;
# the installed version is the wheel's (torch.__version__ of PyPI's wheel says "+cu130" all the same)
python3 - "$torch" <<'EOF'
import sys
from importlib.metadata import version

import torch

cuda = torch.version.cuda or ""
if version("torch") != sys.argv[1] or not cuda.startswith("13."):
    sys.exit(f"torch {version('torch')} (CUDA {cuda or 'none'}) is not PyPI's CUDA 13 build of {sys.argv[1]}")
EOF
rm /tmp/constraints.txt
