"""The package's logger, and its place in vLLM's logging when the middleware runs inside vLLM."""

from __future__ import annotations

import logging
import sys

__all__ = ["adopt_vllm_logging", "logger"]

logger = logging.getLogger("epd_middleware")


def adopt_vllm_logging() -> None:
    """Inside a vLLM server, write through vLLM's own handlers and level.

    vLLM configures its ``vllm`` logger with its handlers and no propagation, so records of other
    libraries' loggers never reach its output; without this the middleware's INFO and WARNING lines would
    be lost. Does nothing outside vLLM or where the application configured this logger itself.
    """
    if "vllm" not in sys.modules or logger.handlers:
        return
    vllm_logger = logging.getLogger("vllm")
    if not vllm_logger.handlers:
        return
    for handler in vllm_logger.handlers:
        logger.addHandler(handler)
    logger.setLevel(vllm_logger.level or logging.INFO)
    logger.propagate = False
