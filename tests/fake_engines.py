"""Fake SGLang and vLLM servers on 127.0.0.1 for the engine tests.

They serve the request and response schemas of the endpoints the receiver uses (fields and
status codes from REFERENCE.md, "SGLang HTTP surface"), keep a small model of the server state
(weight version, paused, requests in flight, what was loaded from where) and record every
call. They are stricter than the real servers on purpose: an unknown field, a wrong type or a
missing required field is a 400, so the tests prove the receiver sends only what exists.

Control from a test:

* ``inject(path, status=..., message=..., delay=..., hold=..., times=..., flood=...)``: the
  next calls to ``path`` sleep ``delay`` seconds or wait until the event ``hold`` is set (a
  server that stalls until the test says), then fail with ``status`` (None: answer normally
  after it); ``flood``: answer ``status`` with a body that never ends;
* ``report_version``: make ``/model_info`` (``/weight_info``) report this instead of the truth;
* ``running``: requests in flight (a pause decides what happens to them);
* ``restart()``: stop (in-flight calls are cut) and start on the same port with fresh state,
  as a restarted server does; ``crashed``: set when SGLang 0.5.15 asserts on a failed flush.

``ServerThread`` runs a fake in a thread of its own, for code that runs its own event loop
(the CLI).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Self, TypeVar

import torch
from aiohttp import web

from asyncsync import Publisher
from asyncsync.format.store import read_manifest
from receiver.engines import RetryPolicy, Timeouts, verify_checkpoint
from tests.conftest import mixed_state, mutate

KEY = "s3cret-token-8f2c"
FAST_RETRY = RetryPolicy(attempts=6, initial=0.02, multiplier=2.0, maximum=0.2, jitter=0.0)
FAST = Timeouts(control=2.0, update=2.0, connect=1.0, startup=3.0)

Handler = Callable[[web.Request, Any], Awaitable[web.StreamResponse]]
Spec = dict[str, tuple[tuple[type, ...], bool]]  # field -> (allowed types, required)

_NONE = type(None)
BODY: web.RequestKey[Any] = web.RequestKey("body", object)  # the parsed JSON body, for the handlers


@dataclass
class Call:
    method: str
    path: str
    body: Any
    query: dict[str, str]
    auth: str  # "ok" | "missing" | "wrong" | "none-needed"

    @property
    def endpoint(self) -> str:
        return f"{self.method} {self.path}"


@dataclass
class _Fault:
    status: int | None
    message: str
    delay: float
    times: int
    drop: bool = False  # close the connection without an answer (a dying server)
    hold: asyncio.Event | None = None  # answer only once the test sets it
    flood: bool = False  # answer ``status`` with a body that never ends (not a server's own URL)


@dataclass
class Load:
    path: str
    version: str | None
    checkpoint_version: int | None  # asyncsync_version in the index when the fake read it


def _json(data: Any, status: int = 200) -> web.Response:
    return web.json_response(data, status=status)


def check_schema(body: Any, spec: Spec) -> str | None:
    """None when ``body`` fits ``spec``, else what is wrong (the fake answers 400 with it)."""
    if not isinstance(body, dict):
        return "the body must be a JSON object"
    for name in body:
        if name not in spec:
            return f"unknown field {name!r}"
    for name, (types, required) in spec.items():
        if name not in body:
            if required:
                return f"field {name!r} is required"
            continue
        v = body[name]
        ok = isinstance(v, types) and not (isinstance(v, bool) and bool not in types)
        if not ok:
            return f"field {name!r} has type {type(v).__name__}"
    return None


def checkpoint_version(path: str) -> int | None:
    """The asyncsync version recorded in a checkpoint's HF index, or None."""
    try:
        index = json.loads((Path(path) / "model.safetensors.index.json").read_text())
        v = index["metadata"]["asyncsync_version"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return v if isinstance(v, int) else None


class FakeServer:
    """Base: lifecycle, auth, recording, fault injection. Subclasses add routes and state."""

    initial_version: str | None = None
    auth_exempt: tuple[str, ...] = ()  # paths served without a key

    def needs_auth(self, path: str) -> bool:
        return not path.startswith(self.auth_exempt) if self.auth_exempt else True

    def key_for(self, path: str) -> str | None:
        """The key a call to ``path`` must carry (None: any)."""
        return self.api_key

    def __init__(self, *, api_key: str | None = None):
        self.api_key = api_key
        self.calls: list[Call] = []
        self.port = 0
        self.starts = 0
        self._faults: dict[str, list[_Fault]] = {}
        self._runner: web.AppRunner | None = None
        self.report_version: str | None = None
        self.reset()

    # -- state ---------------------------------------------------------------------------------
    def reset(self) -> None:
        """The state of a freshly started server."""
        self.weight_version: str | None = self.initial_version
        self.paused: str | None = None
        self.running = 0
        self.waiting = 0
        self.aborted = 0
        self.crashed = False
        self.loads: list[Load] = []

    # -- lifecycle -------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application(middlewares=[self._middleware])
        self.routes(app)
        runner = web.AppRunner(app, shutdown_timeout=0.1, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        self.port = runner.addresses[0][1]
        self._runner = runner
        self.starts += 1

    async def stop(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def restart(self, down_for: float = 0.0) -> None:
        await self.stop()
        self.reset()
        await asyncio.sleep(down_for)
        await self.start()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- control ---------------------------------------------------------------------------------
    def inject(
        self,
        path: str,
        *,
        status: int | None = 500,
        message: str = "injected failure",
        delay: float = 0.0,
        times: int = 1,
        drop: bool = False,
        hold: asyncio.Event | None = None,
        flood: bool = False,
    ) -> None:
        fault = _Fault(status, message, delay, times, drop, hold, flood)
        self._faults.setdefault(path, []).append(fault)

    def endpoints(self, *, authorized_only: bool = True) -> list[str]:
        return [c.endpoint for c in self.calls if c.auth != "wrong" or not authorized_only]

    def bodies(self, path: str) -> list[Any]:
        return [c.body for c in self.calls if c.path == path]

    # -- plumbing ---------------------------------------------------------------------------------
    def routes(self, app: web.Application) -> None:
        raise NotImplementedError

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        raw = await request.read()
        body: Any = None
        bad_json = False
        if raw:
            try:
                body = json.loads(raw)
            except ValueError:
                bad_json = True
        auth = "none-needed"
        want = self.key_for(request.path)
        if want is not None:
            header = request.headers.get("Authorization")
            auth = "missing" if header is None else "ok" if header == f"Bearer {want}" else "wrong"
        self.calls.append(Call(request.method, request.path, body, dict(request.query), auth))
        if auth in ("missing", "wrong") and self.needs_auth(request.path):
            return _json({"error": "Unauthorized"}, 401)
        if bad_json:
            return _json({"error": "JSON decode error"}, 400)
        if self.crashed:
            return _json({"error": "the scheduler died (see its log)"}, 500)
        queue = self._faults.get(request.path)
        if queue:
            fault = queue[0]
            fault.times -= 1
            if fault.times <= 0:
                queue.pop(0)
            if fault.delay:
                await asyncio.sleep(fault.delay)
            if fault.hold is not None:
                await fault.hold.wait()
            if fault.drop and request.transport is not None:
                request.transport.abort()
                return web.Response()
            if fault.flood:
                return await _flood(request, fault.status or 200)
            if fault.status is not None:
                return _json({"success": False, "message": fault.message}, fault.status)
        request[BODY] = body
        return await handler(request)

    def _idle(self) -> bool:
        return self.running == 0 and self.waiting == 0

    def _abort_all(self) -> None:
        self.aborted += self.running + self.waiting
        self.running = self.waiting = 0


async def _flood(request: web.Request, status: int) -> web.StreamResponse:
    """Answer ``status`` and JSON-looking bytes until the client goes away."""
    resp = web.StreamResponse(status=status, headers={"Content-Type": "application/json"})
    await resp.prepare(request)
    chunk = b'{"weight_version": "' + b"9" * (1 << 20)
    with contextlib.suppress(ConnectionError):
        while request.transport is not None and not request.transport.is_closing():
            await resp.write(chunk)
    return resp


class FakeSGLang(FakeServer):
    """SGLang 0.5.15 or 0.5.23 (``version``): the endpoints of REFERENCE.md."""

    initial_version = "default"
    auth_exempt = ("/health", "/metrics")

    UPDATE_FROM_DISK: Spec = {  # noqa: RUF012 - read-only table
        "model_path": ((str,), True),
        "load_format": ((str, _NONE), False),
        "abort_all_requests": ((bool,), False),
        "weight_version": ((str, _NONE), False),
        "is_async": ((bool,), False),
        "torch_empty_cache": ((bool,), False),
        "keep_pause": ((bool,), False),
        "recapture_cuda_graph": ((bool,), False),
        "token_step": ((int,), False),
        "flush_cache": ((bool,), False),
    }
    UPDATE_VERSION: Spec = {  # noqa: RUF012
        "new_version": ((str,), True),
        "abort_all_requests": ((bool,), False),
    }
    PAUSE: Spec = {"mode": ((str,), False)}  # noqa: RUF012

    #: with --admin-api-key, these want the admin key and the others the api key (0.5.23)
    ADMIN_PATHS = (
        "/update_weights_from_disk",
        "/update_weight_version",
        "/pause_generation",
        "/continue_generation",
        "/flush_cache",
    )

    def __init__(
        self,
        *,
        version: str = "0.5.23",
        api_key: str | None = None,
        admin_api_key: str | None = None,
    ):
        if version not in ("0.5.15", "0.5.23"):
            raise ValueError(f"unknown fake SGLang version {version}")
        self.version = version
        self.admin_api_key = admin_api_key
        super().__init__(api_key=api_key)

    def key_for(self, path: str) -> str | None:
        if self.admin_api_key is not None and path in self.ADMIN_PATHS:
            return self.admin_api_key
        return self.api_key

    def routes(self, app: web.Application) -> None:
        r = app.router
        r.add_get("/health", self._ok)
        r.add_get("/ready", self._ok)
        r.add_get("/model_info", self._model_info)
        if self.version == "0.5.15":
            r.add_get("/get_weight_version", self._get_weight_version)
        r.add_post("/pause_generation", self._pause)
        r.add_post("/continue_generation", self._continue)
        r.add_post("/update_weights_from_disk", self._update_from_disk)
        r.add_post("/update_weight_version", self._update_version)
        r.add_route("*", "/flush_cache", self._flush_cache)

    async def _ok(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    def _reported(self) -> str | None:
        return self.report_version if self.report_version is not None else self.weight_version

    async def _model_info(self, request: web.Request) -> web.Response:
        loaded = self.loads[-1].path if self.loads else "/models/base"
        return _json(
            {
                "model_path": loaded,
                "tokenizer_path": "/models/base",
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self._reported(),
            }
        )

    async def _get_weight_version(self, request: web.Request) -> web.Response:
        return _json({"weight_version": self._reported()})

    async def _pause(self, request: web.Request) -> web.Response:
        body = request[BODY] if request[BODY] is not None else {}
        if (err := check_schema(body, self.PAUSE)) is not None:
            return _json({"error": err}, 400)
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return _json({"error": f"invalid mode {mode!r}"}, 400)
        if mode == "abort":
            self._abort_all()
        elif mode == "retract":
            self.waiting += self.running
            self.running = 0
        self.paused = mode
        return _json({"status": "ok", "message": f"Generation paused ({mode})."})

    async def _continue(self, request: web.Request) -> web.Response:
        body = request[BODY]
        if body is not None and (err := check_schema(body, {})) is not None:
            return _json({"error": err}, 400)
        self.paused = None
        return _json({"status": "ok", "message": "Generation continued."})

    async def _update_from_disk(self, request: web.Request) -> web.Response:
        body = request[BODY]
        if (err := check_schema(body, self.UPDATE_FROM_DISK)) is not None:
            return _json({"error": err}, 400)
        path = body["model_path"]
        if not (Path(path) / "model.safetensors.index.json").is_file():
            return _json(
                {
                    "success": False,
                    "message": f"Failed to update weights: no safetensors checkpoint in {path}",
                    "num_paused_requests": 0,
                },
                400,
            )
        if body.get("abort_all_requests"):
            self._abort_all()
        if body.get("flush_cache", True) and not self._idle():
            if self.version == "0.5.15":  # the scheduler asserts and dies
                self.crashed = True
                return _json({"error": "AssertionError: Cache flush failed after updating"}, 500)
            return _json(
                {"success": False, "message": "Cache flush failed: requests are pending"}, 400
            )
        self.loads.append(Load(path, body.get("weight_version"), checkpoint_version(path)))
        if body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
        return _json(
            {
                "success": True,
                "message": "Succeeded to update model weights.",
                "num_paused_requests": 0,
            }
        )

    async def _update_version(self, request: web.Request) -> web.Response:
        body = request[BODY]
        if (err := check_schema(body, self.UPDATE_VERSION)) is not None:
            return _json({"error": err}, 400)
        if body.get("abort_all_requests", True):
            self._abort_all()
        self.weight_version = body["new_version"]
        return _json({"success": True, "message": "ok", "new_version": self.weight_version})

    async def _flush_cache(self, request: web.Request) -> web.Response:
        if not self._idle():
            return web.Response(text="Cache not flushed: requests are running", status=400)
        return web.Response(text="Cache flushed.")


class VerifyingSGLang(FakeSGLang):
    """A fake SGLang that checks, at each load, the checkpoint's files against the manifest in
    ``root`` of the version it is told to label them: ``loads_checked`` holds (label, the
    tensors that differ) per load, :meth:`served_wrong` the loads of other bytes."""

    def __init__(self, root: Path, **kw: Any) -> None:
        super().__init__(**kw)
        self.root = root
        self.loads_checked: list[tuple[str, list[str]]] = []

    async def _update_from_disk(self, request: web.Request) -> web.Response:
        body = request[BODY]
        label = body.get("weight_version") if isinstance(body, dict) else None
        if isinstance(label, str) and label.isdigit():
            bad = verify_checkpoint(body["model_path"], read_manifest(self.root, int(label)))
            self.loads_checked.append((label, bad))
        return await super()._update_from_disk(request)

    def served_wrong(self) -> list[tuple[str, list[str]]]:
        return [(v, bad) for v, bad in self.loads_checked if bad]


class FakeVLLM(FakeServer):
    """vLLM's OpenAI server with VLLM_SERVER_DEV_MODE=1, serving ``model_root``."""

    RPC: Spec = {  # noqa: RUF012
        "method": ((str,), True),
        "args": ((list,), False),
        "kwargs": ((dict,), False),
        "timeout": ((int, float, _NONE), False),
    }
    VERSION: Spec = {"new_version": ((str,), True)}  # noqa: RUF012

    def needs_auth(self, path: str) -> bool:
        return path.startswith("/v1")  # vLLM's --api-key guards only the OpenAI routes

    def __init__(
        self,
        model_root: str,
        *,
        api_key: str | None = None,
        extension: Callable[[str, list[Any]], list[Any]] | None = None,
    ):
        self.model_root = model_root
        #: the workers' extension methods: (method, args) -> one result per worker (raise
        #: AttributeError for a method they lack); None: no worker extension at all
        self.extension = extension
        super().__init__(api_key=api_key)

    def routes(self, app: web.Application) -> None:
        r = app.router
        r.add_get("/health", self._health)
        r.add_get("/v1/models", self._models)
        r.add_post("/pause", self._pause)
        r.add_post("/resume", self._resume)
        r.add_get("/is_paused", self._is_paused)
        r.add_post("/collective_rpc", self._rpc)
        r.add_post("/update_weight_version", self._update_version)
        r.add_get("/weight_info", self._weight_info)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _models(self, request: web.Request) -> web.Response:
        return _json(
            {
                "object": "list",
                "data": [{"id": "policy", "object": "model", "root": self.model_root}],
            }
        )

    async def _pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode not in ("abort", "wait", "keep"):
            return _json({"detail": f"invalid mode {mode!r}"}, 422)
        if mode == "abort":
            self._abort_all()
        self.paused = mode
        return _json({"status": "paused"})

    async def _resume(self, request: web.Request) -> web.Response:
        self.paused = None
        return _json({"status": "resumed"})

    async def _is_paused(self, request: web.Request) -> web.Response:
        return _json({"is_paused": self.paused is not None})

    async def _rpc(self, request: web.Request) -> web.Response:
        body = request[BODY]
        if (err := check_schema(body, self.RPC)) is not None:
            return _json({"detail": err}, 400)
        method = body["method"]
        if method != "reload_weights":
            if self.extension is None:
                return _json({"error": f"worker has no method {method!r}"}, 500)
            try:
                results = self.extension(method, list(body.get("args", [])))
            except AttributeError:
                return _json({"error": f"worker has no method {method!r}"}, 500)
            return _json({"results": results})
        if not (Path(self.model_root) / "model.safetensors.index.json").is_file():
            return _json({"error": f"no safetensors checkpoint in {self.model_root}"}, 500)
        self.loads.append(Load(self.model_root, None, checkpoint_version(self.model_root)))
        return _json({"results": [None]})

    async def _update_version(self, request: web.Request) -> web.Response:
        body = request[BODY]
        if (err := check_schema(body, self.VERSION)) is not None:
            return _json({"detail": err}, 422)
        self.weight_version = body["new_version"]
        return _json({"success": True, "new_version": self.weight_version})

    async def _weight_info(self, request: web.Request) -> web.Response:
        reported = self.report_version if self.report_version is not None else self.weight_version
        return _json({"weight_version": reported})


S = TypeVar("S", bound=FakeServer)


@dataclass
class ServerThread(Generic[S]):
    """Run ``server`` on an event loop in a background thread (``with ServerThread(s): ...``)."""

    server: S
    _loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)
    _thread: threading.Thread | None = None

    def __enter__(self) -> S:
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self.server.start())
            started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="fake-engine", daemon=True)
        self._thread.start()
        if not started.wait(10):
            raise RuntimeError("the fake server did not start")
        return self.server

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        assert self._thread is not None
        self._thread.join(10)
        self._loop.close()


class Chain:
    """A publisher on ``root`` and the state dicts it published (``next()`` publishes one)."""

    def __init__(self, root: Path):
        self.root = root
        self.pub = Publisher(root, bucket_bytes=8192, keyframe_interval=0)
        self.states: list[dict[str, torch.Tensor]] = []

    async def next(self, *, zero_diff: bool = False) -> int:
        if not self.states:
            self.states.append(mixed_state(0))
            return (await self.pub.seed(self.states[0])).version
        sd = self.states[-1] if zero_diff else mutate(self.states[-1], 0.03, seed=len(self.states))
        self.states.append(sd)
        return (await self.pub.publish(sd)).version


def publish_chain(root: Path, n: int) -> None:
    """Publish ``n`` versions of a :class:`Chain` on ``root`` (v0..v(n-1)), from sync code."""

    async def run() -> None:
        c = Chain(root)
        async with c.pub:
            for _ in range(n):
                await c.next()

    asyncio.run(run())
