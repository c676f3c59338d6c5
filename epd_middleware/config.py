"""EPDConfig: every option of the middleware, its default and its ``EPD_*`` environment variable.

This is the one place defaults live. The middleware's keyword arguments, ``EPDConfig(...)`` and the
environment are three spellings of the same model, so they cannot drift apart.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypedDict
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ._addresses import masked, parse_allowlist, parse_nameserver, port_number
from ._logs import logger

__all__ = [
    "ENV_PREFIX",
    "TOOL_VARIABLES",
    "ConfigurationError",
    "EPDConfig",
    "EPDOptions",
    "unknown_variables",
]

ENV_PREFIX = "EPD_"
# Variables of the project's own scripts and benchmarks that share the prefix but are not options of the
# middleware: never warned about.
TOOL_VARIABLES = frozenset(
    {
        "EPD_VLLM_PYTHON",
        "EPD_VLLM_VENV",
        "EPD_VLLM_VERSION",
        "EPD_CACHE_DIR",
        "EPD_BENCH_OPTIONS",
        "EPD_DEMO_ENCODER",
        "EPD_FLEET_LOGS",
    }
)
# 128 bits: a uuid_key shorter than this could be found by trying keys against one known uuid.
_MIN_UUID_KEY_BYTES = 16
_TRUE = frozenset({"1", "true", "yes", "on", "True", "TRUE"})


class ConfigurationError(ValueError):
    """The configuration is wrong: ``problems`` says what, one sentence per option or variable."""

    def __init__(self, what: str, problems: Sequence[str]) -> None:
        super().__init__(f"{what}: " + "; ".join(problems))
        self.problems = list(problems)


class _Problems(ValueError):
    """Every problem of one option's value (each bad entry of a list), so that the configuration's error
    names them all at once rather than the first alone."""

    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = list(problems)


def _each(check: Callable[[str], object], entries: Sequence[str]) -> None:
    """Runs ``check`` on every entry; raises :class:`_Problems` with every entry it refused."""
    problems = []
    for entry in entries:
        try:
            check(entry)
        except ValueError as exc:
            problems.append(str(exc))
    if problems:
        raise _Problems(problems)


def _checked_url(role: str, url: str) -> str:
    """One encoder or prefill URL, without a trailing slash (or /v1); ValueError says what is wrong."""
    # A URL may carry a password whatever else is wrong with it: every message names it masked.
    shown = masked(url)
    if any(character.isspace() or character == ";" for character in url):
        raise ValueError(
            f"{role} URL {shown[:100]!r} holds a space or ';': separate several URLs with commas"
        )
    parts = urlsplit(url)
    if "@" in parts.netloc:
        # Credentials in a URL would show wherever the URL does (errors, the status page, metric labels),
        # and no call would send them: refused, and the secret never repeated.
        raise ValueError(
            f"{role} URL {shown!r} carries credentials (user:password@); give the servers' key as "
            "encoder_api_key (EPD_ENCODER_API_KEY) instead"
        )
    if parts.scheme not in ("http", "https", "dns+http", "dns+https") or not parts.netloc:
        raise ValueError(f"{role} URL {shown!r} is not an http(s) or dns+http(s) URL with a host")
    if parts.query or parts.fragment:
        raise ValueError(f"{role} URL {shown!r} must not carry a query or fragment")
    port_text = parts.netloc.rpartition("]")[2].rpartition(":")
    if port_text[1] and port_number(port_text[2]) is None:
        if shown == url and not (port_text[2].isascii() and port_text[2].isdigit()):
            # Not a number: perhaps the start of a password the list's commas cut off
            # ("http://user:pa,ss@host"), so it is not repeated either.
            end = url.find("//") + 2 + len(parts.netloc)
            shown = f"{url[: end - len(port_text[2])]}...{url[end:]}"
        raise ValueError(f"{role} URL {shown!r}: the port must be a number from 1 to 65535")
    if not parts.hostname:
        raise ValueError(f"{role} URL {shown!r} has no host")
    if parts.scheme.startswith("dns+"):
        try:
            port = parts.port
        except ValueError:
            port = None
        if port is None or parts.path.strip("/"):
            raise ValueError(f"{role} URL {shown!r}: a dns+ URL is dns+http(s)://NAME:PORT")
    url = url.rstrip("/")
    if parts.path.rstrip("/").endswith("/v1"):
        # An OpenAI-style base URL: the calls add /v1/... themselves, so /v1 would be asked twice.
        url = url.removesuffix("/v1")
        logger.warning(
            "epd: %s URL %s/v1: the middleware adds /v1/... itself; using %s", role, masked(url), masked(url)
        )
    return url


class EPDConfig(BaseModel):
    """Configuration of :class:`~epd_middleware.EPDMiddleware`.

    Every field can also be set from the environment as ``EPD_<FIELD NAME IN CAPITALS>``; list fields
    take comma-separated values (``EPD_ENCODERS=http://enc-0:8001,http://enc-1:8001``).
    """

    # Inputs stay out of validation messages: they may hold keys, or credentials in a URL.
    # No NaN or infinity: "inf" seconds is no timeout at all, and NaN compares false with everything.
    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True, allow_inf_nan=False)

    encoders: tuple[str, ...] = Field(
        default=(),
        description=(
            "Base URLs of the vLLM encoder instances (ec_producer), e.g. http://enc-0:8001; "
            "dns+http://NAME:PORT stands for every address NAME resolves to (a Kubernetes headless "
            "Service). May be empty when prefill is set (P/D without remote encoders) or with "
            "scheduler='llm-d' (the scheduler names the encoders)."
        ),
    )
    prefill: tuple[str, ...] = Field(
        default=(),
        description=(
            "Base URLs of remote prefill instances (kv_producer), dns+http:// as for encoders. When set, "
            "every intercepted request is prefilled on one of them (after its media is encoded) and this "
            "server only decodes."
        ),
    )
    scheduler: Literal["none", "llm-d"] = Field(
        default="none",
        description=(
            "Who picks encoders and prefill servers per request. 'none': the middleware, from its pools. "
            "'llm-d': llm-d's endpoint picker, through the x-encoder-hosts-ports and "
            "x-prefiller-host-port headers the gateway forwards (a drop-in for llm-d's routing sidecar); "
            "requests without them are served from the pools. The headers are removed in every mode."
        ),
    )
    scheduler_allow: tuple[str, ...] = Field(
        default=(),
        description=(
            "Targets a scheduler header may name besides the members of the encoder and prefill pools: "
            "CIDR networks (10.0.0.0/8: any port; 10.0.0.0/8:8001 or [fd00::/8]:8001: that port only) "
            "and exact ip:port or host:port entries. A forged encoder entry is dropped; a forged prefill "
            "target is refused with 403."
        ),
    )
    scheduler_scheme: Literal["http", "https"] = Field(
        default="http",
        description="The scheme of the servers the scheduler headers name.",
    )
    dns_refresh_interval: float = Field(
        default=5.0,
        gt=0,
        description="Seconds between lookups of the dns+http:// names of the pools.",
    )
    dns_timeout: float = Field(
        default=2.0,
        gt=0,
        description=(
            "Seconds one lookup of a dns+http:// name may take (the first one is awaited by requests "
            "when no lifespan ran it yet)."
        ),
    )
    dns_nameservers: tuple[str, ...] = Field(
        default=(),
        description=(
            "DNS servers for the dns+http:// names, as host:port ([v6]:port); empty: the system's "
            "resolver configuration (/etc/resolv.conf, search domains included)."
        ),
    )
    prefill_timeout: float = Field(
        default=300.0,
        gt=0,
        description="Seconds one prefill call may take, connect to last byte; past it the call has failed.",
    )
    on_prefill_failure: Literal["error", "local"] = Field(
        default="error",
        description=(
            "What happens to a request no prefill server could prefill: 'error' answers 502/503/504; "
            "'local' lets this server prefill it itself."
        ),
    )
    ec_consumer_zmq: str | None = Field(
        default=None,
        description=(
            "Mooncake push: the ZMQ address (tcp://HOST:PORT) encoders push embeddings to for this server. "
            "Read from the server's own ECMooncakeConnector configuration when not given; setting it turns "
            "push on."
        ),
    )
    encoder_timeout: float = Field(
        default=60.0,
        gt=0,
        description="Seconds one encoder call may take, connect to last byte; past it the call has failed.",
    )
    connect_timeout: float = Field(
        default=5.0,
        gt=0,
        description="Seconds to open a connection to an encoder (within encoder_timeout).",
    )
    encode_deadline: float = Field(
        default=120.0,
        gt=0,
        description="Seconds all encoder work of one request may take, retries included; past it 504.",
    )
    max_attempts: int = Field(
        default=3,
        ge=1,
        description="Encoders one encoder call may be tried on before it has failed (1 = no failover).",
    )
    on_encoder_failure: Literal["error", "local"] = Field(
        default="error",
        description=(
            "What happens to media no encoder could encode: 'error' answers 502/503/504; 'local' sends it "
            "to the local engine as the original media, which encodes it itself."
        ),
    )
    placement: Literal["remote", "local", "adaptive"] = Field(
        default="remote",
        description=(
            "Where media is encoded: 'remote' on the encoders; 'local' by the local engine (no encoder "
            "is called: for comparison, or to drain encoders); 'adaptive' per request and modality, "
            "locally while PD is idle, or has headroom and the items are small or every encoder is "
            "saturated. Never locally where PD cannot encode (a Mooncake consumer)."
        ),
    )
    placement_pd_idle_load: int = Field(
        default=1,
        ge=0,
        description=(
            "adaptive: PD is idle while its engine has fewer unfinished requests than this, and then "
            "encodes every item itself: no decode waits for it, and the request saves the encoder's "
            "round trip and the step that loads its embedding (0: never for idleness alone)."
        ),
    )
    placement_small_tokens: int = Field(
        default=0,
        ge=0,
        description=(
            "adaptive: a modality whose items to encode come to at most this many vision tokens (from "
            "the images' sizes) is encoded locally while PD has headroom. 0: never for size alone."
        ),
    )
    placement_pd_max_load: int = Field(
        default=4,
        ge=0,
        description=(
            "adaptive: PD has headroom while its engine has fewer unfinished requests than this (0: "
            "never), and the prompt tokens it has yet to prefill fit in one engine step (vLLM's "
            "max_num_batched_tokens)."
        ),
    )
    placement_encoder_slowdown: float = Field(
        default=3.0,
        gt=1,
        description=(
            "adaptive: an encoder is saturated when its recent calls took this many times the fastest "
            "call of their size (the vision tokens they ask for, within a factor of two), measured "
            "within the last health_check_interval (a verdict no call renews goes stale)."
        ),
    )
    placement_encoder_busy_calls: int = Field(
        default=16,
        ge=1,
        description=(
            "adaptive: an encoder is saturated, too, with this many calls in flight from this process, "
            "or this load reported by its GET /load (vLLM's --enable-server-load-tracking)."
        ),
    )
    equivalence_interval: float = Field(
        default=0.0,
        ge=0,
        description=(
            "Seconds between equivalence probes: each encoder's E + PD answer to a built-in image "
            "prompt compared with PD's own (0: no schedule; POST <status_path>/equivalence and "
            "`epd-middleware check --canary` still run one). Runs at start-up too."
        ),
    )
    equivalence_tolerance: float | None = Field(
        default=None,
        gt=0,
        description=(
            "Largest logprob difference (nats) the two paths' answers may show at a position; None: by "
            "the model's dtype (float32 0.02, float16 0.1, bfloat16 0.25)."
        ),
    )
    equivalence_eject: bool = Field(
        default=False,
        description="Take an encoder whose answers differ out of the pool until a probe matches again.",
    )
    equivalence_tokens: int = Field(
        default=4,
        ge=1,
        le=64,
        description="Tokens each probe request generates (greedy, with its top 5 logprobs).",
    )
    equivalence_options: dict[str, Any] = Field(
        default_factory=lambda: {"media_io_kwargs": {"image": {"rgba_background_color": [0, 0, 0]}}},
        description=(
            "The non-default media options of the probe's second run, JSON (mm_processor_kwargs, "
            "media_io_kwargs; {} runs the defaults only). Runs only where PD takes per-request options "
            "(--trust-request-mm-kwargs)."
        ),
    )
    verify_share: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description=(
            "Share of real chat requests with media (answered 200) whose prompt and media the "
            "equivalence probe runs again through both paths, at one token with logprobs, after the "
            "client's answer (0: off). Needs the lifespan; one is checked at a time, others are dropped."
        ),
    )
    equivalence_max_pd_load: int = Field(
        default=4,
        ge=1,
        description=(
            "A probe waits while the engine has this many unfinished requests or more (or more prompt "
            "tokens to prefill than one step holds): clients come first."
        ),
    )
    eject_after: int = Field(
        default=3,
        ge=1,
        description="Consecutive failures after which an encoder is ejected (skipped) for a cool-down.",
    )
    eject_cooldown: float = Field(
        default=2.0,
        gt=0,
        description="Seconds of the first ejection; doubled at each ejection in a row.",
    )
    max_eject_cooldown: float = Field(
        default=60.0,
        gt=0,
        description="Longest ejection, in seconds.",
    )
    health_check_interval: float = Field(
        default=5.0,
        ge=0,
        description="Seconds between GET /health probes of every encoder (0 turns probing off).",
    )
    health_check_timeout: float = Field(
        default=2.0,
        gt=0,
        description="Seconds one health probe may take.",
    )
    engine_retries: int = Field(
        default=1,
        ge=0,
        description=(
            "Times a request is encoded and run again when the local engine answers 500 before any byte "
            "reached the client."
        ),
    )
    max_inflight_per_encoder: int = Field(
        default=64,
        ge=1,
        description=(
            "Most calls in flight to one encoder (or prefill server); further calls wait (within the "
            "deadline)."
        ),
    )
    max_pending_requests: int = Field(
        default=512,
        ge=1,
        description="Most requests in the encode and prefill stages at once; past it 503 with Retry-After.",
    )
    retry_after: int = Field(
        default=1,
        ge=0,
        description=(
            "Seconds sent in Retry-After with a 503; at least: when every server of a pool is ejected, "
            "the seconds until the first one's cool-down ends."
        ),
    )
    client_embeddings: Literal["refuse", "trust"] = Field(
        default="refuse",
        description=(
            "Embeds parts a client writes itself (image_embeds, audio_embeds, video_embeds: references "
            "to stored embeddings, or tensors): 'refuse' (400); 'trust' takes them, a reference only "
            "where its embedding is confirmed present. vLLM's --enable-mm-embeds, which the rewrite "
            "needs, trusts their shape: one that does not match crashes the engine for every user, so "
            "trust only clients you would give the engine to."
        ),
    )
    log_format: Literal["text", "json"] = Field(
        default="text",
        description=(
            "The middleware's log lines: 'text' (through vLLM's handlers inside vLLM, each line about a "
            "request starting 'request <id>:'), or 'json' (one object a line on stderr: time, level, "
            "logger, request_id, message), for log pipelines."
        ),
    )
    log_requests: bool | None = Field(
        default=None,
        description=(
            "One INFO line per intercepted request with media (its items, encoder calls, the encoders "
            "that answered, the encode and rewrite times). Unset: as vLLM's --enable-log-requests inside "
            "vLLM (off by default, as vLLM's own lines per request: at load a line per request is a "
            "tenth of the middleware's CPU on PD's API-server loop), on outside vLLM (written where the "
            "application's logging lets INFO through)."
        ),
    )
    expose_upstream_addresses: bool = Field(
        default=False,
        description=(
            "Name the encoders and prefill servers (their URLs, the addresses DNS gave) in the errors "
            "clients read, for debugging. Off: clients read the role and the reason, the log and "
            "/epd/status name the server (addresses are the deployment's, not the clients')."
        ),
    )
    paths: tuple[str, ...] = Field(
        default=("/v1/chat/completions", "/invocations"),
        description=(
            "Chat-completions request paths whose POST bodies are examined. SageMaker's /invocations, "
            "which vLLM serves by default, runs a chat request for a body that is one."
        ),
    )
    batch_paths: tuple[str, ...] = Field(
        default=("/v1/chat/completions/batch",),
        description=(
            "Batch chat request paths (messages: a list of conversations) whose POST bodies are examined."
        ),
    )
    messages_paths: tuple[str, ...] = Field(
        default=("/v1/messages",),
        description="Anthropic Messages request paths whose POST bodies are examined (empty: none).",
    )
    responses_paths: tuple[str, ...] = Field(
        default=("/v1/responses",),
        description="OpenAI Responses request paths whose POST bodies are examined (empty: none).",
    )
    max_body_bytes: int = Field(
        default=64 * 1024 * 1024,
        gt=0,
        description="Largest request body read on an intercepted path; larger ones get 413.",
    )
    tune_malloc: bool = Field(
        default=True,
        description=(
            "Where the process runs on glibc and its malloc was not tuned already (MALLOC_*_ or "
            "GLIBC_TUNABLES), keep freed memory for the next large body instead of handing it back: "
            "allocations under 32 MiB from the heap, up to 64 MiB of free heap kept (glibc's own limits "
            "for its adaptive thresholds). Applies to the whole process."
        ),
    )
    max_media_items: int = Field(
        default=64,
        ge=1,
        description="Most media parts in one request; more get 400 before any encoder call.",
    )
    max_batch_size: int = Field(
        default=8,
        ge=1,
        description="Most images sent to one encoder in one call.",
    )
    reuse_handles: bool = Field(
        default=True,
        description=(
            "Take media encoded for an earlier request from a cache of what the encoder reported, "
            "instead of sending it to an encoder again, where the embedding's presence can be checked "
            "(ECExampleConnector with check_embeddings); elsewhere reuse stays off and /epd/status says "
            "why."
        ),
    )
    reuse_cache_size: int = Field(
        default=4096,
        ge=1,
        description=(
            "Most encoded items remembered for reuse, per API-server process (least recently used go)."
        ),
    )
    encoder_selection: Literal["affinity", "round_robin"] = Field(
        default="affinity",
        description=(
            "How the pool's encoder for an item is chosen. 'affinity': by rendezvous hashing of the "
            "item's content, so every process of every replica sends the same media to the same encoder "
            "(whose caches then hit), with bounded load. 'round_robin': one after the other."
        ),
    )
    rewrite: bool = Field(
        default=True,
        description=(
            "Replace encoded media parts by metadata-only references (image_embeds, ...) so that PD does "
            "not decode or preprocess the media again."
        ),
    )
    trust_client_uuid: bool = Field(
        default=False,
        description=(
            "Keep the uuid a client put on a media part as its cache key. Off by default: a client uuid is "
            "a key every client shares, so one client could make another receive its embedding."
        ),
    )
    check_models: bool = Field(
        default=True,
        description=(
            "Use an encoder or prefill server only once GET /v1/models showed it serves this server's "
            "model (inside vLLM: its served names and model path; else expected_model; else the model of "
            "the first request the local engine answered with 200). Re-checked when a server comes back "
            "from ejection, and every health_check_interval while it does not match."
        ),
    )
    expected_model: str | None = Field(
        default=None,
        description=(
            "The model name the encoders and prefill servers must serve, where the middleware does not "
            "run inside vLLM (which says it itself)."
        ),
    )
    strict_startup: bool = Field(
        default=False,
        description=(
            "Fail the server's start-up when an encoder or prefill server answers that it serves "
            "another model (servers that do not answer yet never fail it); without it such a server is "
            "only left unused until it matches."
        ),
    )
    check_embeddings: bool = Field(
        default=True,
        description=(
            "Where the local EC connector stores embeddings as files (ECExampleConnector), check that each "
            "reported embedding exists before handing the engine a reference to it."
        ),
    )
    ec_storage_path: str | None = Field(
        default=None,
        description=(
            "The ECExampleConnector shared_storage_path, for check_embeddings; read from the vLLM server's "
            "own configuration when not given."
        ),
    )
    api_keys: tuple[str, ...] = Field(
        default=(),
        repr=False,
        description=(
            "Bearer tokens accepted on intercepted requests (checked before any encoder work) and on the "
            "status endpoint besides vLLM's own keys (--api-key, else VLLM_API_KEY), which are always "
            "checked. Empty (and empty strings): no extra keys; with no key at all, no check."
        ),
    )
    authenticate: bool = Field(
        default=True,
        description=(
            "Check api_keys on intercepted requests before any encoder work. The epd plugin turns it off: "
            "it runs inside vLLM's own key check."
        ),
    )
    status_path: str = Field(
        default="/epd/status",
        description="JSON status endpoint path (GET); empty turns it off. Needs a key when keys exist.",
    )
    encoder_api_key: str | None = Field(
        default=None,
        repr=False,
        description="Bearer token sent to the encoders and prefill servers.",
    )
    canary_api_key: str | None = Field(
        default=None,
        repr=False,
        description=(
            "Bearer token the canary encode carries under forward_authorization (the canary confirms an "
            "encoder's ejection and never carries a client's key). Without it the canary carries "
            "encoder_api_key, or no key."
        ),
    )
    uuid_key: str | None = Field(
        default=None,
        repr=False,
        description=(
            "The fleet secret that keys the content uuids of media (BLAKE3 keyed hash), so that no one "
            "without it can name another request's embedding on an encoder or in the EC storage. Every PD "
            "server and API-server process of a fleet needs the same key to share encoded media (an "
            "encoder's cache, stored embeddings); without it each process draws its own at start."
        ),
    )
    strict_env: bool = Field(
        default=False,
        description=(
            "Fail the start when an EPD_* variable is not an option (a typo such as EPD_ENCODER_TIMEOUTS); "
            "without it each is named in a WARNING with the nearest option."
        ),
    )
    forward_authorization: bool = Field(
        default=False,
        description=(
            "Send the client's Authorization header to the encoders and prefill servers (instead of "
            "encoder_api_key)."
        ),
    )

    @field_validator("encoders", "prefill")
    @classmethod
    def _check_urls(cls, urls: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        role = "encoder" if info.field_name == "encoders" else "prefill"
        cleaned, problems = [], []
        for url in urls:
            try:
                cleaned.append(_checked_url(role, url))
            except ValueError as exc:
                problems.append(str(exc))
        if len(set(cleaned)) != len(cleaned):
            problems.append(f"{role} URLs are repeated: {[masked(url) for url in urls]}")
        if problems:
            raise _Problems(problems)
        return tuple(cleaned)

    @field_validator("ec_consumer_zmq")
    @classmethod
    def _check_consumer(cls, address: str | None) -> str | None:
        if address is not None:
            shown = masked(address)
            if "@" in address:
                # ZMQ takes no credentials, and the address is logged and on the status page.
                raise ValueError(f"ec_consumer_zmq {shown!r} carries credentials; it is tcp://HOST:PORT")
            parts = urlsplit(address)
            try:
                port = parts.port
            except ValueError:
                port = None
            if parts.scheme != "tcp" or not parts.hostname or port is None:
                raise ValueError(f"ec_consumer_zmq {shown!r} is not a tcp://HOST:PORT address")
        return address

    @field_validator("scheduler_allow")
    @classmethod
    def _check_allow(cls, entries: tuple[str, ...]) -> tuple[str, ...]:
        _each(lambda entry: parse_allowlist((entry,)), entries)
        return entries

    @field_validator("dns_nameservers")
    @classmethod
    def _check_nameservers(cls, entries: tuple[str, ...]) -> tuple[str, ...]:
        _each(parse_nameserver, entries)
        return entries

    @field_validator("paths", "batch_paths", "messages_paths", "responses_paths")
    @classmethod
    def _check_paths(cls, paths: tuple[str, ...]) -> tuple[str, ...]:
        wrong = [f"path {masked(path)!r} must start with '/'" for path in paths if not path.startswith("/")]
        if wrong:
            raise _Problems(wrong)
        return paths

    @field_validator("status_path")
    @classmethod
    def _check_status_path(cls, path: str) -> str:
        if path and not path.startswith("/"):
            raise ValueError(f"status_path {masked(path)!r} must start with '/' (or be empty to turn it off)")
        return path

    @field_validator("encoder_api_key")
    @classmethod
    def _check_encoder_key(cls, key: str | None) -> str | None:
        if key is not None and (not key.isprintable() or not key.isascii() or key != key.strip()):
            # It goes into a header line of every call: only visible ASCII and inner spaces can.
            raise ValueError("encoder_api_key must be printable ASCII without leading or trailing spaces")
        return key

    @field_validator("equivalence_options", mode="before")
    @classmethod
    def _check_equivalence_options(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                value = json.loads(value) if value.strip() else {}
            except ValueError:
                raise ValueError("equivalence_options must be a JSON object") from None
        if not isinstance(value, dict):
            raise ValueError("equivalence_options must be a JSON object")
        unknown = sorted(set(value) - {"mm_processor_kwargs", "media_io_kwargs"})
        if unknown:
            raise ValueError(
                f"equivalence_options takes mm_processor_kwargs and media_io_kwargs only, not {unknown}"
            )
        if not all(isinstance(options, dict) for options in value.values()):
            raise ValueError("each of equivalence_options' values must be a JSON object")
        return value

    @field_validator("canary_api_key")
    @classmethod
    def _check_canary_key(cls, key: str | None) -> str | None:
        if key is not None and (not key.isprintable() or not key.isascii() or key != key.strip()):
            raise ValueError("canary_api_key must be printable ASCII without leading or trailing spaces")
        return key

    @field_validator("uuid_key")
    @classmethod
    def _check_uuid_key(cls, key: str | None) -> str | None:
        if key is not None and len(key.encode("utf-8", "surrogatepass")) < _MIN_UUID_KEY_BYTES:
            # A short secret can be guessed by trying: the uuids it keys would be named again.
            raise ValueError(
                f"uuid_key must be at least {_MIN_UUID_KEY_BYTES} bytes (openssl rand -hex 32 makes one)"
            )
        return key

    @property
    def canary_authorization(self) -> str | None:
        """The Authorization header of the canary encode: never a client's (under
        forward_authorization the calls carry the client's; the canary, the operator's key for it)."""
        key = self.canary_api_key or self.encoder_api_key
        return f"Bearer {key}" if key else None

    @property
    def encoder_authorization(self) -> str | None:
        """The Authorization header of calls and probes to the encoders, when an encoder key is set."""
        return f"Bearer {self.encoder_api_key}" if self.encoder_api_key else None

    @model_validator(mode="after")
    def _check_together(self) -> EPDConfig:
        if not self.encoders and not self.prefill and self.scheduler == "none":
            raise ValueError(
                "at least one encoder URL is required (EPD_ENCODERS or encoders=[...]), or prefill URLs "
                "for P/D without remote encoders, or scheduler='llm-d'"
            )
        surfaces = (self.paths, self.batch_paths, self.messages_paths, self.responses_paths)
        shared = {path for path in set().union(*surfaces) if sum(path in paths for paths in surfaces) > 1}
        if shared:
            raise ValueError(f"paths, batch_paths, messages_paths and responses_paths share {sorted(shared)}")
        if self.max_eject_cooldown < self.eject_cooldown:
            raise ValueError("max_eject_cooldown must not be shorter than eject_cooldown")
        if self.scheduler == "llm-d" and not (self.encoders or self.prefill or self.scheduler_allow):
            raise ValueError(
                "scheduler='llm-d' follows a header's target only when it is a member of the encoder or "
                "prefill pool or scheduler_allow admits it; with no pool and no scheduler_allow every "
                "target would be dropped as forged and media encoded locally: set scheduler_allow "
                "(EPD_SCHEDULER_ALLOW, the pods' network, e.g. 10.0.0.0/8:8001) or the pools"
            )
        return self

    def warnings(self) -> list[str]:
        """Combinations that are valid but cannot do what they say, one sentence each."""
        found = []
        if self.connect_timeout > self.encoder_timeout:
            found.append(
                f"connect_timeout ({self.connect_timeout:g} s) is longer than encoder_timeout "
                f"({self.encoder_timeout:g} s), which bounds the connect too: the connect gets "
                f"{self.encoder_timeout:g} s at most"
            )
        if self.encode_deadline < self.encoder_timeout:
            found.append(
                f"encode_deadline ({self.encode_deadline:g} s) is shorter than encoder_timeout "
                f"({self.encoder_timeout:g} s): no encoder call can use its whole timeout, and a slow call "
                "ends the request (504) before it could fail over"
            )
        if self.forward_authorization and not (self.canary_api_key or self.encoder_api_key):
            found.append(
                "forward_authorization without canary_api_key: the canary encode that confirms an "
                "encoder's ejection carries no key (never a client's), so encoders that require one are "
                "proven by /health alone"
            )
        if self.health_check_interval and self.health_check_timeout > self.health_check_interval:
            found.append(
                f"health_check_timeout ({self.health_check_timeout:g} s) is longer than "
                f"health_check_interval ({self.health_check_interval:g} s): probes of a silent server overlap"
            )
        return found

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> EPDConfig:
        """Read the configuration from ``EPD_*`` variables (``os.environ`` by default).

        :class:`ConfigurationError` names every variable at fault, one sentence each. A variable with the
        prefix that is no option is named in a WARNING with the nearest option (an error with
        ``EPD_STRICT_ENV=true``); the project's own tool variables (:data:`TOOL_VARIABLES`) are not
        options and are left alone.
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name, field in cls.model_fields.items():
            raw = env.get(ENV_PREFIX + name.upper())
            if raw is None:
                continue
            if _is_sequence_field(field.annotation):
                values[name] = tuple(item.strip() for item in raw.split(",") if item.strip())
            else:
                values[name] = raw.strip()
        unknown = unknown_variables(env)
        try:
            config = cls(**values)
        except ValidationError as exc:
            problems = [problem for error in exc.errors() for problem in _env_problem(cls, error)]
            if values.get("strict_env") in _TRUE and unknown:
                problems.extend(unknown)
            raise ConfigurationError("invalid EPD_* environment configuration", problems) from None
        if unknown and config.strict_env:
            raise ConfigurationError("invalid EPD_* environment configuration", unknown)
        for problem in unknown:
            logger.warning("epd: %s", problem)
        return config

    @classmethod
    def of_options(cls, options: Mapping[str, Any]) -> EPDConfig:
        """The configuration of keyword options (the middleware's), with :class:`ConfigurationError`
        naming every option at fault."""
        try:
            return cls(**options)
        except ValidationError as exc:
            raise ConfigurationError(
                "invalid EPDMiddleware configuration",
                [problem for error in exc.errors() for problem in _option_problem(error)],
            ) from None

    @classmethod
    def env_var(cls, field: str) -> str:
        """The environment variable that sets ``field``."""
        if field not in cls.model_fields:
            raise KeyError(field)
        return ENV_PREFIX + field.upper()


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """One sentence per ``EPD_*`` variable that is neither an option nor a tool variable, with the
    nearest option's variable where one is close (``EPD_ENCODER_TIMEOUTS`` -> ``EPD_ENCODER_TIMEOUT``)."""
    options = [ENV_PREFIX + name.upper() for name in EPDConfig.model_fields]
    found = []
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or name in options or name in TOOL_VARIABLES:
            continue
        near = difflib.get_close_matches(name, options, n=1, cutoff=0.75)
        hint = f"; did you mean {near[0]}?" if near else ""
        found.append(f"{name} is not an option of the middleware and is ignored{hint}")
    return found


