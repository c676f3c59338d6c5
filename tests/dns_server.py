"""A DNS server on a loopback UDP port whose records the test changes while it runs.

Answers A and AAAA queries from ``records`` (name -> addresses; a name that is absent is NXDOMAIN), with
a TTL of 1 s. ``mode``: "ok", "drop" (never answers: a dead DNS server), "servfail".
"""

from __future__ import annotations

import ipaddress
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
import anyio.abc
import dns.flags
import dns.message
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset


@dataclass
class DNSServer:
    records: dict[str, list[str]] = field(default_factory=dict)
    mode: str = "ok"
    queries: int = 0
    address: str = ""

    def answer(self, wire: bytes) -> bytes | None:
        self.queries += 1
        if self.mode == "drop":
            return None
        query = dns.message.from_wire(wire)
        response = dns.message.make_response(query)
        response.flags |= dns.flags.AA
        if self.mode == "servfail":
            response.set_rcode(dns.rcode.SERVFAIL)
            return response.to_wire()
        question = query.question[0]
        name = question.name.to_text().rstrip(".").lower()
        addresses = self.records.get(name)
        if addresses is None:
            response.set_rcode(dns.rcode.NXDOMAIN)
            return response.to_wire()
        version = 4 if question.rdtype == dns.rdatatype.A else 6
        matching = [a for a in addresses if ipaddress.ip_address(a).version == version]
        if matching and question.rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
            response.answer.append(
                dns.rrset.from_text_list(question.name, 1, dns.rdataclass.IN, question.rdtype, matching)
            )
        return response.to_wire()


@asynccontextmanager
async def dns_server(records: dict[str, list[str]] | None = None) -> AsyncIterator[DNSServer]:
    server = DNSServer(dict(records or {}))
    async with await anyio.create_udp_socket(local_host="127.0.0.1") as sock:
        port = sock.extra(anyio.abc.SocketAttribute.local_port)
        server.address = f"127.0.0.1:{port}"

        async def serve() -> None:
            async for wire, sender in sock:
                reply = server.answer(wire)
                if reply is not None:
                    await sock.sendto(reply, *sender)

        async with anyio.create_task_group() as group:
            group.start_soon(serve)
            try:
                yield server
            finally:
                group.cancel_scope.cancel()
