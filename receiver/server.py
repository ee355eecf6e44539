"""The receiver's HTTP endpoints: what an operator and a monitoring system ask a receiver.

======================  ============================================================
``GET /healthz``        200 ``{"ok": true}`` while the agent runs and its last sync
                        succeeded; 503 with the last error otherwise (liveness)
``GET /readyz``         200 only while the engine *serves* the newest committed version
                        (or one at most ``ready_max_lag`` behind); 503 otherwise. For a
                        server engine the server is asked (``Engine.serving_version``), so
                        a restarted SGLang is not ready until the receiver reloaded it:
                        the readiness gate of the inference container. With an auditor,
                        also 503 from a served-bytes mismatch until it is repaired. Serving
                        nothing, the body names the last sync's error (``error``); a root
                        it cannot read (permissions, a stale NFS handle): 503 saying so
``GET /status``         JSON: engine id, applied version, newest version seen, lag, last
                        error, the version in flight and its progress, counters, the
                        audit's last result (``audit``)
``GET /metrics``        Prometheus text format (prometheus-client)
``POST /sync``          control: sync now. Needs ``Authorization: Bearer <token>``; with
                        no token configured, control endpoints answer 403
======================  ============================================================

While :attr:`StatusServer.starting` says why (``asyncsync-receiver`` retrying the start of its
engine), ``/readyz`` answers 503 with it; ``/healthz`` 200 (alive: a liveness probe must not
restart a receiver for a slow engine) and ``/status`` name it as ``starting``.

It binds ``127.0.0.1`` unless told otherwise: status reveals paths and versions, so exposing it
is an explicit decision. The token is compared in constant time and never logged. Whoever can
reach the port must not be able to starve the receiver of file descriptors: at most
``max_connections`` are open at once (more are closed as soon as they are accepted), and a
connection that has not sent a complete request ``header_timeout`` seconds after it opened or
after its last response is closed (slow or idle clients), and so is one whose answers could
not be sent for ``header_timeout`` (a client that sends requests and reads no answer).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any, cast

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from asyncsync.errors import ConfigError, check_number, check_seconds
from receiver.agent import ReceiverAgent
from receiver.audit import Auditor
from receiver.listen import bind_sockets, is_unspecified, resolve, url_host
from receiver.plan import latest_version

__all__ = ["MIN_TOKEN_CHARS", "StatusServer", "check_token"]

logger = logging.getLogger(__name__)

_PROM_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _AgentCollector(Collector):
    """Reads the agent's status at scrape time (no state of its own)."""

    def __init__(self, agent: ReceiverAgent, auditor: Auditor | None = None):
        self.agent = agent
        self.auditor = auditor

    def collect(self) -> Iterator[Any]:
        st = self.agent.status()
        labels = ["engine_id"]
        values = [st.engine_id]

        def gauge(name: str, doc: str, value: float | None) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"asyncsync_receiver_{name}", doc, labels=labels)
            g.add_metric(values, float("nan") if value is None else float(value))
            return g

        def counter(name: str, doc: str, value: int) -> CounterMetricFamily:
            c = CounterMetricFamily(f"asyncsync_receiver_{name}", doc, labels=labels)
            c.add_metric(values, float(value))
            return c

        yield gauge("version", "Version the engine holds (NaN: none yet).", st.version)
        yield gauge("latest_version", "Newest committed version seen in the root.", st.latest)
        yield gauge("lag_versions", "Versions between the newest and the engine's.", st.lag)
        yield gauge(
            "last_apply_seconds", "Seconds the last version took to apply.", st.last_apply_seconds
        )
        yield gauge("applying", "1 while a version is being applied.", int(st.applying is not None))
        yield gauge(
            "bad_versions",
            "Versions found damaged or unusable and gone past.",
            len(st.bad_versions),
        )
        yield gauge(
            "newest_bad_version",
            "The newest bad version (NaN: none).",
            st.bad_versions[-1] if st.bad_versions else None,
        )
        yield counter("applied", "Versions applied.", st.applied)
        yield counter("failures", "Syncs that failed (the engine kept its version).", st.failures)
        yield counter(
            "prefetched_shards", "Shards read before their manifest existed.", st.prefetched_shards
        )
        au = self.auditor
        if au is not None:
            last = au.last
            yield gauge("audit_ok", "1: the engine serves the manifest's bytes (last audit).",
                        None if last is None else int(au.healthy))  # fmt: skip
            yield gauge("audit_version", "Version the last audit checked.",
                        None if last is None else last.version)  # fmt: skip
            yield gauge("audit_mismatched_tensors", "Tensors the last audit found differing.",
                        None if last is None else len(last.mismatched))  # fmt: skip
            yield gauge("audit_timestamp_seconds", "When the last audit ran (Unix time).",
                        au.last_at)  # fmt: skip
            yield counter("audits", "Audits of the served bytes.", au.stats.audits)
            yield counter("audit_mismatches", "Audits that found other bytes served.",
                          au.stats.mismatches)  # fmt: skip
            yield counter("audit_repairs", "Full reloads after a mismatch.", au.stats.repairs)
            yield counter("audit_errors", "Audits that could not run.", au.stats.errors)
        for name, (doc, value) in self.agent.engine.metrics().items():
            yield gauge(f"engine_{name}", doc, value)


