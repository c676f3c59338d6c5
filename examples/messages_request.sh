#!/usr/bin/env bash
# An Anthropic Messages request with an image, sent to a PD (or D) that runs epd-middleware. The image is
# encoded on the remote encoders exactly as vLLM will hash it; nothing in the request is EPD-specific.
#   URL=http://127.0.0.1:8000 MODEL=tiny-qwen2-vl IMAGE=cat.png bash examples/messages_request.sh
set -euo pipefail
URL="${URL:-http://127.0.0.1:8000}"
MODEL="${MODEL:-tiny-qwen2-vl}"
IMAGE="${IMAGE:?set IMAGE to a PNG file}"
DATA=$(base64 -w0 "$IMAGE")
curl -sS "$URL/v1/messages" -H 'content-type: application/json' ${VLLM_API_KEY:+-H "authorization: Bearer $VLLM_API_KEY"} \
  -d @- <<JSON
{"model": "$MODEL", "max_tokens": 64, "temperature": 0,
 "messages": [{"role": "user", "content": [
   {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "$DATA"}},
   {"type": "text", "text": "Describe this image in one sentence."}]}]}
JSON
echo
