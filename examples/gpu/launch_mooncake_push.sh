#!/usr/bin/env bash
# Mooncake push: N encoders push embeddings straight into the PD (ECMooncakeConnector) instead of a
# shared directory. The middleware in PD derives the address encoders push to from PD's own
# --ec-transfer-config (ec_ip, ec_port, data-parallel rank); set EPD_EC_CONSUMER_ZMQ to override.
#   MODEL=Qwen/Qwen2.5-VL-3B-Instruct HOST_IP=10.0.0.5 NUM_ENCODERS=2 bash examples/gpu/launch_mooncake_push.sh
# Needs the mooncake-transfer-engine package (pip install mooncake-transfer-engine) and RDMA (or
# MOONCAKE_PROTOCOL=tcp).
set -euo pipefail
MODEL="${MODEL:-Qwen/Qwen2.5-VL-3B-Instruct}"
HOST_IP="${HOST_IP:?set HOST_IP to the address encoders reach this PD at}"
NUM_ENCODERS="${NUM_ENCODERS:-1}"
PROTOCOL="${MOONCAKE_PROTOCOL:-rdma}"
ec_config() {
  printf '{"ec_connector":"ECMooncakeConnector","ec_role":"%s","ec_ip":"%s","ec_port":%d,"ec_buffer_size":4e9,"ec_connector_extra_config":{"mooncake_protocol":"%s"}}' \
    "$1" "$2" "$3" "$PROTOCOL"
}

pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; wait' EXIT INT TERM
encoders=()
for ((i = 0; i < NUM_ENCODERS; i++)); do
  CUDA_VISIBLE_DEVICES=$((i + 1)) vllm serve "$MODEL" --port $((8001 + i)) \
    --mm-encoder-only --no-enable-prefix-caching --trust-request-mm-kwargs \
    --ec-transfer-config "$(ec_config ec_producer "$HOST_IP" $((15100 + i)))" &
  pids+=($!)
  encoders+=("http://127.0.0.1:$((8001 + i))")
done

# The consumer's control socket listens on ec_ip:ec_port (+ rank x TP size per data-parallel rank).
CUDA_VISIBLE_DEVICES=0 VLLM_PLUGINS=epd EPD_ENCODERS="$(IFS=,; echo "${encoders[*]}")" \
  vllm serve "$MODEL" --port 8000 --trust-request-mm-kwargs \
  --ec-transfer-config "$(ec_config ec_consumer "$HOST_IP" 14579)" &
pids+=($!)
wait -n "${pids[@]}"
