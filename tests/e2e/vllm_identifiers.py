"""Run with vLLM's python: reads cases as JSON on stdin, prints the identifier vLLM's own code gives each
(``ProcessorInputs.get_mm_hashes``, with ``merge_media_io_kwargs`` for the server's options)."""

from __future__ import annotations

import json
import sys
from typing import Any

from vllm.multimodal.media.connector import merge_media_io_kwargs
from vllm.multimodal.parse import (
    AudioProcessorItems,
    ImageProcessorItems,
    MultiModalDataItems,
    VideoProcessorItems,
)
from vllm.multimodal.processing.inputs import ProcessorInputs

ITEMS = {"image": ImageProcessorItems, "video": VideoProcessorItems, "audio": AudioProcessorItems}


def identifier(case: dict[str, Any]) -> str | None:
    fields, modality = case["fields"], case["modality"]
    try:
        merged = merge_media_io_kwargs(case["server_media_io"] or None, fields.get("media_io_kwargs")) or {}
        inputs = ProcessorInputs(
            prompt=[],
            mm_data_items=MultiModalDataItems({modality: ITEMS[modality]([None])}),
            mm_uuid_items={modality: [case["uuid"]]},
            hf_processor_mm_kwargs=fields.get("mm_processor_kwargs") or {},
            media_io_kwargs=merged,
        )
        result: str = inputs.get_mm_hashes(case["model"], case["algorithm"])[modality][0]
    except Exception:
        return None
    return result


if __name__ == "__main__":
    json.dump([identifier(case) for case in json.load(sys.stdin)], sys.stdout)
