# rloo-train, CPU flavour (tag suffix -cpu): CPU torch and '.[train,eval,tracking,kfp]', no CUDA, DeepSpeed or
# vLLM. Runs the train and evaluate steps on a CPU cluster (kind, minikube) and in `make test-images`: compile
# with RLOO_IMAGE_TRAIN and RLOO_IMAGE_EVAL both naming it. Build: python images/build.py train-cpu
ARG BASE_IMAGE=python:3.11.7-slim-bookworm
FROM ${BASE_IMAGE}

# Behind a mirror or proxy: as in images/slim/Dockerfile.
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_TRUSTED_HOST
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
WORKDIR /opt/rloo
COPY pyproject.toml constraints.txt ./
# Dependencies first, installed for a stand-in of the package (its pyproject, an empty module and README): a
# change to the code or the README rebuilds only the small layers after them, not torch's.
RUN --mount=type=secret,id=pip_ca \
    if [ -s /run/secrets/pip_ca ]; then export PIP_CERT=/run/secrets/pip_ca; fi \
    && pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$(grep '^torch==' constraints.txt)" \
    && mkdir -p src/rloo && touch src/rloo/__init__.py README.md \
    && pip install -c constraints.txt '.[train,eval,tracking,kfp]' \
    && pip uninstall -y rloo-kfp && rm -rf build src README.md
COPY configs ./configs
COPY README.md ./
COPY src ./src
RUN --mount=type=secret,id=pip_ca \
    if [ -s /run/secrets/pip_ca ]; then export PIP_CERT=/run/secrets/pip_ca; fi \
    && pip install --no-deps . && rm -rf build src/*.egg-info

RUN useradd --create-home --uid 1000 rloo
USER 1000
ENV HOME=/home/rloo HF_HOME=/home/rloo/.cache/huggingface
# matplotlib (the training plots) caches under HOME, which a read-only root filesystem refuses
ENV MPLCONFIGDIR=/tmp/matplotlib
