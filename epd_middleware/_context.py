"""What one intercepted request carries through the stages besides its body: the transport, its id, the
host it runs in, where its embeddings go, and who chose its servers."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

from ._blame import Ledger
from ._logs import logger
from ._protocol import REQUEST_ID_HEADER
from ._scheduler import NO_ROUTE, Route
from ._scheduling import NO_SCHEDULING, Scheduling
from .host import Host
from .transport import Transport

__all__ = ["RequestContext"]

_REQUEST_ID = REQUEST_ID_HEADER.decode()


@dataclass(frozen=True, slots=True)
class RequestContext:
    """One request's context (:meth:`~epd_middleware._pipeline.Pipeline.context` makes it)."""

    transport: Transport
    request_id: str
    host: Host = field(default_factory=Host)
    # The Authorization header of its calls to encoders and prefill servers (None: none).
    authorization: str | None = None
    # Mooncake push: the ZMQ address encoders push this request's embeddings to.
    push_to: str | None = None
    # The data-parallel rank the engine request is pinned to, so that the engine behind push_to runs it.
    pin_rank: bytes | None = None
    # The encoders and prefill server a scheduler chose for this request (empty: the pools decide).
    route: Route = NO_ROUTE
    # Encode every item again, reusing nothing (an engine retry: what it was given did not work).
    fresh: bool = False
    # The priority and session id its calls carry, as vLLM reads them from the request.
    scheduling: Scheduling = NO_SCHEDULING
    # Its failed calls, judged together: who is at fault for each (_blame.py).
    ledger: Ledger = field(default_factory=Ledger)

    @property
    def logged(self) -> bool:
        """Whether the request gets its INFO line: where the host says so (the log_requests option,
        inside vLLM by default its --enable-log-requests) and the logger lets INFO through."""
        return self.host.log_requests and logger.isEnabledFor(logging.INFO)

    def again(self) -> RequestContext:
        """The context of an engine retry: nothing the first attempt got is reused."""
        return dataclasses.replace(self, fresh=True)

    def call_headers(self, suffix: str) -> dict[str, str]:
        """The headers of one call: the request id with ``suffix`` (E and PD logs join on it), the key,
        the request's priority and session id."""
        headers = {_REQUEST_ID: f"{self.request_id}-{suffix}"}
        if self.authorization is not None:
            headers["authorization"] = self.authorization
        headers.update(self.scheduling.headers)
        return headers
