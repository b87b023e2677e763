# swarm-node: one image for the bootstrap peer and the training nodes.
#
#   docker build -t swarm-node .                                   # CPU (default)
#   docker build -t swarm-node:cuda --build-arg TORCH_VARIANT=cu126 .   # CUDA 12.6 wheels
#
# The CUDA variant bundles CUDA's runtime libraries in the torch wheel; the host needs
# the NVIDIA driver and container toolkit (`docker run --gpus all ...`).
ARG BASE_IMAGE=python:3.13-slim
FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, from PyTorch's index for the chosen variant: a plain `pip install torch`
# would pull the several-GB default CUDA build into the CPU image.
RUN pip install "torch==${TORCH_VERSION}" --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}"

WORKDIR /app
COPY pyproject.toml setup.py README.md ./
COPY swarm_node ./swarm_node
COPY bootstrap ./bootstrap
COPY examples ./examples
RUN pip install . && swarm-node --help > /dev/null && swarm-bootstrap --help > /dev/null

# Keys, checkpoints and runs live in volumes, never in the image; run as a plain user.
RUN useradd --create-home --uid 1000 swarm && mkdir -p /identity /state /shared \
    && chown swarm:swarm /identity /state /shared
USER swarm
WORKDIR /state

# 31337: libp2p (open it for volunteers); 8080: status, /healthz, /metrics.
EXPOSE 31337 8080
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('SWARM_HTTP_PORT', '8080') + '/healthz', timeout=4)"]
CMD ["swarm-node", "--help"]
