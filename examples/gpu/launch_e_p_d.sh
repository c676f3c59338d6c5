#!/usr/bin/env bash
# Remote prefill: N encoders (E) + one prefill server (P) + one decoder (D) with epd-middleware in D.
# E and P share an EC directory; P and D move the KV cache with NIXL. Clients talk to D on :8000.
#   MODEL=Qwen/Qwen2.5-VL-3B-Instruct NUM_ENCODERS=1 bash examples/gpu/launch_e_p_d.sh
# NUM_ENCODERS=0 gives plain P/D: the middleware only adds the prefill step and P encodes the media.
set -euo pipefail
MODEL="${MODEL:-Qwen/Qwen2.5-VL-3B-Instruct}"
NUM_ENCODERS="${NUM_ENCODERS:-1}"
EC_DIR="${EC_DIR:-/dev/shm/epd-ec-cache}"
source "$(dirname "$0")/ec_cache.sh"  # EC_DIR fills with embeddings: swept while running, emptied at exit
ec_cache_start
ec_config() { printf '{"ec_connector":"ECExampleConnector","ec_role":"%s","ec_connector_extra_config":{"shared_storage_path":"%s"}}' "$1" "$EC_DIR"; }
KV_CONFIG='{"kv_connector":"NixlConnector","kv_role":"kv_both"}'

pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; ec_cache_stop' EXIT INT TERM

encoders=()
for ((i = 0; i < NUM_ENCODERS; i++)); do
  CUDA_VISIBLE_DEVICES=$((i + 2)) vllm serve "$MODEL" --port $((8001 + i)) \
    --mm-encoder-only --no-enable-prefix-caching --trust-request-mm-kwargs \
    --ec-transfer-config "$(ec_config ec_producer)" &
  pids+=($!)
  encoders+=("http://127.0.0.1:$((8001 + i))")
done
EC_ARGS=()
if ((NUM_ENCODERS > 0)); then EC_ARGS=(--ec-transfer-config "$(ec_config ec_consumer)"); fi

# P: an EC consumer (it loads the embeddings) and a KV producer. VLLM_NIXL_SIDE_CHANNEL_PORT must
# differ between P and D on one host.
CUDA_VISIBLE_DEVICES=0 VLLM_NIXL_SIDE_CHANNEL_PORT=5600 vllm serve "$MODEL" --port 8100 \
  --trust-request-mm-kwargs "${EC_ARGS[@]}" --kv-transfer-config "$KV_CONFIG" &
pids+=($!)

# D: the middleware encodes on E, prefills on P, and D decodes from P's KV cache.
CUDA_VISIBLE_DEVICES=1 VLLM_NIXL_SIDE_CHANNEL_PORT=5601 VLLM_PLUGINS=epd \
  EPD_ENCODERS="$(IFS=,; echo "${encoders[*]}")" EPD_PREFILL=http://127.0.0.1:8100 \
  vllm serve "$MODEL" --port 8000 --trust-request-mm-kwargs \
  "${EC_ARGS[@]}" --kv-transfer-config "$KV_CONFIG" &
pids+=($!)

wait -n "${pids[@]}"
