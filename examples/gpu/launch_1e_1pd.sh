#!/usr/bin/env bash
# One encoder (GPU 0) + one PD (GPU 1) with epd-middleware, ECExampleConnector on a shared directory.
# Clients talk to PD on :8000 with ordinary OpenAI chat requests.
#   MODEL=Qwen/Qwen2.5-VL-3B-Instruct bash examples/gpu/launch_1e_1pd.sh
set -euo pipefail
MODEL="${MODEL:-Qwen/Qwen2.5-VL-3B-Instruct}"
EC_DIR="${EC_DIR:-/dev/shm/epd-ec-cache}"
source "$(dirname "$0")/ec_cache.sh"  # EC_DIR fills with embeddings: swept while running, emptied at exit
ec_cache_start
ec_config() { printf '{"ec_connector":"ECExampleConnector","ec_role":"%s","ec_connector_extra_config":{"shared_storage_path":"%s"}}' "$1" "$EC_DIR"; }

# The same MODEL string, served name and hasher on E and PD: the hash vLLM derives from a uuid and the
# per-request options includes the model argument. --trust-request-mm-kwargs on every instance that
# receives mm_processor_kwargs / media_io_kwargs. The encoder's flags, and why no --gpu-memory-utilization
# on a GPU of its own: docs/deployment.md, "The encoder command".
CUDA_VISIBLE_DEVICES=0 vllm serve "$MODEL" --port 8001 \
  --mm-encoder-only --no-enable-prefix-caching --trust-request-mm-kwargs \
  --ec-transfer-config "$(ec_config ec_producer)" &
ENC=$!

CUDA_VISIBLE_DEVICES=1 VLLM_PLUGINS=epd EPD_ENCODERS=http://127.0.0.1:8001 EPD_ENCODER_TIMEOUT=60 \
  vllm serve "$MODEL" --port 8000 --trust-request-mm-kwargs \
  --ec-transfer-config "$(ec_config ec_consumer)" &
PD=$!

trap 'kill $ENC $PD 2>/dev/null || true; ec_cache_stop' EXIT INT TERM
wait -n $ENC $PD
