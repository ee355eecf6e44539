"""HTTP plumbing shared by the engines that drive an inference server (SGLang, vLLM).

:class:`HttpClient` is the one way these engines talk to a server:

* one ``aiohttp`` session per engine and event loop (a session belongs to the loop it was made
  in, and an agent serves one ``asyncio.run`` after another): reused for every call in that loop,
  closed as the loop ends (``asyncio.run``'s shutdown of async generators) or by ``close()``;
* a deadline on every call (``timeout=`` per call; the caller picks it, :class:`Timeouts`);
* bounded retries with exponential backoff on connection errors, 5xx answers and timeouts
  (:class:`RetryPolicy`); never a retry on a 4xx: the server understood and said no;
* ``Authorization: Bearer <key>`` on every call when a key is given; with an admin key as well
  (SGLang's ``--admin-api-key``), the calls marked ``admin=True`` carry that one instead. A key
  never appears in a log line, an error message or a ``repr``;
* an answer is read up to :data:`MAX_ANSWER_BYTES`: one that passes it is an error at once, not
  a body held in memory until the deadline;
* every failure is an :class:`EngineHTTPError` (an :class:`~asyncsync.errors.ApplyFailed`)
  carrying the endpoint, the HTTP status and the server's own message, with a hint for the
  statuses an operator can act on (401/403: the key; 404: the server version or mode).

:class:`~receiver.engines.reloading.ReloadingEngine` builds the engines on top of it.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import logging
import math
import random
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

import aiohttp
from yarl import URL

from asyncsync.errors import ApplyFailed, ConfigError, check_number, check_seconds

__all__ = ["EngineHTTPError", "EngineNotUp", "HttpClient", "RetryPolicy", "Timeouts", "transient"]

logger = logging.getLogger(__name__)

_MAX_MESSAGE = 600  # characters of a server's error body kept in an exception

#: the most bytes of one answer read from a server: the largest a server of ours sends is a
#: vLLM audit's checksums (about 150 bytes a tensor: 15 MB for 100,000 tensors); a server that
#: answers more (an endless stream: not the server's own URL) is refused once it passed this,
#: rather than held in memory until the call's deadline (6 GB in 30 s on a loopback)
MAX_ANSWER_BYTES = 64 << 20


class EngineHTTPError(ApplyFailed):
    """A call to the engine's server failed; the engine keeps its last good version.

    ``endpoint`` is e.g. ``"POST /update_weights_from_disk"``; ``status`` the HTTP status, or
    None when no answer came (connection refused or reset, timeout); ``server_message`` what
    the server said (its ``message``/``error``/``detail`` field, else the start of its body).
    """

    def __init__(
        self,
        message: str,
        *,
        endpoint: str,
        status: int | None = None,
        server_message: str | None = None,
    ):
        super().__init__(message)
        self.endpoint = endpoint
        self.status = status
        self.server_message = server_message


class EngineNotUp(EngineHTTPError):
    """The server did not answer its ready path within the start-up deadline (not running,
    unreachable, or still loading past ``--engine-startup-timeout``)."""


def transient(exc: BaseException) -> bool:
    """Whether ``exc``, raised while opening an engine, may pass by itself: a server that
    answered its ready path, then gave no answer (a call timed out: an update still running
    in it, a stopped scheduler) or a 5xx. A 4xx (a refused key, a missing endpoint), a server
    that never came up within the start-up deadline, and every other error are final."""
    if isinstance(exc, EngineNotUp):
        return False
    if isinstance(exc, EngineHTTPError):
        return exc.status is None or exc.status >= 500
    return False


@dataclass(frozen=True)
class RetryPolicy:
    """How often a failed call is retried: ``attempts`` tries in all, sleeping
    ``initial * multiplier**k`` seconds (at most ``maximum``, minus up to ``jitter`` of it,
    at random) between them. Only connection errors, timeouts and 5xx answers are retried."""

    attempts: int = 4
    initial: float = 0.5
    multiplier: float = 2.0
    maximum: float = 8.0
    jitter: float = 0.2

    def __post_init__(self) -> None:
        check_number("RetryPolicy.attempts", self.attempts, integer=True, minimum=1)
        for name in ("multiplier", "jitter"):
            check_number(f"RetryPolicy.{name}", getattr(self, name))
        for name in ("initial", "maximum"):
            check_seconds(f"RetryPolicy.{name}", getattr(self, name))
        if self.initial < 0 or self.maximum < 0 or self.multiplier < 1:
            raise ConfigError("RetryPolicy: initial/maximum must be >= 0 and multiplier >= 1")
        if not 0 <= self.jitter < 1:
            raise ConfigError(f"RetryPolicy.jitter must be in [0, 1), got {self.jitter}")

    def delay(self, retry: int) -> float:
        """Seconds to sleep before retry number ``retry`` (1 = the first retry)."""
        d = min(self.initial * self.multiplier ** (retry - 1), self.maximum)
        return d * (1 - self.jitter * random.random())


@dataclass(frozen=True)
class Timeouts:
    """Per-call deadlines in seconds.

    ``control``: pause, continue, version calls, reads. ``update``: a weight reload (a full
    reload of a large model takes minutes). ``connect``: establishing a connection, within
    either. ``startup``: how long ``open()`` waits for a server that is still starting.
    ``silence``: how long a server that answers nothing (stopped, hung, cut off) keeps the
    ack; a reload in flight does not count (docs/ENGINES.md, "What the agent acknowledges").
    """

    control: float = 30.0
    update: float = 900.0
    connect: float = 10.0
    startup: float = 1800.0
    silence: float = 60.0

    def __post_init__(self) -> None:
        for name in ("control", "update", "connect", "startup", "silence"):
            check_seconds(f"Timeouts.{name}", getattr(self, name), above=True)


def check_url(url: str) -> URL:
    """Parse and validate a server URL (http/https, a host, no credentials in it)."""
    try:
        u = URL(url)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"invalid server URL {url!r}: {exc}") from exc
    if u.scheme not in ("http", "https") or not u.host:
        raise ConfigError(f"server URL must be http(s)://host[:port], got {url!r}")
    if u.user is not None or u.password is not None:
        raise ConfigError("do not put credentials in the server URL; give the API key instead")
    if u.query_string or u.fragment:
        raise ConfigError(f"server URL must not have a query or fragment: {url!r}")
    return u


def _server_message(body: str) -> str:
    """The human part of an error body: JSON ``message``/``error``/``detail``, else the text."""
    try:
        d = json.loads(body)
    except (ValueError, RecursionError):  # (nested past the parser's depth: no server's)
        d = None
    if isinstance(d, dict):
        for key in ("message", "error", "detail"):
            v = d.get(key)
            if isinstance(v, str) and v:
                return v[:_MAX_MESSAGE]
            if isinstance(v, dict | list):
                return json.dumps(v)[:_MAX_MESSAGE]
    text = " ".join(body.split())
    return text[:_MAX_MESSAGE] or "(empty body)"


_USER_KEY = "(--api-key-file or ASYNCSYNC_API_KEY)"
_ADMIN_KEY = "(--admin-api-key-file or ASYNCSYNC_ADMIN_API_KEY)"


def _hint(status: int, admin: str | None = None) -> str:
    """What to do about ``status``; ``admin``: an admin endpoint's call, ``"own"`` when it
    carried the admin key, ``"shared"`` when it carried the API key (no admin key given)."""
    if 300 <= status < 400:
        return "; redirects are not followed: give the server's own URL"
    if status in (401, 403):
        if admin == "own":
            return f"; the server refused the admin API key: give its --admin-api-key {_ADMIN_KEY}"
        if admin == "shared":  # SGLang with --admin-api-key wants that one here, not the API key
            return (
                "; the server refused the API key on an admin endpoint: give the server's "
                f"--admin-api-key if it was started with one {_ADMIN_KEY}, else the key it was "
                f"started with {_USER_KEY}"
            )
        return f"; the server refused the API key: give the key it was started with {_USER_KEY}"
    if status == 404:
        return "; the server has no such endpoint: check the engine kind and its version/mode"
    return ""


class HttpClient:
    """A small JSON-over-HTTP client for one server (see the module docstring).

    Example::

        client = HttpClient(url, api_key=key, admin_api_key=admin, name="sglang")
        info = await client.request("GET", "/model_info", timeout=10)           # user key
        await client.request("POST", "/flush_cache", timeout=10, admin=True)  # admin key
        await client.close()
    """

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        retry: RetryPolicy | None = None,
        connect_timeout: float = 10.0,
        name: str = "engine",
        max_answer_bytes: int = MAX_ANSWER_BYTES,
    ):
        self.url = check_url(url)
        check_seconds("HttpClient: connect_timeout", connect_timeout, above=True)
        check_number("HttpClient: max_answer_bytes", max_answer_bytes, integer=True, minimum=1)
        self.max_answer_bytes = max_answer_bytes
        self.retry = retry or RetryPolicy()
        self.connect_timeout = connect_timeout
        self.name = name
        self._headers = {"Accept": "application/json"}
        self._auth = _bearer(api_key, "API key")
        # without an admin key the one key opens every endpoint (as SGLang treats --api-key alone)
        self._admin_auth = _bearer(admin_api_key, "admin API key") or self._auth
        # loop -> its session and the async generator that closes it when the loop shuts down
        self._sessions: dict[asyncio.AbstractEventLoop, _LoopSession] = {}
        self._closed = False
        #: a call since the server's last answer found nothing listening (stopped, restarting)
        self.refused = False
        self._answered_at = -math.inf  # monotonic time of the server's last answer
        self._unanswered: float | None = None  # the start of the oldest call since, unanswered
        self._pending: dict[object, float] = {}  # the calls waiting for an answer: their start

    def silent_for(self) -> float:
        """Seconds since the oldest call sent after the server's last answer that got none
        (given up, or still waiting); 0 when every such call was answered."""
        starts = [t for t in self._pending.values() if t > self._answered_at]
        if self._unanswered is not None:
            starts.append(self._unanswered)
        return time.monotonic() - min(starts) if starts else 0.0

    def _answered(self) -> None:
        self._answered_at, self._unanswered, self.refused = time.monotonic(), None, False

    def __repr__(self) -> str:  # no headers: they hold the key
        auth = "yes" if self._auth else "no"
        admin = "yes" if self._admin_auth and self._admin_auth != self._auth else "no"
        return f"<HttpClient {self.name} {self.url} auth={auth} admin_auth={admin}>"

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def _session(self) -> aiohttp.ClientSession | None:
        """The running loop's session, if it has one (None outside a loop)."""
        try:
            held = self._sessions.get(asyncio.get_running_loop())
        except RuntimeError:
            return None
        return held.session if held is not None else None

    async def close(self) -> None:
        """Close the sessions; a closed client refuses requests (it never opens another).

        The running loop's session is closed here; one of a loop running in another thread is
        closed on that loop; one of a loop that is not running is closed when that loop shuts
        down its async generators (``asyncio.run`` does as it ends).
        """
        self._closed = True
        here = asyncio.get_running_loop()
        for loop, held in list(self._sessions.items()):
            if loop is here:
                del self._sessions[loop]
                await held.keeper.aclose()
            elif loop.is_closed():
                del self._sessions[loop]
            elif loop.is_running():
                del self._sessions[loop]
                asyncio.run_coroutine_threadsafe(_aclose(held.keeper), loop)

    async def _get_session(self, endpoint: str) -> aiohttp.ClientSession:
        if self._closed:
            raise EngineHTTPError(
                f"{self.name} {endpoint}: the client is closed (the engine was closed)",
                endpoint=endpoint,
            )
        loop = asyncio.get_running_loop()
        held = self._sessions.get(loop)
        if held is not None and not held.session.closed:
            return held.session
        # the sessions of loops that ended were closed as they shut down: forget them
        for gone in [lp for lp in self._sessions if lp.is_closed()]:
            del self._sessions[gone]
        session = aiohttp.ClientSession(headers=self._headers, trust_env=False)
        keeper = _close_at_shutdown(session)
        self._sessions[loop] = _LoopSession(session, keeper)
        await anext(keeper)  # the loop now knows it: its shutdown closes the session
        return session

    async def request(
        self,
        method: str,
        path: str,
        *,
        timeout: float,
        json_body: dict[str, Any] | None = None,
        params: dict[str, str] | None = None,
        retry_timeouts: bool = True,
        retries: bool = True,
        admin: bool = False,
    ) -> Any:
        """Call ``method path`` and return the decoded JSON answer (None for an empty body).

        Retries per :attr:`retry` (none with ``retries=False``); ``retry_timeouts=False`` for
        calls the server may still be executing after a client timeout (a weight reload): the
        next sync retries those. Redirects are not followed (the key must not travel on).
        ``admin=True``: send the admin key (when one is configured). Raises EngineHTTPError.
        """
        endpoint = f"{method} {path}"
        url = self.url.with_path(self.url.path.rstrip("/") + path)
        ct = aiohttp.ClientTimeout(total=timeout, connect=min(self.connect_timeout, timeout))
        attempts = self.retry.attempts if retries else 1
        auth = self._admin_auth if admin else self._auth
        headers = {"Authorization": auth} if auth else None
        key = None if not admin else "shared" if auth == self._auth else "own"
        for attempt in range(1, attempts + 1):
            token, self._pending[token] = object(), time.monotonic()
            try:
                async with (await self._get_session(endpoint)).request(
                    method,
                    url,
                    json=json_body,
                    params=params,
                    headers=headers,
                    timeout=ct,
                    allow_redirects=False,
                ) as resp:
                    status = resp.status
                    data = await _read_capped(resp, self.max_answer_bytes)
                    charset = _charset(resp)
                self._answered()  # (closed unread past the cap: a connection not reused)
            except TimeoutError as exc:  # aiohttp's timeouts subclass TimeoutError
                err = EngineHTTPError(
                    f"{self.name} {endpoint}: no answer within {timeout:g}s",
                    endpoint=endpoint,
                )
                if not retry_timeouts or attempt == attempts:
                    raise err from exc
            except aiohttp.ClientError as exc:
                if isinstance(exc, aiohttp.ClientConnectorError) and isinstance(
                    exc.os_error, ConnectionRefusedError
                ):
                    self.refused = True  # nothing listens: the process is gone (restarting)
                err = EngineHTTPError(
                    f"{self.name} {endpoint}: cannot reach {self.url} "
                    f"({type(exc).__name__}: {exc})",
                    endpoint=endpoint,
                )
                if attempt == attempts:
                    raise err from exc
            else:
                if data is None:  # the same again on a retry: refused at once
                    raise EngineHTTPError(
                        f"{self.name} {endpoint}: HTTP {status}: the answer passed "
                        f"{self.max_answer_bytes:,} bytes, more than a {self.name} server sends:"
                        f" is {self.url} the server's own URL?",
                        endpoint=endpoint,
                        status=status,
                    )
                body = data.decode(charset, errors="replace")
                if status < 300:
                    return _decode(body)
                msg = _server_message(body)
                err = EngineHTTPError(
                    f"{self.name} {endpoint}: HTTP {status}: {msg}{_hint(status, key)}",
                    endpoint=endpoint,
                    status=status,
                    server_message=msg,
                )
                if status < 500 or attempt == attempts:
                    raise err
            finally:
                self._ended(token)
            delay = self.retry.delay(attempt)
            logger.warning("%s; retry %d/%d in %.2fs", err, attempt, attempts - 1, delay)
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover

    def _ended(self, token: object) -> None:
        """An attempt ended: one that got no answer (an error, a timeout, cancelled) counts
        from its start towards :meth:`silent_for`, when it was sent after the last answer."""
        start = self._pending.pop(token)
        if start > self._answered_at:
            self._unanswered = min(start, self._unanswered or start)

    async def wait_until_up(self, path: str, *, deadline: float, call_timeout: float) -> Any:
        """GET ``path`` until it answers 2xx (server starting: connection refused, 5xx) or
        ``deadline`` seconds pass; a 4xx is final at once. Returns the decoded answer. A call
        waits ``call_timeout`` at most, and never past the deadline."""
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline
        delay = self.retry.initial or 0.1
        while True:
            timeout = min(call_timeout, max(end - loop.time(), 0.001))
            try:
                return await self.request("GET", path, timeout=timeout, retries=False)
            except EngineHTTPError as exc:
                if exc.status is not None and exc.status < 500:
                    raise
                left = end - loop.time()
                if left <= 0:
                    raise EngineNotUp(
                        f"{self.name} at {self.url} did not come up within {deadline:g}s "
                        f"(last error: {exc}); is the server running and reachable?",
                        endpoint=exc.endpoint,
                    ) from exc
                logger.info("%s not up yet (%s); waiting", self.name, exc)
                await asyncio.sleep(min(delay, left))
                delay = min(delay * 2, max(self.retry.maximum, 0.1))