class _Capped(asyncio.Protocol):
    """The HTTP protocol of one connection, or nothing when the server is full: a connection
    past the cap is closed the moment it is accepted, so its descriptor is freed at once. One
    whose client reads no answer (its answers wait unsent: pipelined requests, never read)
    is closed once writing to it has stalled for the runner's ``stall_timeout``."""

    def __init__(self, runner: _CappedRunner, inner: asyncio.Protocol) -> None:
        self.runner = runner
        self.inner: asyncio.Protocol | None = inner
        self.transport: asyncio.Transport | None = None
        self.stall: asyncio.TimerHandle | None = None  # while writing is paused

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        r = self.runner
        if r.open >= r.max_connections or self.inner is None:
            self.inner = None
            r.refused += 1
            if time.monotonic() - r.warned > 60:
                r.warned = time.monotonic()
                logger.warning(
                    "status port: %d connections open (the most allowed): refusing more "
                    "(%d so far); is something scanning or flooding it?", r.open, r.refused,
                )  # fmt: skip
            cast(asyncio.Transport, transport).abort()
            return
        r.open += 1
        self.transport = cast(asyncio.Transport, transport)
        self.inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._unstall()
        self.transport = None
        if self.inner is not None:
            self.runner.open -= 1
            self.inner.connection_lost(exc)
            self.inner = None

    def data_received(self, data: bytes) -> None:
        if self.inner is not None:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return None if self.inner is None else self.inner.eof_received()

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()
            if self.stall is None and self.transport is not None:
                loop = asyncio.get_running_loop()
                self.stall = loop.call_later(self.runner.stall_timeout, self._stalled)

    def resume_writing(self) -> None:
        self._unstall()
        if self.inner is not None:
            self.inner.resume_writing()

    def _unstall(self) -> None:
        if self.stall is not None:
            self.stall.cancel()
            self.stall = None

    def _stalled(self) -> None:
        self.stall = None
        r = self.runner
        r.stalled += 1
        if time.monotonic() - r.stall_warned > 60:
            r.stall_warned = time.monotonic()
            logger.warning(
                "status port: closed a connection whose client read no answer for %gs (%d so "
                "far)", r.stall_timeout, r.stalled,
            )  # fmt: skip
        if self.transport is not None:
            self.transport.abort()


class _HttpLog:
    """aiohttp's server logger for the status port. A malformed request (a 400: a bad header,
    a port scanner's probe) is the client's fault, not the receiver's: one WARNING line a
    minute with the count, no traceback (aiohttp logs an ERROR with its traceback for each, so
    any client of the port could fill the receiver's log). Anything else, a handler's own
    exception, is logged with its traceback as aiohttp does."""

    def __init__(self) -> None:
        self.malformed = 0
        self.warned = -float("inf")

    def debug(self, msg: str, *args: Any, **kwargs: Any) -> None:
        logger.debug(msg, *args, **kwargs)

    def warning(self, msg: str, *args: Any, **kwargs: Any) -> None:
        logger.warning(msg, *args, **kwargs)

    def exception(self, msg: str, *args: Any, exc_info: Any = True, **kwargs: Any) -> None:
        if not isinstance(exc_info, HttpProcessingError):
            logger.error(msg, *args, exc_info=exc_info, **kwargs)
            return
        self.malformed += 1
        now = time.monotonic()
        if now - self.warned > 60:
            self.warned = now
            what = " ".join(str(exc_info.message).split())[:120]
            logger.warning(
                "status port: refused %d malformed request(s) (400) so far; the latest: %s",
                self.malformed, what,
            )  # fmt: skip


class _CappedRunner(web.AppRunner):
    """An AppRunner whose sites take at most ``max_connections`` connections at once."""

    def __init__(
        self, app: web.Application, *, max_connections: int, stall_timeout: float, **kwargs: Any
    ) -> None:
        super().__init__(app, **kwargs)
        self.max_connections = max_connections
        self.stall_timeout = stall_timeout
        self.open = 0
        self.refused = 0
        self.warned = 0.0
        self.stalled = 0
        self.stall_warned = -float("inf")

    @property
    def server(self) -> Any:  # the protocol factory the sites listen with
        inner = super().server
        if inner is None:
            return None
        return lambda: _Capped(self, inner())


