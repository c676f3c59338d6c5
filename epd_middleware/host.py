"""The server the middleware runs in, as the middleware sees it: what the vLLM server says about itself
(its configuration and command line, read here and nowhere else), with the options that stand in for
it outside vLLM or override it.

vLLM puts both on the app's state before the server takes requests
(``entrypoints/launchers/api_server/app_state.py``: ``state.vllm_config``, ``state.args``); the middleware
builds one :class:`Host` from them on the first request or lifespan event that shows them. Sources in
vLLM 0.32 for each fact are named where it is read.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._compat import Expectation
from ._identifiers import IdentifierRule, video_lists
from ._logs import logger
from ._media_policy import MediaPolicy
from ._protocol import DATA_PARALLEL_RANK_HEADER, EXAMPLE_EC_CONNECTOR, MOONCAKE_EC_CONNECTOR
from .config import EPDConfig

__all__ = ["Host", "MooncakeConsumers", "vllm_api_keys"]


@dataclass(frozen=True, slots=True)
class MooncakeConsumers:
    """Where encoders push embeddings for this server: one ZMQ address per data-parallel rank it runs.

    ``pin``: the server chooses among several engines, so the request must be sent to the rank whose
    address the encoder was given (``X-data-parallel-rank``).
    """

    by_rank: dict[int, str]
    pin: bool


@dataclass(slots=True)
class Host:
    """What the middleware takes as given about the server it runs in. ``Host()`` is a server that says
    nothing (not vLLM); tests and other servers build one directly."""

    inside_vllm: bool = False
    # Every key a request may carry: the middleware's own api_keys and vLLM's (--api-key, else
    # VLLM_API_KEY). The empty string is never a key.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    # The keys vLLM's own check takes (--api-key, else VLLM_API_KEY): what guards /v1/* besides us.
    vllm_api_keys: tuple[str, ...] = field(default=(), repr=False)
    ec_connector: str | None = None
    ec_role: str | None = None
    ec_consumer: bool = False
    kv_role: str | None = None
    # Where the local EC connector keeps embeddings as files, when they are checked (ECExampleConnector).
    storage: str | None = None
    # Where encoders push this server's embeddings (Mooncake), per data-parallel rank.
    push: MooncakeConsumers | None = None
    # What the encoders and prefill servers must serve; None: not known, or not checked.
    expectation: Expectation | None = None
    # How the engine identifies media items (the hash it looks an embedding up under).
    identifiers: IdentifierRule = field(default_factory=IdentifierRule)
    # --allowed-media-domains and --allowed-local-media-path; None outside vLLM.
    media_policy: MediaPolicy | None = None
    # Routes that take embedding references or transfer parameters the middleware never reads.
    unguarded_routes: tuple[str, ...] = ()
    trusts_request_mm_kwargs: bool = True
    # "v1" or "v2": the model runner the engine uses; None where the server does not say.
    model_runner: str | None = None
    # How long the engine waits for a pushed embedding before failing the request (Mooncake
    # ``push_wait_timeout_s``); None without push.
    push_wait_s: float | None = None
    # vLLM's budget of decoded media bytes per request (VLLM_MAX_MEDIA_REQUEST_DECODE_BYTES, 0.33);
    # None where the server has none.
    media_decode_budget: int | None = None
    # What is done with media no encoder could take (the on_encoder_failure option): "local" leaves it
    # to this server's engine, which only some servers can do (local_encoding_blocker).
    on_encoder_failure: str = "error"
    # vLLM's --enable-request-id-headers: its answers carry X-Request-Id, so the middleware's own do too.
    request_id_headers: bool = False
    # A line per request in the log (the log_requests option; inside vLLM by default its
    # --enable-log-requests).
    log_requests: bool = True
    # vLLM exports OpenTelemetry traces (--otlp-traces-endpoint): the middleware's spans join them.
    traces: bool = False
    # Where media is encoded (the placement option): "local" and "adaptive" leave some to this engine.
    placement: str = "remote"
    # The requests the local engine has unfinished, asked when a placement is decided; None: not known.
    engine_load: Callable[[], int] | None = field(default=None, repr=False, compare=False)
    # The prompt tokens of the local engine's requests still in prefill, and the tokens one engine step
    # prefills (vLLM's max_num_batched_tokens): how long a request placed here waits for the GPU.
    engine_queued_tokens: Callable[[], int] | None = field(default=None, repr=False, compare=False)
    step_tokens: int | None = None
    # Whether the local engine is shutting down (SIGTERM: vLLM drains it, then stops it); None: not known.
    engine_stopping: Callable[[], bool] | None = field(default=None, repr=False, compare=False)
    # The served model's dtype as vLLM runs it ("bfloat16", "float16", "float32"; None: not known): how
    # closely two paths' logprobs can agree (_equivalence.py).
    dtype: str | None = None
    # Pixels per side of one vision token of the served model (patch size x spatial merge), and the image
    # processor's pixel bounds, for estimating a request's vision tokens from its images' sizes.
    vision_token_side: int = 28
    image_pixel_bounds: tuple[int, int] = (56 * 56, 28 * 28 * 16384)
    _digests: tuple[bytes, ...] = field(init=False, repr=False, compare=False)
    _next_rank: int = field(init=False, default=0, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._digests = tuple(
            hashlib.sha256(key.encode()).digest() for key in dict.fromkeys(self.api_keys) if key
        )

    # Building one ----------------------------------------------------------------------------------

    @classmethod
    def outside(cls, config: EPDConfig) -> Host:
        """No vLLM server (or one that has not said yet): the options speak, and VLLM_API_KEY, the key
        vLLM would check."""
        return cls(
            api_keys=(*config.api_keys, *vllm_api_keys()),
            storage=config.ec_storage_path if config.check_embeddings else None,
            push=_consumer_option(config),
            expectation=_expected_model(config),
            on_encoder_failure=config.on_encoder_failure,
            placement=config.placement,
            log_requests=config.log_requests is not False,
        )

    @classmethod
    def from_state(
        cls, state: object, config: EPDConfig | None = None, *, args: object = None
    ) -> Host | None:
        """The host of a vLLM app's state (``args``: its command line, where not on the state), or None
        where it has no vLLM configuration (yet)."""
        vllm_config = getattr(state, "vllm_config", None)
        if vllm_config is None:
            return None
        host = cls.of_vllm(vllm_config, args if args is not None else getattr(state, "args", None), config)
        host.engine_load = _engine_client_counter(state, "get_num_unfinished_requests")
        host.engine_queued_tokens = _engine_client_counter(state, "get_num_queued_tokens")
        host.engine_stopping = _engine_client_stopping(state)
        return host

    @classmethod
    def of_vllm(cls, vllm_config: object, args: object = None, config: EPDConfig | None = None) -> Host:
        """The host of a vLLM server's configuration and command line, under ``config``'s options
        (None: the facts alone, every check on)."""
        ec = getattr(vllm_config, "ec_transfer_config", None)
        connector = getattr(ec, "ec_connector", None)
        vllm_keys = vllm_api_keys(args)
        storage = None
        if config is None or config.check_embeddings:
            storage = (config.ec_storage_path if config else None) or _example_connector_storage(ec)
        expectation = None
        if config is None or config.check_models:
            expectation = _expectation(vllm_config) or (_expected_model(config) if config else None)
        host = cls(
            inside_vllm=True,
            # vLLM's keys whatever the options say: api_keys only adds keys (with --middleware the
            # middleware runs outside vLLM's check, and with the plugin the status page is outside /v1).
            api_keys=(*(config.api_keys if config else ()), *vllm_keys),
            vllm_api_keys=vllm_keys,
            ec_connector=connector if isinstance(connector, str) else None,
            ec_role=getattr(ec, "ec_role", None),
            ec_consumer=bool(getattr(ec, "is_ec_consumer", False)),
            kv_role=getattr(getattr(vllm_config, "kv_transfer_config", None), "kv_role", None),
            storage=storage,
            push=(_consumer_option(config) if config else None) or _mooncake_consumers(vllm_config),
            expectation=expectation,
            identifiers=_identifier_rule(vllm_config),
            media_policy=_media_policy(vllm_config),
            unguarded_routes=_unguarded_routes(args),
            trusts_request_mm_kwargs=bool(getattr(args, "trust_request_mm_kwargs", True)),
            request_id_headers=getattr(args, "enable_request_id_headers", False) is True,
            log_requests=_log_requests(args, config),
            traces=_traces(vllm_config),
            model_runner=_model_runner(vllm_config),
            push_wait_s=_push_wait(ec),
            media_decode_budget=_media_decode_budget(),
            on_encoder_failure=config.on_encoder_failure if config else "error",
            placement=config.placement if config else "remote",
            vision_token_side=_vision_token_side(vllm_config),
            step_tokens=_step_tokens(vllm_config),
            dtype=_dtype(vllm_config),
            image_pixel_bounds=_image_pixel_bounds(vllm_config),
        )
        if config is not None:
            host._announce(config)
        return host

    def _announce(self, config: EPDConfig) -> None:
        """Log once what the middleware will do because of what this server said."""
        if self.storage:
            logger.info("epd: checking embeddings under %s before referencing them", self.storage)
        if self.push is not None and config.ec_consumer_zmq is None:
            logger.info("epd: encoders push embeddings to %s", self.push.by_rank)
        for problem in self.known_problems:
            logger.warning("epd: %s", problem)
        if not self.kv_consumer and config.scheduler == "llm-d":
            logger.warning(
                "epd: this server has no KV consumer role (kv_role %r): a scheduler's "
                "x-prefiller-host-port is ignored and requests are prefilled here",
                self.kv_role,
            )

    # What it says ------------------------------------------------------------------------------------

    @property
    def known_problems(self) -> list[str]:
        """What is known to go wrong with this server's configuration, beyond the middleware's reach."""
        problems = []
        if self.ec_connector == MOONCAKE_EC_CONNECTOR and self.ec_consumer and self.model_runner == "v1":
            wait = f"{self.push_wait_s:g} s" if self.push_wait_s is not None else "push_wait_timeout_s"
            problems.append(
                "ECMooncakeConnector on the V1 model runner: vLLM's V1 runner returns before the EC "
                "connector runs on a step with no tokens to compute (v1/worker/gpu_model_runner.py), so "
                "an idle server never loads a pushed embedding; such a request waits the whole push wait "
                f"({wait}) and fails with HTTP 500 (vLLM logs 'failed with an internal error during "
                "generation' and nothing about the transfer), while a server "
                "busy with other requests is not affected. Run the PD on Model Runner V2 (the default "
                "on GPUs; VLLM_USE_V2_MODEL_RUNNER=1, and none of the features V2 lacks), or use "
                "ECExampleConnector; see docs/topologies.md#the-v1-runner-bug"
            )
        blocker = self.local_encoding_blocker
        if self.placement != "remote" and blocker is not None:
            problems.append(
                f"placement={self.placement} cannot encode anything here: {blocker}. Every item goes to "
                "an encoder (as placement=remote); see docs/performance.md#placement-remote-local-adaptive"
            )
        if self.on_encoder_failure == "local" and blocker is not None:
            problems.append(
                f"on_encoder_failure=local cannot work here: {blocker}. Media no encoder could take is "
                "answered with the middleware's own 502, 503 or 504 at once instead; set "
                "EPD_ON_ENCODER_FAILURE=error to say so, or use ECExampleConnector for a PD that can "
                "encode; see docs/resilience.md#media-left-raw-on-a-mooncake-consumer"
            )
        return problems

    @property
    def local_encoding_blocker(self) -> str | None:
        """Why this server's engine cannot encode media itself, or None where it can. A Mooncake
        consumer cannot: vLLM's engine waits for a push of every multimodal item it has neither
        prefix-cached nor in its local cache, whether or not anyone was asked to push it
        (``mooncake/scheduler.py`` ``ensure_cache_available``, 0.32 and 0.33), and fails the request
        with a bare 500 after the whole push wait. Media left raw there is an error at once instead."""
        if self.push is None and not (self.ec_connector == MOONCAKE_EC_CONNECTOR and self.ec_consumer):
            return None
        wait = f"{self.push_wait_s:g} s" if self.push_wait_s is not None else "the push wait"
        return (
            "this server is an ECMooncakeConnector consumer, whose engine encodes no media itself: it "
            f"waits for a push of every image, audio or video ({wait}) and then fails"
        )

    def unfinished_requests(self) -> int | None:
        """The requests the local engine has unfinished now (its load), or None where not known."""
        return _count(self.engine_load)

    def shutting_down(self) -> bool:
        """Whether the local engine stops taking requests: vLLM was sent SIGTERM (it drains what the
        engine holds, and aborts what reaches it from then on), or the engine is gone."""
        if self.engine_stopping is None:
            return False
        try:
            return self.engine_stopping()
        except Exception:  # an engine client in a state vLLM itself would not answer from
            return False

    def queued_tokens(self) -> int | None:
        """The prompt tokens of the local engine's requests still in prefill, or None where not known."""
        return _count(self.engine_queued_tokens)

    @property
    def kv_consumer(self) -> bool:
        """Whether this server can take a KV cache another server prefilled (``kv_consumer`` or
        ``kv_both``); True outside vLLM, where nothing says otherwise."""
        return not self.inside_vllm or self.kv_role in ("kv_consumer", "kv_both")

    def authorizes(self, headers: Iterable[tuple[bytes, bytes]]) -> bool:
        """vLLM's own rule (``AuthenticationMiddleware``): the first Authorization header, a scheme of
        any case equal to "bearer", one space, then a key as it is; digests compared in constant time
        against every key (no early exit: which key matched does not show in the time taken)."""
        if not self._digests:
            return True
        for name, value in headers:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() != b"bearer":
                    return False
                # As vLLM reads it: the header's Latin-1 text, hashed as UTF-8.
                digest = hashlib.sha256(token.decode("latin-1").encode()).digest()
                matched = False
                for key in self._digests:
                    matched |= hmac.compare_digest(digest, key)
                return matched
        return False

    def push_target(self, headers: Iterable[tuple[bytes, bytes]]) -> tuple[str | None, bytes | None]:
        """Mooncake push: the address encoders push this request's embeddings to, and the data-parallel
        rank to pin the request to so that the engine behind that address runs it (None: no pin). A
        rank the client pinned itself is kept; otherwise, where the server runs several engines, ranks
        are taken in turn."""
        consumers = self.push
        if consumers is None:
            return None, None
        ranks = list(consumers.by_rank)
        for name, value in headers:
            if name == DATA_PARALLEL_RANK_HEADER:
                try:
                    pinned = int(value)
                except ValueError:
                    break
                if pinned in consumers.by_rank:
                    return consumers.by_rank[pinned], None
                break
        if not consumers.pin:
            return consumers.by_rank[ranks[0]], None
        rank = ranks[self._next_rank % len(ranks)]
        self._next_rank += 1
        return consumers.by_rank[rank], str(rank).encode()


