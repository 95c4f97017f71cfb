"""The api worker's listening socket, guarded: how many connections it keeps open in all and from
one client address, so that no client can take every file descriptor from the others.

A connection over either cap gets a 503 with Retry-After written straight onto its socket and is
closed soon after; nothing it sends is parsed. The header timeout lives in aiohttp itself: its
keep-alive timer runs from a connection's start and from the end of each response, and closes the
connection if a request's headers have not all arrived by then (see `runner_options`)."""

from __future__ import annotations

import asyncio
import resource
import socket
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from api.errors import ApiError
from runtime.obs.metrics import metrics

RETRY_AFTER_S = 1
REFUSAL_LINGER_S = 1.0  # a refused socket is read (and dropped) this long before it closes: closed unread, its 503 would be lost to a reset
# bytes the kernel may hold unsent for a connection: more, and writes wait here, where a stream's backlog is
# counted (api.app.Inbox), rather than megabytes queueing unseen in the kernel for a client that does not read
NOTSENT_LOWAT = 128 << 10
FD_RESERVE = 256  # descriptors a worker keeps for what is not a client's connection: rings, logs, files


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int  # open at once in this worker
    max_client_connections: int  # open at once in this worker from one client address
    header_timeout: float  # seconds from a connection's start, or its last response, to a request's last header


def connection_cap(wanted: int) -> int:
    """--max-connections, lowered to stay below this process's file-descriptor limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return wanted if soft == resource.RLIM_INFINITY else max(1, min(wanted, soft - FD_RESERVE))


def runner_options(limits: ConnectionLimits) -> dict:
    """The AppRunner's keywords that put the header timeout in force."""
    return {"keepalive_timeout": limits.header_timeout}


def _refusal(message: str) -> bytes:
    body = orjson.dumps(ApiError(message, 503, kind="server_error", code="too_many_connections").body())
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
        f"Retry-After: {RETRY_AFTER_S}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class ConnectionGuard:
    """Counts this worker's open connections by client address."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.open = 0
        self.refused = 0  # refused sockets not yet closed: they hold descriptors too
        self.by_client: Counter[str] = Counter()

    def admit(self, client: str) -> str | None:
        """Count a new connection in, or say why it may not be."""
        if self.open >= self.limits.max_connections:
            return f"the server holds its limit of {self.limits.max_connections} open connections (--max-connections); retry shortly"
        if self.by_client[client] >= self.limits.max_client_connections:
            return (
                f"this client address holds its limit of {self.limits.max_client_connections} open connections "
                "(--max-client-connections); reuse connections or close idle ones"
            )
        self.open += 1
        self.by_client[client] += 1
        return None

    def release(self, client: str) -> None:
        self.open -= 1
        self.by_client[client] -= 1
        if not self.by_client[client]:
            del self.by_client[client]


class GuardedProtocol(asyncio.Protocol):
    """Stands in front of aiohttp's RequestHandler for one connection: refuses it over a cap, else
    hands every event on."""

    def __init__(self, make_handler: Callable[[], RequestHandler], guard: ConnectionGuard) -> None:
        self.make_handler, self.guard = make_handler, guard
        self.handler: RequestHandler | None = None  # made once admitted: a refusal costs no parser
        self.client: str | None = None  # set once admitted
        self.refused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        client = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        if (why := self.guard.admit(client)) is not None:
            metrics().refused_connections.inc()
            transport = cast("asyncio.Transport", transport)  # uvloop's is one without subclassing it
            transport.write(_refusal(why))
            if self.guard.open + self.guard.refused >= self.guard.limits.max_connections:
                transport.close()  # a flood: no descriptor is kept for it, and the 503 may be lost to a reset
                return
            self.refused = True
            self.guard.refused += 1
            transport.write_eof()
            asyncio.get_running_loop().call_later(REFUSAL_LINGER_S, transport.close)
            return
        self.client = client
        self.handler = handler = self.make_handler()
        sock = transport.get_extra_info("socket")
        if sock is not None and hasattr(socket, "TCP_NOTSENT_LOWAT"):  # Linux and macOS
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, NOTSENT_LOWAT)
        handler.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.refused:
            self.guard.refused -= 1
        if self.client is None or self.handler is None:
            return
        self.guard.release(self.client)
        self.handler.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.handler is not None:
            self.handler.data_received(data)

    def eof_received(self) -> None:
        if self.handler is not None:
            self.handler.eof_received()

    def pause_writing(self) -> None:
        if self.handler is not None:
            self.handler.pause_writing()

    def resume_writing(self) -> None:
        if self.handler is not None:
            self.handler.resume_writing()


class GuardedSite(web.BaseSite):
    """aiohttp's TCPSite with SO_REUSEPORT, each connection behind a GuardedProtocol."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, guard: ConnectionGuard, backlog: int = 1024) -> None:
        super().__init__(runner, backlog=backlog)
        self._host, self._port, self._guard = host, port, guard

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        factory: Callable[[], asyncio.Protocol] = lambda: GuardedProtocol(server, self._guard)  # noqa: E731
        self._server = await asyncio.get_running_loop().create_server(
            factory, self._host, self._port, backlog=self._backlog, reuse_port=True
        )
