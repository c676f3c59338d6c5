"""The encoders and the EC storage are a trust boundary (issue 35, item 7): a content uuid names an
embedding on every encoder and in the shared storage, and an encoder that finds one under a uuid loads it
instead of encoding. So the uuid of a request's media must not be computable by anyone without the fleet's
secret: else whoever reaches an encoder plants an embedding under the uuid a victim's image will have.
"""

from __future__ import annotations

from typing import Any

import pytest

from epd_middleware import EPDConfig
from epd_middleware._plan import UuidKey, content_uuid

from .fakes import FakeEncoders, FakeEngine, build_app, chat_body, image
from .test_middleware import E0, png, post

pytestmark = pytest.mark.anyio

URL = f"data:image/png;base64,{png(1)}"


def sent_uuid(encoders: FakeEncoders) -> str:
    [call] = encoders.calls
    [part] = call.body["messages"][0]["content"]
    uuid: str = part["uuid"]
    return uuid


async def uuid_through(**options: Any) -> str:
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine, **options)
    assert (await post(app, chat_body(image(png(1))))).status_code == 200
    return sent_uuid(encoders)


async def test_the_uuid_an_encoder_sees_is_not_the_public_hash_of_the_media() -> None:
    """Before: the uuid was BLAKE3 of the media, unkeyed; anyone could compute it for any image and plant
    an embedding under it with one direct call to an encoder (or one file in the storage)."""
    public = content_uuid("image", (URL,))
    assert await uuid_through(uuid_key=None) != public
    assert await uuid_through() != public  # the fakes' fleet secret


async def test_without_a_fleet_secret_each_process_keys_its_own_uuids() -> None:
    first, second = await uuid_through(uuid_key=None), await uuid_through(uuid_key=None)
    assert first != second
    assert len(first) == len(second) == 32
    assert int(first, 16) >= 0  # still hex: a plain file name


async def test_middlewares_that_share_the_fleet_secret_share_uuids_and_no_one_else_does() -> None:
    secret = "a-fleet-secret-from-a-kubernetes-secret"
    assert await uuid_through(uuid_key=secret) == await uuid_through(uuid_key=secret)
    assert await uuid_through(uuid_key=secret) != await uuid_through(uuid_key=secret + "!")
    assert content_uuid("image", (URL,), key=UuidKey(secret)) == await uuid_through(uuid_key=secret)


def test_a_short_fleet_secret_is_refused() -> None:
    """A secret that can be found by trying keys against one known uuid closes nothing."""
    with pytest.raises(ValueError, match="at least 16 bytes"):
        EPDConfig(encoders=(E0,), uuid_key="short")
    assert "uuid_key" not in repr(EPDConfig(encoders=(E0,), uuid_key="x" * 16))


def test_the_key_is_derived_for_this_use_alone() -> None:
    """BLAKE3's key derivation: the 32 bytes the uuids are keyed with are not the secret itself, nor what
    another use of the same secret would derive."""
    secret = "y" * 32
    assert UuidKey(secret).key != secret.encode()[:32]
    assert UuidKey(secret).key == UuidKey(secret).key
    assert UuidKey(secret).shared
    assert not UuidKey().shared
