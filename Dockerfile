# One image for the API, the worker and the one-shot migration.
# LLMQ_EXTRAS=gpu (default here) installs the CUDA vLLM; use cpu for a CPU-only worker.
FROM python:3.11-slim
ARG LLMQ_EXTRAS=gpu
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /srv/llmq
COPY pyproject.toml README.md alembic.ini ./
COPY app app
COPY worker worker
COPY migrations migrations
COPY scripts scripts
RUN python -m venv .venv && LLMQ_EXTRAS=${LLMQ_EXTRAS} bash scripts/install.sh
ENV PATH=/srv/llmq/.venv/bin:$PATH
EXPOSE 8000
CMD ["llmq", "api"]