def _consumer_option(config: EPDConfig) -> MooncakeConsumers | None:
    """``ec_consumer_zmq``: one address for every request, no rank pinned."""
    address = config.ec_consumer_zmq
    return MooncakeConsumers({0: address}, pin=False) if address is not None else None


def _expected_model(config: EPDConfig) -> Expectation | None:
    model = config.expected_model
    return Expectation(frozenset({model})) if model and config.check_models else None


def vllm_api_keys(args: object = None) -> tuple[str, ...]:
    """The keys vLLM's own check takes (``entrypoints/serve/middleware/register.py``): those of its
    command line (``--api-key``, ``nargs="+"``: a list; a plain string from older versions and custom
    launchers is one key), else ``VLLM_API_KEY``; an empty one is no key. vLLM itself reads
    ``--api-key ""`` as "no key" even with VLLM_API_KEY set; here VLLM_API_KEY then still counts: an
    empty value never takes a key away."""
    keys = getattr(args, "api_key", None) or []
    if isinstance(keys, str):
        keys = [keys]
    given = tuple(key for key in keys if isinstance(key, str) and key)
    if given:
        return given
    env_key = os.environ.get("VLLM_API_KEY")
    return (env_key,) if env_key else ()


def _log_requests(args: object, config: EPDConfig | None) -> bool:
    """A line per request where the log_requests option says so, else where vLLM writes its own
    (``--enable-log-requests``, off by default)."""
    if config is not None and config.log_requests is not None:
        return config.log_requests
    return getattr(args, "enable_log_requests", False) is True


