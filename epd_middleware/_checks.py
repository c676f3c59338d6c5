"""What is refused before any encoder or prefill call: a cache salt vLLM refuses, metadata-only parts a
client wrote that name an embedding this server cannot confirm it has, references by uuid alone where
the engine cannot encode, client uuids trusted as hashes that are no file name, and media this server's
own policy would not load."""

from __future__ import annotations

from ._media_budget import known_decoded_bytes
from ._media_policy import MediaPolicy
from ._metrics import Stats
from ._protocol import CACHE_SALT, cache_salt_refusal, embedding_stored, embedding_used, plain_file_name
from ._rawjson import text_of
from ._surfaces import ParsedRequest, Surface
from .errors import MediaBudgetExceeded, MediaRefused, RefusedField, UnresolvableReference
from .host import Host

__all__ = [
    "check_by_uuid_alone",
    "check_cache_salt",
    "check_client_uuids",
    "check_media_budget",
    "check_media_policy",
    "check_references",
    "check_references_again",
]


def check_cache_salt(request: ParsedRequest) -> None:
    """A ``cache_salt`` vLLM refuses is refused with vLLM's words before the encoders are called for it
    (and before the reuse cache could key anything by it)."""
    refusal = cache_salt_refusal(text_of(request.fields.get(CACHE_SALT)))
    if refusal is not None:
        raise RefusedField(refusal, param=CACHE_SALT)


def check_references(
    surface: Surface, request: ParsedRequest, host: Host, stats: Stats
) -> tuple[tuple[str, str], ...]:
    """Every metadata-only part the client wrote itself must name an embedding this server has,
    under the identifier the engine will derive: a missing one kills vLLM's engine core. Where the
    middleware cannot confirm it (no storage it can look in, options it cannot follow), it is
    refused. Returns each reference's place and identifier, for :func:`check_references_again`."""
    storage = host.storage
    confirmed: list[tuple[str, str]] = []
    for reference in request.references:
        where = f"the {reference.kind} part at {surface.where(reference.location)}"
        if reference.uuid is None:
            raise UnresolvableReference(
                f"{where} has no uuid: vLLM could not tell which embedding it means", param=surface.field
            )
        if storage is None:
            raise UnresolvableReference(
                f"{where} refers to an embedding this server cannot confirm it has (its EC connector "
                "keeps none the middleware can look at); send the media itself",
                param=surface.field,
            )
        identifier = host.identifiers.identifier(reference.modality, reference.uuid, request.fields)
        if identifier is None:
            raise UnresolvableReference(
                f"{where} refers to an embedding whose identifier under this request's options cannot "
                "be derived here; send the media itself",
                param=surface.field,
            )
        if not embedding_stored(storage, identifier):
            stats.request("reference_refused")
            raise UnresolvableReference(
                f"{where} refers to embedding {identifier[:80]!r}, which this server does not have",
                param=surface.field,
            )
        confirmed.append((where, identifier))
    return tuple(confirmed)


def check_by_uuid_alone(surface: Surface, request: ParsedRequest, host: Host) -> None:
    """A part that refers to earlier media by its uuid alone is raw media to the engine (vLLM takes it
    from its processor cache) that no encoder is asked for: where the engine cannot encode media itself
    (a Mooncake consumer waits for a push of it, then fails), it is refused."""
    blocker = host.local_encoding_blocker
    if blocker is None or not request.referenced_modalities:
        return
    modalities = " and ".join(sorted(request.referenced_modalities))
    raise UnresolvableReference(
        f"the request refers to an earlier {modalities} by its uuid alone, which this server cannot serve "
        f"({blocker}); send the media itself",
        param=surface.field,
    )


def check_references_again(
    surface: Surface, confirmed: tuple[tuple[str, str], ...], host: Host, stats: Stats
) -> None:
    """Just before the engine gets the request: every reference confirmed at the start is still there.
    A slow encoder or prefill call leaves time for a cleanup to remove a file, and the engine would
    die on the reference as on one that never was."""
    storage = host.storage
    for where, identifier in confirmed:
        if storage is None or not embedding_used(storage, identifier):
            stats.request("reference_refused")
            raise UnresolvableReference(
                f"{where} refers to embedding {identifier[:80]!r}, which this server no longer has (it "
                "was removed while the request was being prepared)",
                param=surface.field,
            )


def check_client_uuids(surface: Surface, request: ParsedRequest) -> None:
    """Under ``trust_client_uuid`` a client's uuid is the item's hash, which a connector that stores by
    hash makes a path of (ECExampleConnector: ``<storage>/<hash>/encoder_cache.safetensors``, written by
    the encoder, read by the engine): one that is not a plain file name is refused. With per-request
    options vLLM derives a hex hash instead, but such a uuid is refused all the same."""
    for media in request.media:
        uuid = media.client_uuid
        if uuid is not None and not plain_file_name(uuid):
            raise RefusedField(
                f"the uuid of the {media.modality} part at {surface.where(media.location)} is not a plain "
                "file name (1 to 255 bytes, no '/', '\\' or NUL, not '.' or '..'): it would name a path "
                "in the embedding storage",
                param=surface.field,
            )


async def check_media_policy(surface: Surface, request: ParsedRequest, policy: MediaPolicy) -> None:
    """What this server's own media policy refuses is refused here, before an encoder fetches it."""
    for media in request.media:
        url = media.url
        if url is None:
            continue
        refusal = await policy.refusal(url)
        if refusal is not None:
            raise MediaRefused(refusal, param=surface.field)


def check_media_budget(surface: Surface, request: ParsedRequest, limit: int) -> None:
    """A request whose images alone pass vLLM's per-request decode budget is refused as vLLM refuses it
    (:mod:`epd_middleware._media_budget`): split over encoders, each share would pass."""
    known = known_decoded_bytes(request.media)
    if known > limit:
        raise MediaBudgetExceeded(
            f"Request decoded media exceeds VLLM_MAX_MEDIA_REQUEST_DECODE_BYTES={limit} ({known} bytes for "
            "its images alone).",
            param=surface.field,
        )
