"""Workers found through DNS (`pagoda router --discover HOST:PORT`), for Kubernetes: HOST is a
headless Service whose A/AAAA records are the ready pods of a replica Deployment. Each
`--health-interval` the name is resolved again; an address that appeared is added as a worker
(and warms up through the registry's ramp once its /health answers), one that vanished is
removed. An HPA or KEDA that scales the Deployment thus changes the router's workers without an
admin call. A failed lookup changes nothing (a DNS hiccup must not empty the router)."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable

logger = logging.getLogger("pagoda.router")


def parse_target(target: str) -> tuple[str, int]:
    """`HOST:PORT` (the port is required: a Service's port is not guessable)."""
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--discover takes HOST:PORT (a headless Service and the replicas' port), got {target!r}")
    return host.strip("[]"), int(port)


def worker_url(address: str, port: int) -> str:
    host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    return f"http://{host}:{port}"


class DnsDiscovery:
    """Keeps the workers from `targets` in step with what their names resolve to."""

    def __init__(self, targets: list[str], add: Callable[[str], Awaitable[None]],
                 remove: Callable[[str], None]) -> None:
        self.targets = [parse_target(t) for t in targets]
        self.add, self.remove = add, remove
        self.found: set[str] = set()  # the URLs this discovery added (workers given by --worker stay)

    async def resolve(self) -> set[str] | None:
        """Every target's addresses as worker URLs; None if any lookup failed."""
        loop = asyncio.get_running_loop()
        urls: set[str] = set()
        for host, port in self.targets:
            try:
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as e:
                logger.warning("--discover %s:%d: lookup failed (%s); the workers stay as they are", host, port, e)
                return None
            urls.update(worker_url(info[4][0], port) for info in infos)
        return urls

    async def sync(self) -> None:
        urls = await self.resolve()
        if urls is None:
            return
        for url in sorted(urls - self.found):
            logger.info("--discover: worker %s appeared", url)
            await self.add(url)
        for url in sorted(self.found - urls):
            logger.info("--discover: worker %s is gone", url)
            self.remove(url)
        self.found = urls

    async def run_forever(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self.sync()
            except Exception:  # a bug here must not stop discovery for good
                logger.exception("worker discovery failed")