def _unguarded_routes(args: object) -> tuple[str, ...]:
    """``--enable-scale-out`` and ``--tokens-only`` open ``/inference/v1/generate``
    (``entrypoints/scale_out/``), whose ``features`` name embeddings by hash and whose
    ``sampling_params.extra_args`` carry ``ec_transfer_params``."""
    if getattr(args, "enable_scale_out", False) or getattr(args, "tokens_only", False):
        return ("/inference/v1/generate",)
    return ()


def _example_connector_storage(ec: object) -> str | None:
    """The directory where an ECExampleConnector looks for embeddings, if that is the connector
    (``distributed/ec_transfer/ec_connector/example_connector.py``: ``<shared_storage_path>/<mm_hash>/
    encoder_cache.safetensors``, ``shared_storage_path`` defaulting to ``/tmp``)."""
    if ec is None or getattr(ec, "ec_connector", None) != EXAMPLE_EC_CONNECTOR:
        return None
    extra = getattr(ec, "ec_connector_extra_config", None) or {}
    path = extra.get("shared_storage_path", "/tmp") if isinstance(extra, dict) else "/tmp"
    return str(path)


def _mooncake_consumers(vllm_config: object) -> MooncakeConsumers | None:
    """The consumer addresses of this server's ECMooncakeConnector, if that is its connector.

    ``distributed/ec_transfer/ec_connector/mooncake/config.py`` (``MooncakeECConfig.from_vllm_config``):
    an engine's control socket listens on ``tcp://<ec_ip>:<ec_port + data_parallel_index *
    tensor_parallel_size>``, ``data_parallel_index`` being its data-parallel rank
    (``config/parallel.py``), and the producer pushes to the ``consumer_zmq`` of the encoder request
    (``mooncake/scheduler.py`` ``_prepare_push_spec``). The ranks this API server runs are
    ``data_parallel_rank`` .. ``+ data_parallel_size_local``: all of them on a single node, the node's
    own with hybrid or external load balancing.
    """
    ec = getattr(vllm_config, "ec_transfer_config", None)
    if ec is None or getattr(ec, "ec_connector", None) != MOONCAKE_EC_CONNECTOR:
        return None
    if getattr(ec, "ec_role", None) not in ("ec_consumer", "ec_both"):
        return None
    parallel = getattr(vllm_config, "parallel_config", None)
    tp = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
    dp = int(getattr(parallel, "data_parallel_size", 1) or 1)
    first = int(getattr(parallel, "data_parallel_rank", 0) or 0)
    local = getattr(parallel, "data_parallel_size_local", None)
    count = int(local) if local else dp
    if getattr(parallel, "data_parallel_external_lb", False):
        count = 1
    host, port = str(ec.ec_ip), int(ec.ec_port)
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 literal, as vLLM's make_zmq_path writes it
    by_rank = {rank: f"tcp://{host}:{port + rank * tp}" for rank in range(first, first + count)}
    return MooncakeConsumers(by_rank, pin=dp > 1 and count > 1)