def _env_problem(model: type[EPDConfig], error: Any) -> list[str]:
    location = error["loc"]
    if not location:
        message = str(error["msg"]).removeprefix("Value error, ")
        if "at least one encoder URL is required" in message:
            return [
                f"{model.env_var('encoders')} is not set; give the encoder base URLs, comma-separated "
                f"(EPD_ENCODERS=http://enc-0:8001,http://enc-1:8001), or {model.env_var('prefill')} for P/D "
                f"without remote encoders, or {model.env_var('scheduler')}=llm-d"
            ]
        return [message]
    return [f"{model.env_var(str(location[0]))}: {message}" for message in _messages(error)]


def _option_problem(error: Any) -> list[str]:
    location = error["loc"]
    return [f"{location[0]}: {message}" if location else message for message in _messages(error)]


def _messages(error: Any) -> list[str]:
    """One message per problem of the error: each bad entry of a list (:class:`_Problems`) is one."""
    raised = (error.get("ctx") or {}).get("error")
    if isinstance(raised, _Problems):
        return raised.problems
    return [_message(error)]


def _message(error: Any) -> str:
    """Pydantic's message for one error, without its type prefix, and with the nearest allowed value
    for a mistyped choice."""
    message = str(error["msg"]).removeprefix("Value error, ")
    if error.get("type") == "literal_error":
        expected = re.findall(r"'([^']*)'", str((error.get("ctx") or {}).get("expected", "")))
        given = error.get("input")
        near = difflib.get_close_matches(given, expected, n=1, cutoff=0.5) if isinstance(given, str) else []
        if near:
            message += f" (did you mean {near[0]!r}?)"
    return message


