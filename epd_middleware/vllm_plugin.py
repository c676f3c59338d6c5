"""The ``vllm.endpoint_plugins`` entry point ``epd``: loads the middleware while vLLM builds its app.

Enable with ``VLLM_PLUGINS=epd``; configure with ``EPD_*`` variables. ``attach_router`` runs before vLLM
adds its CORS and API-key middleware (``vllm/entrypoints/launchers/app.py``), and Starlette puts later
middleware outside earlier ones, so the middleware sits inside vLLM's authentication: a request without
a valid key is refused before any encoder work. ``init_state`` then checks, before the server takes
requests, that this server is an EC consumer (with encoders) and a KV consumer (with remote prefill).

vLLM is imported by vLLM, not here: the package imports without it.
"""

from __future__ import annotations

from typing import Any

from ._logs import adopt_vllm_logging, logger
from ._middleware import EPDMiddleware
from .config import EPDConfig
from .host import Host

__all__ = ["EPDPlugin", "check_keys", "check_server", "plugin"]


class EPDPlugin:
    """vLLM's ``EndpointPlugin`` protocol: ``name``, ``required_tasks``, ``attach_router``, ``init_state``."""

    name = "epd"
    required_tasks = ("generate",)

    def __init__(self) -> None:
        self.config: EPDConfig | None = None

    def attach_router(self, app: Any) -> None:
        # Read the environment here, not in __init__: vLLM logs and skips a plugin whose factory raises,
        # while an error here stops the server at start-up with the message.
        adopt_vllm_logging()
        # Added here, the middleware runs inside vLLM's API-key check, which guards /v1/*: checking the
        # key again on intercepted requests would only cost time. The status endpoint is outside /v1,
        # so it still checks the keys itself.
        config = EPDConfig.from_env().model_copy(update={"authenticate": False})
        self.config = config
        app.add_middleware(EPDMiddleware, config=config)
        logger.info(
            "epd: encoder disaggregation over %d encoder(s): %s%s%s",
            len(config.encoders),
            ", ".join(config.encoders) or "none",
            f"; remote prefill on {', '.join(config.prefill)}" if config.prefill else "",
            "; encoders and prefill servers chosen by llm-d's scheduler where its headers say"
            if config.scheduler == "llm-d"
            else "",
        )

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        host = Host.from_state(state, args=args)
        check_server(host, self.config)
        if host is None:
            return
        if self.config is not None:
            check_keys(self.config, host)
        for route in host.unguarded_routes:
            logger.warning(
                "epd: this server serves %s (--enable-scale-out / --tokens-only), which takes embedding "
                "references and transfer parameters the middleware never sees: a client there can make the "
                "engine reference an embedding that does not exist. Keep it from clients on a PD server.",
                route,
            )
        if not host.trusts_request_mm_kwargs:
            # Not fatal: deployments whose clients never send options work without it.
            logger.warning(
                "epd: this PD runs without --trust-request-mm-kwargs, so vLLM will reject requests carrying "
                "mm_processor_kwargs or media_io_kwargs after their media was encoded; start PD and every "
                "encoder with --trust-request-mm-kwargs if clients send them"
            )


def check_server(host: Host | None, config: EPDConfig | None = None) -> None:
    """Fail start-up with a clear message unless this server consumes encoder caches (EC consumer, when
    there are encoders) and KV caches (KV consumer, when there are prefill servers)."""
    if host is None or not host.inside_vllm:
        raise RuntimeError(
            "epd: the endpoint plugin needs a vLLM server with an engine (no vllm_config found)"
        )
    if config is not None and config.prefill and host.kv_role not in ("kv_consumer", "kv_both"):
        raise RuntimeError(
            f"epd: EPD_PREFILL is set, so this server decodes what the prefill servers computed, but its "
            f"kv_role is {host.kv_role!r}; start it with --kv-transfer-config "
            '\'{"kv_connector": ..., "kv_role": "kv_consumer", ...}\''
        )
    if config is not None and not config.encoders and config.scheduler == "none":
        return  # P/D only: no encoder will ever be called
    if host.ec_connector is None:
        raise RuntimeError(
            "epd: this server has no --ec-transfer-config; the middleware belongs on the PD server, started "
            'with --ec-transfer-config \'{"ec_connector": ..., "ec_role": "ec_consumer", ...}\''
        )
    if not host.ec_consumer:
        raise RuntimeError(
            f"epd: this server's ec_role is {host.ec_role!r}; the middleware belongs on "
            "the PD server (ec_role 'ec_consumer'), not on an encoder"
        )


def check_keys(config: EPDConfig, host: Host) -> None:
    """Inside vLLM's key check the middleware checks no key itself: keys given only to it would guard
    nothing. Fail start-up for that; warn about keys vLLM does not know (they open the status page
    only)."""
    vllm_keys = host.vllm_api_keys
    if config.api_keys and not vllm_keys:
        raise RuntimeError(
            "epd: EPD_API_KEYS is set, but vLLM runs without --api-key (or VLLM_API_KEY), so neither the "
            "encoder path nor vLLM's own endpoints would check a key; give vLLM the keys (--api-key "
            "KEY ... or VLLM_API_KEY), which the middleware then uses too, or unset EPD_API_KEYS"
        )
    if set(config.api_keys) - set(vllm_keys):
        logger.warning(
            "epd: some EPD_API_KEYS are not among vLLM's --api-key keys; vLLM refuses them on /v1/*, so "
            "they open only the status endpoint"
        )


def plugin() -> EPDPlugin:
    """The entry point's factory (vLLM calls it with no arguments)."""
    return EPDPlugin()