def _model_runner(vllm_config: object) -> str | None:
    """Which model runner the engine uses (``config/vllm.py`` ``VllmConfig.use_v2_model_runner``: V1 on a
    build without Triton, as the CPU build, or where a feature V2 lacks is configured, or with
    ``VLLM_USE_V2_MODEL_RUNNER=0``). The API server reads the same configuration and environment as the
    engine, so its answer is the engine's."""
    try:
        uses_v2 = getattr(vllm_config, "use_v2_model_runner", None)
    except Exception:  # a configuration vLLM itself refuses says nothing here
        return None
    if not isinstance(uses_v2, bool):
        return None
    return "v2" if uses_v2 else "v1"


def _media_decode_budget() -> int | None:
    """vLLM's own reading of ``VLLM_MAX_MEDIA_REQUEST_DECODE_BYTES`` (``envs.py``: 715,827,880 by
    default, 0 or less turns it off); None before vLLM 0.33, which has no such budget."""
    try:
        from vllm import envs  # type: ignore[import-not-found, unused-ignore]

        limit = envs.VLLM_MAX_MEDIA_REQUEST_DECODE_BYTES
    except Exception:  # not vLLM, a vLLM without the budget, or a value vLLM itself cannot read
        return None
    return limit if isinstance(limit, int) and limit > 0 else None


