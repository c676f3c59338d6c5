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

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec

from .transport import HTTPError, Transport, UnsendableRequest

__all__ = ["Expectation", "ModelCheck", "check_models", "expectation_of_vllm"]

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
    said it serves (or why it could not be asked); ``seconds`` the time the answer took."""

    state: str
    served: str
    seconds: float


def expectation_of_vllm(vllm_config: object) -> Expectation | None:
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


async def check_models(
    client: Transport,
    url: str,
    expectation: Expectation | None,
    headers: Mapping[str, str],
    limit: float,
) -> ModelCheck:
    """Ask ``url`` what it serves and judge it against ``expectation`` (None: only reachability)."""
    started = time.perf_counter()
    try:
        with anyio.fail_after(limit):
            status, content = await client.request("GET", f"{url}{MODELS_PATH}", headers=headers)
    except TimeoutError:
        return ModelCheck("unreachable", f"no answer to GET {MODELS_PATH} within {limit:g} s", limit)
    except (HTTPError, UnsendableRequest) as exc:
        return ModelCheck("unreachable", exc.reason, time.perf_counter() - started)
    seconds = time.perf_counter() - started
    if status != 200:
        return ModelCheck("unreachable", f"GET {MODELS_PATH} answered HTTP {status}", seconds)
    try:
        models: Any = _decode(content)["data"]
        ids = [str(model["id"]) for model in models]
        roots = [str(model.get("root") or "") for model in models]
    except (msgspec.DecodeError, RecursionError, KeyError, TypeError, AttributeError):
        return ModelCheck("unreachable", f"GET {MODELS_PATH} answered no model list", seconds)
    served = ", ".join(f"{name} ({root})" if root else name for name, root in zip(ids, roots, strict=True))
    if expectation is None:
        return ModelCheck("ok", served or "no model", seconds)
    matches = bool(expectation.names & set(ids)) and (expectation.root is None or expectation.root in roots)
    return ModelCheck("ok" if matches else "mismatch", served or "no model", seconds)