#: the shortest control token StatusServer takes (asyncsync-receiver checks it before it opens
#: the engine)
MIN_TOKEN_CHARS = 16


def check_token(token: object, what: str = "StatusServer: token") -> None:
    """ConfigError naming ``what`` unless ``token`` is None or a str a client can send back in
    a header: one line of printable ASCII without surrounding whitespace (HTTP strips it), of
    at least :data:`MIN_TOKEN_CHARS`."""
    if token is None:
        return
    if not isinstance(token, str):
        raise ConfigError(f"{what} must be a str or None, got {type(token).__name__}")
    if not token.isprintable() or token != token.strip():
        raise ConfigError(
            f"{what} must be one line of printable characters without surrounding whitespace "
            "(no HTTP header carries another)"
        )
    if not token.isascii():  # urllib sent it as Latin-1, curl and aiohttp as UTF-8: 401 or not
        raise ConfigError(f"{what} must be ASCII (HTTP clients encode other characters apart)")
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(
            f"{what}: the control token must be at least {MIN_TOKEN_CHARS} characters (got "
            f"{len(token)}): generate one, e.g. `openssl rand -hex 16`"
        )


class StatusServer:
    """Serves ``/healthz``, ``/status``, ``/metrics`` and ``POST /sync`` for one agent.

    Example::

        async with StatusServer(agent, port=9500, token=token) as server:
            await agent.run()

    ``option_names``: what the errors of :meth:`start` call the host and the port (a command
    line names its options: a port taken since its own check says which option to change).
    """

    def __init__(
        self,
        agent: ReceiverAgent,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        ready_max_lag: int = 0,
        ready_timeout: float = 5.0,
        auditor: Auditor | None = None,
        max_connections: int = 64,
        header_timeout: float = 10.0,
        option_names: tuple[str, str] = ("StatusServer: host", "StatusServer: port"),
    ) -> None:
        check_token(token)
        check_number("StatusServer: ready_max_lag", ready_max_lag, integer=True)
        check_number("StatusServer: max_connections", max_connections, integer=True, minimum=1)
        check_seconds("StatusServer: ready_timeout", ready_timeout, above=True)
        check_seconds("StatusServer: header_timeout", header_timeout, above=True)
        self.max_connections = max_connections
        self.header_timeout = header_timeout
        self.ready_max_lag = ready_max_lag
        self.ready_timeout = ready_timeout
        self.agent = agent
        self.auditor = auditor
        self.host = host
        self.port = port
        # what start()'s errors call the host and the port (the CLI: its options)
        self._names = {"host_option": option_names[0], "port_option": option_names[1]}
        self._token = token
        self._collector = _AgentCollector(agent, auditor)
        self._registry = CollectorRegistry(auto_describe=True)
        self._registry.register(self._collector)
        #: while set, the receiver is starting (its engine not open yet): /readyz answers 503
        #: with this as ``why``; /healthz and /status say it as ``starting``
        self.starting: str | None = None
        self._runner: _CappedRunner | None = None
        self._sites: list[web.SockSite] = []
        self._scan: asyncio.Future[int | None] | None = None  # /readyz's scan of the root
        self._url_host = host  # (start: as a client on this host reaches it)

    @property
    def open_connections(self) -> int:
        """Connections open now (at most ``max_connections``)."""
        return 0 if self._runner is None else self._runner.open

    @property
    def url(self) -> str:
        """A URL a client on this host reaches the server at: bound to every interface (``::``,
        ``0.0.0.0``), the loopback (from another host: this host's address, same port)."""
        if not self._sites:
            raise RuntimeError("the server is not started")
        return f"http://{self._url_host}:{self.port}"

    @property
    def every_interface(self) -> bool:
        """Whether the server is bound to every interface (the host ``::`` or ``0.0.0.0``)."""
        return is_unspecified(self.host)

    def attach(self, agent: ReceiverAgent, auditor: Auditor | None = None) -> None:
        """Report ``agent`` (the one opened) and ``auditor`` from now on; the start is over."""
        self.agent = self._collector.agent = agent
        self.auditor = self._collector.auditor = auditor
        self.starting = None

    async def __aenter__(self) -> StatusServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/status", self._status)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/sync", self._sync)
        # keepalive_timeout: aiohttp closes a connection that has no complete request this
        # long after it opened or after its last response (a slow or idle client)
        self._runner = _CappedRunner(
            app,
            max_connections=self.max_connections,
            stall_timeout=self.header_timeout,
            access_log=None,
            keepalive_timeout=self.header_timeout,
            logger=_HttpLog(),
        )
        await self._runner.setup()
        socks = []
        try:
            # bound here, not by aiohttp's TCPSite: "::" dual-stack, the addresses of a name on
            # one port (receiver.listen)
            names = self._names
            # resolved in a thread: a name behind a slow DNS must not stall the loop
            infos = await asyncio.to_thread(resolve, self.host, self.port, **names)
            socks = bind_sockets(self.host, self.port, infos=infos, check=False, **names)
            for sock in socks:
                self._sites.append(web.SockSite(self._runner, sock))
                await self._sites[-1].start()
        except BaseException:
            for sock in socks:
                sock.close()
            await self.stop()
            raise
        self.port = int(socks[0].getsockname()[1])
        self._url_host = url_host(self.host, socks[0])
        bound = f" (every interface, {self.host})" if self.every_interface else ""
        logger.info("receiver %s serving status on %s%s", self.agent.engine_id, self.url, bound)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        self._runner = None
        self._sites = []

    async def _healthz(self, _request: web.Request) -> web.Response:
        if self.starting is not None:  # alive, waiting for its engine: a liveness probe must
            # not restart it for that (readiness says it is not ready)
            return web.json_response({"ok": True, "version": None, "starting": self.starting})
        st = self.agent.status()
        if st.last_error is None:
            return web.json_response({"ok": True, "version": st.version})
        return web.json_response(
            {"ok": False, "version": st.version, "error": st.last_error}, status=503
        )

    async def _latest(self) -> int | None:
        """The root's newest committed version. A request that arrives while a scan runs waits
        for that one: a scan holds a worker of the pool the agent's own reads wait in, and a
        client asking without pause must not fill it (nor a slow filesystem's listing)."""
        if self._scan is None or self._scan.done():
            agent = self.agent
            self._scan = asyncio.ensure_future(
                asyncio.to_thread(latest_version, agent.root, agent.version)
            )
            self._scan.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved
        return await asyncio.shield(self._scan)  # a client gone does not cancel the others'

    async def _readyz(self, _request: web.Request) -> web.Response:
        if self.starting is not None:
            why = f"starting: {self.starting}"
            return web.json_response({"ready": False, "serving": None, "why": why}, status=503)
        agent = self.agent
        unreadable: str | None = None
        try:
            latest = await self._latest()
        except OSError as exc:  # its permissions changed, a stale NFS handle: the newest unknown
            latest, unreadable = None, f"cannot read the root {agent.root}: {exc}"
        try:
            async with asyncio.timeout(self.ready_timeout):
                serving = await agent.engine.serving_version()
        except TimeoutError:
            serving = None
        body: dict[str, Any] = {"serving": serving, "latest": latest}
        if unreadable is not None:
            body.update(ready=False, why=unreadable)
        elif latest is None:
            body.update(ready=False, why="nothing committed yet")
        elif serving is None:
            body.update(ready=False, why="the engine serves no version the receiver applied")
            if (error := agent.status().last_error) is not None:  # e.g. its files unreadable
                body["error"] = error
            agent.request_sync()  # a restarted server: reconcile it now
        elif latest - serving > self.ready_max_lag:
            body.update(ready=False, why=f"{latest - serving} version(s) behind")
        elif self.auditor is not None and not self.auditor.healthy:
            body.update(ready=False, why="the audit found served bytes that differ: repairing")
        else:
            body.update(ready=True)
        return web.json_response(body, status=200 if body["ready"] else 503)

    async def _status(self, _request: web.Request) -> web.Response:
        body = asdict(self.agent.status())
        body["root"] = str(self.agent.root)
        body["starting"] = self.starting
        if self.auditor is not None:
            body["audit"] = self.auditor.status()
        return web.json_response(body)

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self._registry), headers={"Content-Type": _PROM_CONTENT_TYPE}
        )

    def _authorized(self, request: web.Request) -> web.Response | None:
        if self._token is None:
            return web.json_response(
                {"error": "control endpoints are disabled: start the receiver with a token"},
                status=403,
            )
        # aiohttp decodes header bytes as UTF-8 with surrogateescape: encode them back the same
        # way (a non-UTF-8 header is a wrong token, 401, not an encoding error)
        given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(given, f"Bearer {self._token}".encode()):
            return web.json_response(
                {"error": "missing or wrong bearer token"},
                status=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
        return None

    async def _sync(self, request: web.Request) -> web.Response:
        denied = self._authorized(request)
        if denied is not None:
            return denied
        if not self.agent.request_sync():
            return web.json_response({"error": "the agent is not running"}, status=409)
        return web.json_response({"ok": True, "requested": True}, status=202)
