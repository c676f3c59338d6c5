"""Build the tiny random-weight Qwen2-VL checkpoint offline, in seconds (run with the vLLM python).

    python -m epd_lab.tiny_model OUT_DIR

Greedy decoding of random weights is deterministic, so two deployments of this model can be compared for
exact equality. The facts that make vLLM 0.32 CPU accept it are in docs/vllm-cpu.md: text
head_dim 64 (16 fails on the CPU attention backend), mrope_section [8, 12, 12], patch 14, merge 2,
temporal patch 2, and max_pixels 200704, which gives the 800x600 test image 234 image tokens by default
and 54 with ``size={"shortest_edge": 3136, "longest_edge": 50176}``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

WORDS = """the a an and or of in on at to with for from by is are was were be been this that these those
image picture photo describe objects object colors color red green blue yellow white black orange purple
square squares circle shape shapes small large big one two three four five short sentence there here it
its they them what which who where when how many some all each left right top bottom middle corner
background foreground dark light bright see shows showing contains containing scene view close near far
above below beside next between inside outside around over under my your our their his her assistant
user system you i we he she me us him please answer question yes no not very more most less few
""".split()  # noqa: SIM905 (a word list reads better as text)


def corpus() -> list[str]:
    lines = [" ".join(WORDS[i : i + 12]) for i in range(0, len(WORDS), 12)]
    lines += [f"{a} {b} {c}" for a, b, c in zip(WORDS, WORDS[7:], WORDS[13:], strict=False)]
    return lines * 4


def tokenizer(special_tokens: list[str], chat_template: str) -> tuple[Any, dict[str, int], int]:
    """A byte-level BPE trained on :func:`corpus` with these special tokens (the first is the pad token,
    ``<|im_end|>`` the end of a turn): the fast tokenizer, the special tokens' ids, and a vocabulary size
    rounded up to a multiple of 64."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token=special_tokens[0],
        additional_special_tokens=special_tokens[1:],
    )
    fast.chat_template = chat_template
    ids = {token: bpe.token_to_id(token) for token in special_tokens}
    return fast, ids, (bpe.get_vocab_size() + 63) // 64 * 64


def build(out: Path) -> Path:
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    out.mkdir(parents=True, exist_ok=True)
    fast, ids, vocab_size = tokenizer(SPECIAL_TOKENS, CHAT_TEMPLATE)
    fast.save_pretrained(out)
    config = Qwen2VLConfig(
        text_config={
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "vocab_size": vocab_size,
            "max_position_embeddings": 4096,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1000000.0,
                "mrope_section": [8, 12, 12],
            },
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
        },
        vision_config={
            "depth": 2,
            "embed_dim": 32,
            "num_heads": 2,
            "mlp_ratio": 2,
            "hidden_size": 128,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    config.architectures = ["Qwen2VLForConditionalGeneration"]
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)

    processor = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "rescale_factor": 1 / 255,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "min_pixels": 3136,
        "max_pixels": 200704,
        "size": {"shortest_edge": 3136, "longest_edge": 200704},
        "patch_size": 14,
        "merge_size": 2,
        "temporal_patch_size": 2,
    }
    (out / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
    generation = {"do_sample": False, "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m epd_lab.tiny_model OUT_DIR")
    print(build(Path(sys.argv[1])))
