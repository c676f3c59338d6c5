"""epd-middleware: encoder disaggregation for multimodal vLLM serving, inside the PD server.

``app.add_middleware(EPDMiddleware, encoders=["http://enc-0:8001"])``
"""

from .config import EPDConfig
from .errors import (
    BodyTooLarge,
    EPDError,
    UpstreamBadReply,
    UpstreamError,
    UpstreamRejected,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from .middleware import EPDMiddleware

__all__ = [
    "BodyTooLarge",
    "EPDConfig",
    "EPDError",
    "EPDMiddleware",
    "UpstreamBadReply",
    "UpstreamError",
    "UpstreamRejected",
    "UpstreamStatusError",
    "UpstreamTimeout",
    "UpstreamUnavailable",
]

__version__ = "0.1.0"
