"""epd-middleware: encoder disaggregation for multimodal vLLM serving, inside the PD server.

``app.add_middleware(EPDMiddleware, encoders=["http://enc-0:8001"])``

The public names are the ones here, plus the modules ``config`` (the options), ``errors`` (what clients
are answered), ``transport`` (the network, as a test or a custom client injects it), ``host`` (what the
server says about itself), ``vllm_plugin`` (the ``epd`` entry point) and ``cli``. Modules whose names
start with ``_`` are the implementation, free to change between releases.
"""

from ._middleware import EPDMiddleware
from ._version import __version__ as __version__
from .config import EPDConfig
from .errors import (
    BodyTooLarge,
    EPDError,
    StartupFailed,
    UpstreamBadReply,
    UpstreamError,
    UpstreamRejected,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from .host import Host
from .transport import (
    Body,
    ConnectFailed,
    ConnectionLost,
    HTTPError,
    HttpxTransport,
    Transport,
    UnsendableRequest,
)

__all__ = [
    "Body",
    "BodyTooLarge",
    "ConnectFailed",
    "ConnectionLost",
    "EPDConfig",
    "EPDError",
    "EPDMiddleware",
    "HTTPError",
    "Host",
    "HttpxTransport",
    "StartupFailed",
    "Transport",
    "UnsendableRequest",
    "UpstreamBadReply",
    "UpstreamError",
    "UpstreamRejected",
    "UpstreamStatusError",
    "UpstreamTimeout",
    "UpstreamUnavailable",
]
