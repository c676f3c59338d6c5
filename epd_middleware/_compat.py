"""Do the encoders and prefill servers serve the model this server serves?

An encoder that serves another model (or the same weights under another model path) publishes
embeddings under hashes the local engine never derives, or embeddings that do not fit its placeholders:
at best a 500 per request, at worst wrong answers. Every server is asked ``GET /v1/models`` (vLLM
answers ``{"data": [{"id": <served model name>, "root": <model path>, ...}]}``) and used only while it
matches:

- one of its served names is one this server answers to (the client's ``model`` is sent on to it, and
  vLLM answers 404 for a name it does not serve), and
- where this server's model path is known (inside vLLM), one of its roots is that path: vLLM derives
  an item's hash from the model path, the uuid and the options (``multimodal/processing/inputs.py``).

What this server serves comes from vLLM's own configuration inside vLLM, else ``expected_model``, else
the first request whose ``model`` the local engine answered with 200.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
import msgspec

from ._logs import logger
from ._metrics import Stats
from ._upstream import DeadlinePassed
from .transport import HTTPError, Transport, UnsendableRequest

__all__ = ["Expectation", "ModelCheck", "ModelGate", "check_models"]

_decode = msgspec.json.Decoder().decode
MODELS_PATH = "/v1/models"


@dataclass(frozen=True, slots=True)
class Expectation:
    """What a matching server serves: one of ``names``, and ``root`` among its roots when known."""

    names: frozenset[str]
    root: str | None = None

    def describe(self) -> str:
        names = ", ".join(sorted(self.names))
        return f"{names} ({self.root})" if self.root else names


@dataclass(frozen=True, slots=True)
class ModelCheck:
    """One server's answer: ``state`` is ``ok``, ``mismatch`` or ``unreachable``; ``served`` what it
    said it serves, for people (or why it could not be asked); ``models`` the same as (name, model path)
    pairs."""

    state: str
    served: str
    models: tuple[tuple[str, str], ...] = ()


async def check_models(
    client: Transport,
    url: str,
    expectation: Expectation | None,
    headers: Mapping[str, str],
    limit: float,
) -> ModelCheck:
    """Ask ``url`` what it serves and judge it against ``expectation`` (None: only reachability)."""
    try:
        with anyio.fail_after(limit):
            status, content = await client.request("GET", f"{url}{MODELS_PATH}", headers=headers)
    except TimeoutError:
        return ModelCheck("unreachable", f"no answer to GET {MODELS_PATH} within {limit:g} s")
    except (HTTPError, UnsendableRequest) as exc:
        return ModelCheck("unreachable", exc.reason)
    except Exception as exc:
        # A bug in a custom transport: the server is not known to serve the model, and probing goes on.
        logger.exception("unexpected error asking %s what it serves", url)
        return ModelCheck("unreachable", f"unexpected {type(exc).__name__}")
    if status != 200:
        return ModelCheck("unreachable", f"GET {MODELS_PATH} answered HTTP {status}")
    try:
        models: Any = _decode(content)["data"]
        ids = [str(model["id"]) for model in models]
        roots = [str(model.get("root") or "") for model in models]
    except (msgspec.DecodeError, RecursionError, KeyError, TypeError, AttributeError):
        return ModelCheck("unreachable", f"GET {MODELS_PATH} answered no model list")
    pairs = tuple(zip(ids, roots, strict=True))
    served = ", ".join(f"{name} ({root})" if root else name for name, root in pairs)
    if expectation is None:
        return ModelCheck("ok", served or "no model", pairs)
    matches = bool(expectation.names & set(ids)) and (expectation.root is None or expectation.root in roots)
    return ModelCheck("ok" if matches else "mismatch", served or "no model", pairs)


# Verdicts (a server's health record, ``model``) that keep a server from being chosen; one that did not
# answer is asked again by its next call (a fleet starts in any order: a PD server is often up before its
# encoders).
UNUSABLE = frozenset({"mismatch"})
# Verdicts that make a call ask the server first.
_ASK = frozenset({"unchecked", "unreachable"})


class _Record(Protocol):
    """A server's health record, as far as the gate reads and writes it."""

    model: str
    served: str
    names: frozenset[str]


class Servers(Protocol):
    """What the gate needs of the pool it guards (:class:`~._pool.ServerPool`)."""

    role: str
    members: tuple[str, ...]

    @property
    def stats(self) -> Stats: ...
    def record(self, url: str) -> _Record: ...
    def known(self, url: str) -> _Record | None: ...
    def records(self) -> Iterable[_Record]: ...
    def is_member(self, url: str) -> bool: ...
    def record_failure(self, url: str, now: float, reason: str) -> None: ...
    def export_health(self, url: str) -> None: ...


@dataclass
class _Check:
    """A model check in progress: done when it ended, ``finished`` when it reached a verdict."""

    done: anyio.Event = field(default_factory=anyio.Event)
    finished: bool = False


