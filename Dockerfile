# horovod_sbc image. CPU by default; one source of truth: it runs the same scripts/install.sh as
# `make install`, `make test` and CI.
#
#   docker build -t horovod_sbc .                                   # CPU: MPI + Gloo
#   docker build -t horovod_sbc:cuda --build-arg CUDA=1 \
#       --build-arg BASE=nvidia/cuda:12.6.3-cudnn-devel-ubuntu24.04 .   # GPU: + NCCL
#   docker run --rm horovod_sbc make demo
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE}
ARG CUDA=0
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends \
        make g++ git ca-certificates python3 python3-venv python3-dev \
        libopenmpi-dev openmpi-bin iproute2 && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/horovod_sbc
COPY . .
# CUDA=1: a CUDA build of torch and TensorFlow, and Horovod with NCCL for GPU collectives.
RUN if [ "$CUDA" = "1" ]; then \
        export TORCH_SPEC="torch==2.13.0" TF_SPEC="tensorflow==2.21.0" HOROVOD_GPU_OPERATIONS=NCCL; \
    fi; \
    PYTHON=python3 bash scripts/install.sh
ENV PATH=/opt/horovod_sbc/.venv/bin:$PATH
CMD ["make", "demo"]
