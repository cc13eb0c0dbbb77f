# ci-base: a stand-in for python:3.11-slim-bookworm built from Debian packages only, for `make test-images`
# on machines that reach package mirrors but no container registry. Its FROM is a Debian root filesystem
# made by debootstrap and imported (images/build.py --ci-base does both). Python lives in a venv on PATH,
# as /usr/local does in the official image, so the project's Dockerfiles run their `pip install` unchanged.
# Python's headers, which the official image ships too: the CUDA images compile Triton's launchers and
# DeepSpeed's JIT ops against them.
ARG BASE_IMAGE=localhost/debian:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv libpython3-dev ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/python
ENV PATH=/opt/python/bin:$PATH
