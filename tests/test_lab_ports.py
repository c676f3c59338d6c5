"""epd_lab.servers.free_port: a port handed out once is never handed out again by the same process, even
while nobody has bound it yet (the servers given these ports bind them seconds later)."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from epd_lab import servers


class KernelOffering:
    """A socket whose bind(("127.0.0.1", 0)) gets the next of ``ports``, as the kernel may offer a port
    again once its first taker closed the probe socket."""

    def __init__(self, ports: list[int]) -> None:
        self.ports = ports

    def __call__(self, *args: Any, **kwargs: Any) -> KernelOffering:
        return self

    def __enter__(self) -> KernelOffering:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def bind(self, address: tuple[str, int]) -> None:
        self.port = self.ports.pop(0)

    def getsockname(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)


def test_a_port_offered_again_is_not_handed_out_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(servers, "_HANDED_OUT", set(), raising=False)
    monkeypatch.setattr(servers.socket, "socket", KernelOffering([54265, 54265, 54265, 41000]))
    assert servers.free_port() == 54265
    # The OTLP receiver given 54265 has not bound it yet; the kernel offers it again to the next server.
    assert servers.free_port() == 41000


def test_ports_are_free_loopback_ports_and_all_different() -> None:
    ports = [servers.free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    for port in ports[:5]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