def _push_wait(ec: object) -> float | None:
    """How long a Mooncake consumer waits for a pushed embedding (``mooncake/config.py``:
    ``push_wait_timeout_s`` in ``ec_connector_extra_config``, default 60 s)."""
    if ec is None or getattr(ec, "ec_connector", None) != MOONCAKE_EC_CONNECTOR:
        return None
    if not getattr(ec, "is_ec_consumer", False):
        return None
    extra = getattr(ec, "ec_connector_extra_config", None) or {}
    value = extra.get("push_wait_timeout_s", 60) if isinstance(extra, dict) else 60
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return None
    return seconds if seconds > 0 and seconds != float("inf") else None


def _expectation(vllm_config: object) -> Expectation | None:
    """What a vLLM server serves, from its own configuration (``model_config.served_model_name``, which
    vLLM sets to the model path when none is given, and ``model_config.model``)."""
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is None:
        return None
    root = getattr(model_config, "model", None)
    served = getattr(model_config, "served_model_name", None) or root
    names = [served] if isinstance(served, str) else list(served or ())
    names = [name for name in names if isinstance(name, str) and name]
    if not names:
        return None
    return Expectation(frozenset(names), root if isinstance(root, str) and root else None)


def _identifier_rule(vllm_config: object) -> IdentifierRule:
    """The identifier rule of a vLLM server: model path, ``--mm-hasher-algorithm``,
    ``--media-io-kwargs``, ``--mm-processor-kwargs``, LoRA on the tower (``model_config``)."""
    model_config = getattr(vllm_config, "model_config", None)
    model = getattr(model_config, "model", None)
    multimodal = getattr(model_config, "multimodal_config", None)
    algorithm = getattr(multimodal, "mm_hasher_algorithm", None) or "blake3"
    media_io: Any = getattr(multimodal, "media_io_kwargs", None) or {}
    processor = getattr(multimodal, "mm_processor_kwargs", None) or {}
    lora = getattr(vllm_config, "lora_config", None)
    # With LoRA on the tower, an adapter's items are identified as "<adapter>:<hash>"
    # (v1/engine/input_processor.py): which adapter a request runs under is the engine's to say.
    unknown = (
        "LoRA adapters on the vision tower" if getattr(lora, "enable_tower_connector_lora", False) else None
    )
    return IdentifierRule(
        model if isinstance(model, str) and model else None,
        str(algorithm),
        {str(key): dict(value) for key, value in media_io.items() if isinstance(value, dict)},
        unknown,
        video_lists(processor),
    )


