#!/usr/bin/env bash
# E + P + D on the CPU build of vLLM with the tiny local Qwen2-VL, as tests/e2e runs it: the EC and KV
# ExampleConnectors (shared directories) are the connectors that run on CPU. Clients talk to D on :8000
# with chat completions or Anthropic Messages.
#   VLLM_PY=$(bash scripts/setup-vllm-cpu.sh | tail -n 1) bash examples/cpu/launch_e_p_d.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
VLLM_PY="${VLLM_PY:?set VLLM_PY to the python of a vLLM install (scripts/setup-vllm-cpu.sh prints one)}"
"$VLLM_PY" -m pip install -q --no-deps -e .
MODEL=$("$VLLM_PY" -c 'from pathlib import Path; from epd_lab.servers import ensure_tiny_model; import sys; print(ensure_tiny_model(sys.executable, Path.home() / ".cache/epd-middleware"))')
# The connectors never delete what they write (embeddings, KV caches): a directory this script made is
# removed when it ends; one given as DIR is left to its owner.
MADE=""
if [ -z "${DIR:-}" ]; then DIR=$(mktemp -d); MADE=$DIR; fi
mkdir -p "$DIR/ec" "$DIR/kv"
ec() { printf '{"ec_connector":"ECExampleConnector","ec_role":"%s","ec_connector_extra_config":{"shared_storage_path":"%s/ec"}}' "$1" "$DIR"; }
kv() { printf '{"kv_connector":"ExampleConnector","kv_role":"%s","kv_connector_extra_config":{"shared_storage_path":"%s/kv"}}' "$1" "$DIR"; }
export VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 VLLM_CPU_OMP_THREADS_BIND=nobind
COMMON=(--served-model-name tiny-qwen2-vl --dtype float32 --max-model-len 2048 --enforce-eager
  --limit-mm-per-prompt '{"image":4,"video":0}' --trust-request-mm-kwargs)
serve() { "$VLLM_PY" -m vllm.entrypoints.cli.main serve "$MODEL" "${COMMON[@]}" "$@"; }

pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; wait || true; if [ -n "$MADE" ]; then rm -rf "$DIR"; fi' EXIT INT TERM
serve --port 8001 --no-enable-prefix-caching --ec-transfer-config "$(ec ec_producer)" &
pids+=($!)
serve --port 8100 --ec-transfer-config "$(ec ec_consumer)" --kv-transfer-config "$(kv kv_producer)" &
pids+=($!)
VLLM_PLUGINS=epd EPD_ENCODERS=http://127.0.0.1:8001 EPD_PREFILL=http://127.0.0.1:8100 \
  serve --port 8000 --ec-transfer-config "$(ec ec_consumer)" --kv-transfer-config "$(kv kv_consumer)" &
pids+=($!)
echo "E :8001, P :8100, D :8000 (storage under $DIR)"
wait -n "${pids[@]}"
