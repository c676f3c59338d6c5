"""The soak's DNS server (benchmarks/soak.py) in a process of its own: tests/dns_server.py on a loopback
UDP port, whose records are replaced by each JSON line read on stdin (``{"name": ["127.0.0.2", ...]}``).

    python -m tests.load.soak_dns

prints ``ready HOST:PORT`` once it answers, and stops at the end of its stdin.
"""

from __future__ import annotations

import json
import sys

import anyio
import anyio.to_thread

from tests.dns_server import DNSServer, dns_server


def follow(server: DNSServer) -> None:
    for line in sys.stdin:
        if line.strip():
            server.records = {name: list(addresses) for name, addresses in json.loads(line).items()}


async def main() -> None:
    async with dns_server() as server:
        print(f"ready {server.address}", flush=True)
        await anyio.to_thread.run_sync(follow, server)


if __name__ == "__main__":
    anyio.run(main)
