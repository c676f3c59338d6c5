"""The ``vllm.endpoint_plugins`` entry point ``epd``: loads the middleware while vLLM builds its app.

Enable with ``VLLM_PLUGINS=epd``; configure with ``EPD_*`` variables. ``attach_router`` runs before vLLM
adds its CORS and API-key middleware (``vllm/entrypoints/launchers/app.py``), and Starlette puts later
middleware outside earlier ones, so the middleware sits inside vLLM's authentication: a request without
a valid key is refused before any encoder work. ``init_state`` then checks, before the server takes
requests, that this server is an EC consumer (with encoders) and a KV consumer (with remote prefill).

vLLM is imported by vLLM, not here: the package imports without it.
"""

from __future__ import annotations

import os
from typing import Any

from .config import EPDConfig
from .logs import adopt_vllm_logging, logger
from .middleware import EPDMiddleware
from .protocol import cli_api_keys, unguarded_routes

__all__ = ["EPDPlugin", "check_keys", "check_server", "plugin", "vllm_api_keys"]


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
        check_server(getattr(state, "vllm_config", None), self.config)
        if self.config is not None:
            check_keys(self.config, args)
        for route in unguarded_routes(args):
            logger.warning(
                "epd: this server serves %s (--enable-scale-out / --tokens-only), which takes embedding "
                "references and transfer parameters the middleware never sees: a client there can make the "
                "engine reference an embedding that does not exist. Keep it from clients on a PD server.",
                route,
            )
        if not getattr(args, "trust_request_mm_kwargs", True):
            # Not fatal: deployments whose clients never send options work without it.
            logger.warning(
                "epd: this PD runs without --trust-request-mm-kwargs, so vLLM will reject requests carrying "
                "mm_processor_kwargs or media_io_kwargs after their media was encoded; start PD and every "
                "encoder with --trust-request-mm-kwargs if clients send them"
            )


def check_server(vllm_config: Any, config: EPDConfig | None = None) -> None:
    """Fail start-up with a clear message unless this server consumes encoder caches (EC consumer, when
    there are encoders) and KV caches (KV consumer, when there are prefill servers)."""
    if vllm_config is None:
        raise RuntimeError(
            "epd: the endpoint plugin needs a vLLM server with an engine (no vllm_config found)"
        )
    if config is not None and config.prefill:
        kv = getattr(vllm_config, "kv_transfer_config", None)
        role = getattr(kv, "kv_role", None)
        if role not in ("kv_consumer", "kv_both"):
            raise RuntimeError(
                f"epd: EPD_PREFILL is set, so this server decodes what the prefill servers computed, but its "
                f"kv_role is {role!r}; start it with --kv-transfer-config "
                '\'{"kv_connector": ..., "kv_role": "kv_consumer", ...}\''
            )
    if config is not None and not config.encoders and config.scheduler == "none":
        return  # P/D only: no encoder will ever be called
    ec = getattr(vllm_config, "ec_transfer_config", None)
    if ec is None or getattr(ec, "ec_connector", None) is None:
        raise RuntimeError(
            "epd: this server has no --ec-transfer-config; the middleware belongs on the PD server, started "
            'with --ec-transfer-config \'{"ec_connector": ..., "ec_role": "ec_consumer", ...}\''
        )
    if not getattr(ec, "is_ec_consumer", False):
        raise RuntimeError(
            f"epd: this server's ec_role is {getattr(ec, 'ec_role', None)!r}; the middleware belongs on "
            "the PD server (ec_role 'ec_consumer'), not on an encoder"
        )


def vllm_api_keys(args: Any) -> list[str]:
    """The keys vLLM's own check accepts (``AuthenticationMiddleware``): ``--api-key``, else
    ``VLLM_API_KEY``."""
    keys = cli_api_keys(args)
    return keys or [key for key in (os.environ.get("VLLM_API_KEY"),) if key]


def check_keys(config: EPDConfig, args: Any) -> None:
    """Inside vLLM's key check the middleware checks no key itself: keys given only to it would guard
    nothing. Fail start-up for that; warn about keys vLLM does not know (they open the status page
    only)."""
    vllm_keys = vllm_api_keys(args)
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