@dataclass(frozen=True)
class _LoopSession:
    session: aiohttp.ClientSession
    keeper: AsyncGenerator[None, None]


async def _close_at_shutdown(session: aiohttp.ClientSession) -> AsyncGenerator[None, None]:
    """Hold ``session`` open until closed: by ``aclose()`` (``HttpClient.close``) or by the
    loop's ``shutdown_asyncgens()``, which ``asyncio.run`` awaits once its tasks are done, so a
    session never outlives its loop unclosed."""
    try:
        yield
    finally:
        await session.close()


async def _aclose(keeper: AsyncGenerator[None, None]) -> None:
    await keeper.aclose()


def _bearer(key: str | None, what: str) -> str | None:
    if key is None:
        return None
    if not key or any(c.isspace() for c in key):
        raise ConfigError(f"the {what} must be non-empty and contain no whitespace")
    return f"Bearer {key}"


async def _read_capped(resp: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """The body of ``resp``, or None once it passes ``limit`` bytes (by its Content-Length, or
    as it arrives: the rest is never read)."""
    if resp.content_length is not None and resp.content_length > limit:
        return None
    chunks: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_any():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _charset(resp: aiohttp.ClientResponse) -> str:
    """The answer's declared charset when Python knows it, else UTF-8 (JSON's)."""
    with contextlib.suppress(LookupError, ValueError):
        return codecs.lookup(resp.charset or "utf-8").name
    return "utf-8"


def _decode(body: str) -> Any:
    if not body.strip():
        return None
    try:
        return json.loads(body)
    except (ValueError, RecursionError):  # (RecursionError: nested past the parser's depth)
        return body  # some endpoints answer plain text ("OK"); callers check what they need
