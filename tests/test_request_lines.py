"""The line per request follows vLLM's --enable-log-requests inside vLLM (off by default, as vLLM's own),
or the log_requests option. Before, inside vLLM every request with media wrote an INFO line through vLLM's
handlers whatever vLLM was told: about 40 us of PD's API-server loop a request, a tenth of the
middleware's CPU for one image (benchmarks: the in-process figure in docs/performance.md)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from epd_middleware import EPDConfig, Host

from .fakes import FakeEncoders, FakeEngine, build_app, chat_body, image
from .test_middleware import E0, E1, png, post

pytestmark = pytest.mark.anyio


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == "epd_middleware"]


@pytest.mark.parametrize(
    ("flag", "option", "expected"),
    [
        (None, None, False),  # vLLM without the flag (an older args object): no line, as vLLM writes none
        (False, None, False),  # vLLM's default
        (True, None, True),  # vllm serve --enable-log-requests
        (False, True, True),  # the option, where it is set, decides
        (True, False, False),
    ],
)
def test_inside_vllm_the_line_follows_enable_log_requests_unless_the_option_says(
    flag: bool | None, option: bool | None, expected: bool
) -> None:
    args = SimpleNamespace() if flag is None else SimpleNamespace(enable_log_requests=flag)
    config = EPDConfig(encoders=(E0,), health_check_interval=0, log_requests=option)
    assert Host.of_vllm(SimpleNamespace(), args, config).log_requests is expected


@pytest.mark.parametrize(("option", "expected"), [(None, True), (True, True), (False, False)])
def test_outside_vllm_the_line_is_on_unless_the_option_turns_it_off(
    option: bool | None, expected: bool
) -> None:
    config = EPDConfig(encoders=(E0,), health_check_interval=0, log_requests=option)
    assert Host.outside(config).log_requests is expected


def test_the_option_reads_from_the_environment() -> None:
    assert EPDConfig.from_env({"EPD_ENCODERS": E0, "EPD_LOG_REQUESTS": "false"}).log_requests is False
    assert EPDConfig.from_env({"EPD_ENCODERS": E0}).log_requests is None


@pytest.mark.parametrize("on", [True, False])
async def test_without_the_line_a_request_logs_only_what_went_wrong(
    on: bool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "epd_middleware")
    encoders, engine = FakeEncoders([E1, E0], mode={E1: "500"}), FakeEngine()
    app, _ = build_app(encoders, engine, host=Host(log_requests=on))
    response = await post(app, chat_body(image(png(1))), headers={"x-request-id": "quiet-1"})
    assert response.status_code == 200
    about = lines(caplog)
    # The failover is a warning, whatever the line per request says.
    assert any(line.startswith(f"request quiet-1: encoder {E1} failed: HTTP 500") for line in about)
    assert any("media item(s)" in line for line in about) is on
