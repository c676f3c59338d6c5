"""Build a tiny random-weight Qwen2-Audio checkpoint offline, in seconds (run with the vLLM python).

    python -m epd_lab.tiny_audio_model OUT_DIR

The audio counterpart of :mod:`epd_lab.tiny_model`: the same byte-level BPE tokenizer with Qwen2-Audio's
special tokens (``<|audio_bos|><|AUDIO|><|audio_eos|>`` per audio part in the chat template), a Whisper
feature extractor (128 mel bins, 16 kHz, 30 s windows), a 2-layer audio encoder (d_model 64) and the
2-layer Qwen2 text model of the image model (hidden 128, head_dim 64). Greedy decoding of random weights
is deterministic, so deployments compare for exact equality.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from epd_lab.tiny_model import tokenizer

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
    "<|AUDIO|>",
]

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'audio' or 'audio' in content or 'audio_url' in content %}"
    "<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build(out: Path) -> Path:
    import torch
    from transformers import (
        Qwen2AudioConfig,
        Qwen2AudioForConditionalGeneration,
        Qwen2AudioProcessor,
        WhisperFeatureExtractor,
    )

    out.mkdir(parents=True, exist_ok=True)
    fast, ids, vocab_size = tokenizer(SPECIAL_TOKENS, CHAT_TEMPLATE)
    features = WhisperFeatureExtractor(
        feature_size=128, sampling_rate=16000, hop_length=160, chunk_length=30, n_fft=400
    )
    processor = Qwen2AudioProcessor(feature_extractor=features, tokenizer=fast, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out)
    fast.save_pretrained(out)
    config = Qwen2AudioConfig(
        audio_config={
            "model_type": "qwen2_audio_encoder",
            "d_model": 64,
            "encoder_layers": 2,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 128,
            "num_mel_bins": 128,
            "max_source_positions": 1500,
        },
        text_config={
            "model_type": "qwen2",
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "vocab_size": vocab_size,
            "max_position_embeddings": 4096,
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
        },
        audio_token_index=ids["<|AUDIO|>"],
        tie_word_embeddings=False,
    )
    config.architectures = ["Qwen2AudioForConditionalGeneration"]
    torch.manual_seed(0)
    model = Qwen2AudioForConditionalGeneration(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    _checkpoint_names_vllm_reads(out / "model.safetensors")
    generation = {"do_sample": False, "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return out


def _checkpoint_names_vllm_reads(path: Path) -> None:
    """transformers 5 writes the text model's weights as ``language_model.model.model.*``; vLLM 0.32's
    Qwen2-Audio loader reads the published checkpoints' ``language_model.model.*`` (and fails on the
    other with "There is no module or parameter named 'model' in Qwen2Model")."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    renamed = {
        name.replace("language_model.model.model.", "language_model.model."): t for name, t in tensors.items()
    }
    save_file(renamed, str(path), metadata={"format": "pt"})


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m epd_lab.tiny_audio_model OUT_DIR")
    print(build(Path(sys.argv[1])))
