"""What the documents promise, held to the code (issue 37, item 12): configuration names every bad entry
of a list at once, as docs/configuration.md says; ``check`` tells a name DNS does not have from a name
without addresses; a ``dns+http://`` name /etc/hosts holds resolves as the system resolver would have it;
the GPU examples clean the embeddings they write."""

from __future__ import annotations

import pytest

from epd_middleware import EPDConfig, EPDMiddleware
from epd_middleware.config import ConfigurationError

from .fakes import FakeEngine


def problems_of(env: dict[str, str]) -> list[str]:
    with pytest.raises(ConfigurationError) as raised:
        EPDConfig.from_env(env)
    return raised.value.problems


def test_every_bad_url_of_a_list_is_named_at_once() -> None:
    """Before: the first bad URL of EPD_ENCODERS was named and the others were not, so an operator fixed
    one, restarted, and met the next."""
    problems = problems_of(
        {
            "EPD_ENCODERS": "http://enc-0:abc,http://enc-1:8001,ftp://enc-2:8001,http://user:secret@enc-3:8001",
            "EPD_PREFILL": "http://p-0:99999,http://p-1:8100?x=1",
        }
    )
    assert problems == [
        "EPD_ENCODERS: encoder URL 'http://enc-0:...': the port must be a number from 1 to 65535",
        "EPD_ENCODERS: encoder URL 'ftp://enc-2:8001' is not an http(s) or dns+http(s) URL with a host",
        "EPD_ENCODERS: encoder URL 'http://...@enc-3:8001' carries credentials (user:password@); give "
        "the servers' key as encoder_api_key (EPD_ENCODER_API_KEY) instead",
        "EPD_PREFILL: prefill URL 'http://p-0:99999': the port must be a number from 1 to 65535",
        "EPD_PREFILL: prefill URL 'http://p-1:8100?x=1' must not carry a query or fragment",
    ]
    with pytest.raises(ConfigurationError) as raised:
        EPDMiddleware(FakeEngine().app(), encoders=["http://enc-0:x", "http://enc-1:8001", "http://"])
    assert raised.value.problems == [
        "encoders: encoder URL 'http://enc-0:...': the port must be a number from 1 to 65535",
        "encoders: encoder URL 'http://' is not an http(s) or dns+http(s) URL with a host",
    ]


def test_every_bad_entry_of_the_other_lists_is_named_at_once() -> None:
    problems = problems_of(
        {
            "EPD_ENCODERS": "http://enc-0:8001",
            "EPD_SCHEDULER_ALLOW": "10.0.0.0/33,10.0.0.0/8,nonsense",
            "EPD_DNS_NAMESERVERS": "dns.example:53,10.0.0.10:53,10.0.0.11",
            "EPD_PATHS": "v1/chat/completions,/v1/x,v1/y",
        }
    )
    assert [problem.split(":")[0] for problem in problems] == [
        "EPD_SCHEDULER_ALLOW",
        "EPD_SCHEDULER_ALLOW",
        "EPD_DNS_NAMESERVERS",
        "EPD_DNS_NAMESERVERS",
        "EPD_PATHS",
        "EPD_PATHS",
    ], problems
    named = " ".join(problems)
    for entry in ("v1/chat/completions", "v1/y", "10.0.0.0/33", "nonsense", "dns.example:53", "10.0.0.11"):
        assert repr(entry) in named, entry