def _is_sequence_field(annotation: Any) -> bool:
    return getattr(annotation, "__origin__", None) is tuple


class EPDOptions(TypedDict, total=False):
    """The keyword options of :class:`~epd_middleware.EPDMiddleware`: the fields of :class:`EPDConfig`,
    typed, so that ``app.add_middleware(EPDMiddleware, ...)`` type-checks. A test keeps the two equal."""

    encoders: Sequence[str]
    prefill: Sequence[str]
    scheduler: Literal["none", "llm-d"]
    scheduler_allow: Sequence[str]
    scheduler_scheme: Literal["http", "https"]
    dns_refresh_interval: float
    dns_timeout: float
    dns_nameservers: Sequence[str]
    prefill_timeout: float
    on_prefill_failure: Literal["error", "local"]
    ec_consumer_zmq: str | None
    encoder_timeout: float
    connect_timeout: float
    encode_deadline: float
    max_attempts: int
    on_encoder_failure: Literal["error", "local"]
    placement: Literal["remote", "local", "adaptive"]
    placement_pd_idle_load: int
    placement_small_tokens: int
    placement_pd_max_load: int
    placement_encoder_slowdown: float
    placement_encoder_busy_calls: int
    equivalence_interval: float
    equivalence_tolerance: float | None
    equivalence_eject: bool
    equivalence_tokens: int
    equivalence_options: Mapping[str, Any]
    equivalence_max_pd_load: int
    verify_share: float
    eject_after: int
    eject_cooldown: float
    max_eject_cooldown: float
    health_check_interval: float
    health_check_timeout: float
    engine_retries: int
    max_inflight_per_encoder: int
    max_pending_requests: int
    retry_after: int
    client_embeddings: Literal["refuse", "trust"]
    log_format: Literal["text", "json"]
    log_requests: bool | None
    expose_upstream_addresses: bool
    paths: Sequence[str]
    batch_paths: Sequence[str]
    messages_paths: Sequence[str]
    responses_paths: Sequence[str]
    max_body_bytes: int
    tune_malloc: bool
    max_media_items: int
    max_batch_size: int
    reuse_handles: bool
    reuse_cache_size: int
    encoder_selection: Literal["affinity", "round_robin"]
    rewrite: bool
    trust_client_uuid: bool
    check_models: bool
    expected_model: str | None
    strict_startup: bool
    check_embeddings: bool
    ec_storage_path: str | None
    api_keys: Sequence[str]
    authenticate: bool
    status_path: str
    encoder_api_key: str | None
    canary_api_key: str | None
    uuid_key: str | None
    strict_env: bool
    forward_authorization: bool
