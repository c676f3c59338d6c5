#!/usr/bin/env bash
# N encoders + M PD servers on one node, one GPU each (GPUs 0..N-1 encode, N..N+M-1 serve), every PD
# spreading its media over all encoders. Put any HTTP load balancer in front of the PD ports.
#   N_ENC=2 N_PD=2 MODEL=Qwen/Qwen2.5-VL-3B-Instruct bash examples/gpu/launch_ne_mpd.sh
set -euo pipefail
MODEL="${MODEL:-Qwen/Qwen2.5-VL-3B-Instruct}"
N_ENC="${N_ENC:-2}"
N_PD="${N_PD:-2}"
EC_DIR="${EC_DIR:-/dev/shm/epd-ec-cache}"
API_KEY="${VLLM_API_KEY:-}"
source "$(dirname "$0")/ec_cache.sh"  # EC_DIR fills with embeddings: swept while running, emptied at exit
ec_cache_start
ec_config() { printf '{"ec_connector":"ECExampleConnector","ec_role":"%s","ec_connector_extra_config":{"shared_storage_path":"%s"}}' "$1" "$EC_DIR"; }

pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; ec_cache_stop' EXIT INT TERM
encoders=()
for ((i = 0; i < N_ENC; i++)); do
  port=$((8100 + i))
  CUDA_VISIBLE_DEVICES=$i vllm serve "$MODEL" --port "$port" \
    --mm-encoder-only --no-enable-prefix-caching --trust-request-mm-kwargs \
    --ec-transfer-config "$(ec_config ec_producer)" &
  pids+=($!)
  encoders+=("http://127.0.0.1:$port")
done
EPD_ENCODERS=$(IFS=,; echo "${encoders[*]}")

for ((j = 0; j < N_PD; j++)); do
  port=$((8000 + j))
  # With VLLM_API_KEY set, the plugin sits inside vLLM's key check: no encoder work without the key.
  CUDA_VISIBLE_DEVICES=$((N_ENC + j)) VLLM_PLUGINS=epd EPD_ENCODERS="$EPD_ENCODERS" VLLM_API_KEY="$API_KEY" \
    vllm serve "$MODEL" --port "$port" --trust-request-mm-kwargs \
    --ec-transfer-config "$(ec_config ec_consumer)" &
  pids+=($!)
done

wait -n "${pids[@]}"