def _media_policy(vllm_config: object) -> MediaPolicy:
    """``--allowed-media-domains`` and ``--allowed-local-media-path`` (``model_config``)."""
    model_config = getattr(vllm_config, "model_config", None)
    domains = getattr(model_config, "allowed_media_domains", None) or ()
    local = getattr(model_config, "allowed_local_media_path", None) or ""
    root = Path(local).resolve() if isinstance(local, str) and local else None
    return MediaPolicy(tuple(str(domain) for domain in domains), root)


def _engine_client_counter(state: object, name: str) -> Callable[[], int] | None:
    """A count vLLM's engine client on the app's state keeps, this API server's own (``AsyncLLM``,
    ``v1/engine/async_llm.py``): ``get_num_unfinished_requests``, the requests the engine holds;
    ``get_num_queued_tokens``, the prompt tokens of those still in prefill (vLLM 0.32 on)."""
    client = getattr(state, "engine_client", None)
    count = getattr(client, name, None)
    return count if callable(count) else None


def _engine_client_stopping(state: object) -> Callable[[], bool] | None:
    """Whether vLLM's engine client on the app's state is shutting down, read without a call to the
    engine. On SIGTERM vLLM's API server runs ``engine_client.shutdown(timeout)`` (``launchers/
    launcher.py``), whose first step detaches the core client's finalizer (``v1/engine/core_client.py``,
    MPClient and InprocClient alike): vLLM's own output loop reads ``_finalizer.alive`` as "shutting
    down". From then on the engine core aborts every request added (``_reject_add_in_shutdown``), which
    vLLM answers 200 with ``finish_reason: "abort"`` and no output. ``errored``, public, covers an
    engine already gone and vLLM versions without the finalizer."""
    client = getattr(state, "engine_client", None)
    if client is None:
        return None

    def stopping() -> bool:
        finalizer = getattr(getattr(client, "engine_core", None), "_finalizer", None)
        if finalizer is not None and getattr(finalizer, "alive", True) is False:
            return True
        return getattr(client, "errored", False) is True

    return stopping