class ModelGate:
    """Which servers of one pool serve this server's model: what they must serve, and one check at a time
    per server. The verdicts live on the pool's health records (``model``, ``served``), where choosing a
    server reads them; a server that does not answer counts a failure there, as a failed call would."""

    def __init__(self, pool: Servers, timeout: float) -> None:
        self._pool = pool
        self._timeout = timeout
        # What a usable server must serve; None: not known, every server is taken as it is.
        self.expectation: Expectation | None = None
        # Headers of the checks a call makes first (the encoder key, when one is set).
        self.headers: Mapping[str, str] = {}
        self._checking: dict[str, _Check] = {}

    def expect(self, expectation: Expectation) -> None:
        """From now on a server is used only once it was seen to serve ``expectation``."""
        if expectation != self.expectation:
            self.expectation = expectation
            for health in self._pool.records():
                health.model = "unchecked"

    async def admits(self, transport: Transport, server: str, deadline: float | None) -> bool:
        """Whether ``server`` may take a call: asked first if it never was (one check at a time per
        server; concurrent calls wait for it). The check counts against the caller's ``deadline``
        (:class:`~epd_middleware._upstream.DeadlinePassed`); a check cut short by another caller's
        deadline gives no verdict, so a waiter asks itself."""
        if self.expectation is None:
            return True
        pool = self._pool
        if pool.record(server).model not in _ASK:
            return pool.record(server).model == "ok"
        with anyio.CancelScope(deadline=math.inf if deadline is None else deadline) as scope:
            while pool.record(server).model in _ASK:
                running = self._checking.get(server)
                if running is not None:
                    await running.done.wait()
                    if running.finished:
                        break
                    continue
                self._checking[server] = check = _Check()
                try:
                    await self.check(transport, [server], self.headers)
                    check.finished = True
                finally:
                    del self._checking[server]
                    check.done.set()
                break
        if scope.cancelled_caught:
            raise DeadlinePassed
        # The record may have gone meanwhile (a stranger forgotten to make room): no verdict, not used.
        health = pool.known(server)
        return health is not None and health.model == "ok"

    async def check(
        self, transport: Transport, urls: Sequence[str], headers: Mapping[str, str], *, recheck: bool = False
    ) -> None:
        """Ask ``urls`` (``recheck``: and every member not known to match) what they serve, concurrently,
        within the health-check timeout each; a change of verdict is logged once and exported."""
        pool, expectation = self._pool, self.expectation
        if recheck:
            urls = [*urls, *(url for url in pool.members if pool.record(url).model != "ok")]

        async def one(url: str) -> None:
            result = await check_models(transport, url, expectation, headers, self._timeout)
            health = pool.record(url)
            changed = (health.model, health.served) != (result.state, result.served)
            health.model, health.served = result.state, result.served
            health.names = frozenset(name for name, _ in result.models)
            if result.state == "unreachable":
                # As a failed call: a server that keeps not answering is ejected, and not asked again
                # by every request while it is.
                pool.record_failure(url, anyio.current_time(), result.served)
            if pool.is_member(url):
                pool.stats.model_check(pool.role, url, result.state == "ok")
                if changed:
                    pool.export_health(url)
            if changed:
                _log_verdict(pool.role, url, result, expectation, self.unserved_aliases(url))

        async with anyio.create_task_group() as group:
            for url in dict.fromkeys(urls):
                group.start_soon(one, url)

    def own_name(self, model: str) -> str:
        """A name of this server's own for a call that must not depend on a client's (the canary):
        ``model`` where this server answers to it, else one of its names; ``model`` where they are not
        known. A client's request for a name no server serves is answered 404 by every encoder: the
        canary must not ask for it too, and take that for the servers' failure."""
        expectation = self.expectation
        if expectation is None or model in expectation.names or not expectation.names:
            return model
        return sorted(expectation.names)[0]

    def name_for(self, server: str, model: object) -> str | None:
        """The model name to send ``server`` for a request to ``model``, where it does not serve that
        name but serves another name this server answers to (an alias of PD's ``--served-model-name``
        it lacks: vLLM would answer 404 to every request for it); None: send ``model`` as it is."""
        expectation, health = self.expectation, self._pool.known(server)
        if expectation is None or health is None or not health.names or model in health.names:
            return None
        if not isinstance(model, str) or model not in expectation.names:
            return None  # not one of this server's names (a LoRA adapter's, say): the server judges it
        served = sorted(expectation.names & health.names)
        return served[0] if served else None

    def serves(self, server: str, model: str) -> bool:
        """Whether ``model`` is known to be served by ``server``: one of this server's own names, or one
        ``server`` listed (GET /v1/models)."""
        expectation, health = self.expectation, self._pool.known(server)
        return (expectation is not None and model in expectation.names) or (
            health is not None and model in health.names
        )

    def unserved_aliases(self, server: str) -> frozenset[str]:
        """The names this server answers to that ``server`` (a match) does not serve."""
        expectation, health = self.expectation, self._pool.known(server)
        if expectation is None or health is None or health.model != "ok":
            return frozenset()
        return expectation.names - health.names

    def mismatched(self) -> list[tuple[str, str]]:
        """Members that answered with another model, and what they serve."""
        pool = self._pool
        return [
            (url, pool.record(url).served) for url in pool.members if pool.record(url).model == "mismatch"
        ]


def _log_verdict(
    role: str, url: str, result: ModelCheck, expectation: Expectation | None, unserved: frozenset[str]
) -> None:
    wanted = expectation.describe() if expectation else "?"
    if result.state == "ok" and unserved:
        logger.warning(
            "%s %s serves %s but not %s, which this server also answers to: requests for %s are sent "
            "to it under a name it serves; give every server the same --served-model-name",
            role,
            url,
            result.served,
            ", ".join(sorted(unserved)),
            "them" if len(unserved) > 1 else "it",
        )
    elif result.state == "ok":
        logger.info("%s %s serves %s", role, url, result.served)
    elif result.state == "mismatch":
        logger.warning(
            "%s %s is not used: it serves %s (this server serves %s)", role, url, result.served, wanted
        )
    else:
        logger.warning(
            "%s %s did not say what it serves (%s); it is asked again before its next call",
            role,
            url,
            result.served,
        )