def _count(read: Callable[[], int] | None) -> int | None:
    if read is None:
        return None
    try:
        value = read()
    except Exception:  # an engine client in a state vLLM itself would not answer from
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _step_tokens(vllm_config: object) -> int | None:
    """The tokens one engine step schedules (``scheduler_config.max_num_batched_tokens``), or None."""
    value = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_batched_tokens", None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _dtype(vllm_config: object) -> str | None:
    """The model's dtype (``model_config.dtype``, a ``torch.dtype`` once resolved) by its name."""
    value = getattr(getattr(vllm_config, "model_config", None), "dtype", None)
    if value is None:
        return None
    name = str(value).removeprefix("torch.")
    return name if name.isidentifier() else None


def _vision_token_side(vllm_config: object) -> int:
    """Pixels per side of one vision token: the vision tower's ``patch_size`` x ``spatial_merge_size``
    (``model_config.hf_config.vision_config``; Qwen2-VL and Qwen2.5-VL: 14 x 2); 28 when not said."""
    vision = getattr(
        getattr(getattr(vllm_config, "model_config", None), "hf_config", None), "vision_config", None
    )
    patch = getattr(vision, "patch_size", None)
    merge = getattr(vision, "spatial_merge_size", 1)
    if isinstance(patch, int) and isinstance(merge, int) and patch > 0 and merge > 0:
        return patch * merge
    return 28


def _image_pixel_bounds(vllm_config: object) -> tuple[int, int]:
    """The image processor's ``min_pixels`` and ``max_pixels`` (Qwen2-VL's ``preprocessor_config.json``,
    or its ``size`` with ``shortest_edge``/``longest_edge``; the server's ``--mm-processor-kwargs`` over
    them), for a model in a local directory; Qwen2-VL's defaults otherwise."""
    low, high = 56 * 56, 28 * 28 * 16384
    model_config = getattr(vllm_config, "model_config", None)
    model = getattr(model_config, "model", None)
    found: dict[str, Any] = {}
    if isinstance(model, str) and model:
        try:
            loaded = json.loads((Path(model) / "preprocessor_config.json").read_text())
        except (OSError, ValueError):
            loaded = None
        if isinstance(loaded, dict):
            found.update(loaded)
    multimodal = getattr(model_config, "multimodal_config", None)
    server = getattr(multimodal, "mm_processor_kwargs", None)
    if isinstance(server, dict):
        found.update(server)
    size = found.get("size")
    if isinstance(size, dict):
        low = _positive(size.get("shortest_edge"), low)
        high = _positive(size.get("longest_edge"), high)
    low = _positive(found.get("min_pixels"), low)
    high = _positive(found.get("max_pixels"), high)
    return low, max(low, high)


def _positive(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default


def _traces(vllm_config: object) -> bool:
    """Whether vLLM exports traces (``observability_config.otlp_traces_endpoint``, set by
    ``--otlp-traces-endpoint``: its engine client then installs the process's tracer provider)."""
    observability = getattr(vllm_config, "observability_config", None)
    endpoint = getattr(observability, "otlp_traces_endpoint", None)
    return isinstance(endpoint, str) and bool(endpoint)
