"""Shared fixtures: small mixed-dtype state dicts and a way to change a fraction of their bytes;
``eventually``, the one way tests wait for something another task or thread does; ``running``,
a receiver agent running in the test's task group."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import multiprocessing.util
import os
import shutil
import signal
import struct
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncsync.codec import raw_view

# A shell without job control starts background jobs (`make test &`) with SIGINT ignored, and
# that disposition is inherited through exec: Python then never raises KeyboardInterrupt, and
# the tests of Ctrl-C (in this process and in the CLIs they start) would fail for the way the
# suite was launched. A handled signal is reset to its default in the children.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

ALL_DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.bool,
]


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bit patterns of ``dtype`` (NaNs included: we compare bytes, never values)."""
    nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw & 1
    return raw.view(dtype).reshape(shape)


def mixed_state(seed: int = 0, scale: int = 1) -> dict[str, torch.Tensor]:
    """Every supported dtype, 0-d and empty tensors, dotted names, non-contiguous tensors (one
    a bool whose bytes are not 0/1: a uint8 mask viewed as bool, which torch's own copies of a
    bool, ``clone``, ``contiguous``, ``copy_``, rewrite as 0/1: copy through ``raw_view``)."""
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    for i, dt in enumerate(ALL_DTYPES):
        sd[f"model.layers.{i}.weight"] = random_tensor((64 * scale, 33), dt, g)
    sd["model.scalar"] = random_tensor((), torch.float32, g)
    sd["model.empty"] = random_tensor((0, 5), torch.bfloat16, g)
    sd["model.step"] = torch.tensor(7, dtype=torch.int64)
    sd["model.transposed.weight"] = random_tensor((40, 24), torch.bfloat16, g).t()
    mask = torch.randint(0, 256, (24 * scale, 40), dtype=torch.uint8, generator=g)
    sd["model.transposed.mask"] = mask.view(torch.bool).t()  # bytes 0..255, not contiguous
    return sd


def mutate(
    sd: dict[str, torch.Tensor], density: float, seed: int, names: list[str] | None = None
) -> dict[str, torch.Tensor]:
    """A copy of ``sd`` with about ``density`` of each tensor's elements given new random bytes
    (the others keep theirs: copied through ``raw_view``, and a non-contiguous tensor's copy
    keeps its strides)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, t in sd.items():
        t = raw_view(t).clone().view(t.dtype)  # (preserve_format: same strides)
        if (names is None or k in names) and t.numel():
            raw = raw_view(t)
            flat = raw.reshape(-1) if raw.is_contiguous() else raw.contiguous().reshape(-1)
            mask = torch.rand(flat.numel(), generator=g) < density
            repl = raw_view(random_tensor((flat.numel(),), t.dtype, g))
            flat[mask] = repl[mask]
            if not raw.is_contiguous():
                raw.copy_(flat.reshape(raw.shape))
        out[k] = t
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    # copied as ints: a non-contiguous bool's own copy (contiguous, reshape) writes 0/1
    ua = raw_view(a).contiguous().reshape(-1).view(torch.uint8)
    ub = raw_view(b).contiguous().reshape(-1).view(torch.uint8)
    return bool(torch.equal(ua, ub))


class Holder(torch.nn.Module):
    """A module whose buffers are exactly the tensors of a state dict (zeros to start)."""

    def __init__(self, sd: dict[str, torch.Tensor]):
        super().__init__()
        for i, v in enumerate(sd.values()):
            self.register_buffer(f"b{i}", torch.zeros_like(v.contiguous()))
        self._names = list(sd)

    def state_dict(self, *a, **k):  # type: ignore[no-untyped-def,override]
        return {n: getattr(self, f"b{i}") for i, n in enumerate(self._names)}


def assert_holds(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """``got`` has exactly ``want``'s names, each with the same bytes."""
    assert set(got) == set(want)
    for k, v in want.items():
        assert same_bytes(got[k], v), k  # (a bool's contiguous() would write 0/1)


async def eventually(cond: Callable[[], object], what: str, *, timeout: float = 10.0) -> None:
    """Wait until ``cond()`` is true, polling; fail naming ``what`` after ``timeout`` seconds.

    For synchronising with work in another task or thread: the deadline is generous (a loaded
    machine only makes the wait longer), so it decides nothing about timing, only whether the
    condition comes true at all.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"still waiting after {timeout}s for {what}")
        await asyncio.sleep(0.005)


@contextlib.asynccontextmanager
async def running(agent: Any, version: int) -> AsyncIterator[None]:
    """``agent`` (a ReceiverAgent) opened and running (``agent.run``) for the block, which
    starts once the agent holds ``version``; the agent is stopped when the block ends."""
    stop = asyncio.Event()
    async with agent, asyncio.TaskGroup() as tg:
        tg.create_task(agent.run(stop=stop))
        try:
            await eventually(lambda: agent.version == version, f"the agent at v{version}")
            yield
        finally:
            stop.set()


@contextlib.asynccontextmanager
async def stopped_at_end(
    proc: asyncio.subprocess.Process, timeout: float = 60.0
) -> AsyncIterator[None]:
    """A real process stopped as an operator stops it at the end of the block: SIGTERM, then
    it must exit 0 within ``timeout`` seconds; killed and reaped wherever it still runs after
    (the block raised, or the exit timed out)."""
    try:
        yield
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), timeout) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def sync_to(agent: Any, root: Path, version: int) -> None:
    """Bring a ReceiverAgent's engine to ``version`` of ``root`` alone: the versions after it
    are hidden (renamed to dot names) while it syncs."""
    hidden = [p for p in root.iterdir() if p.name.startswith("v") and int(p.name[1:]) > version]
    for p in hidden:
        p.rename(p.with_name("." + p.name))
    try:
        assert await agent.sync_once() == version
    finally:
        for p in hidden:
            p.with_name("." + p.name).rename(p)


# ``make test`` runs the suite on two pytest-xdist workers. Each test module runs whole on one
# worker (its module-scoped fixtures and the order of its tests kept), and the modules that
# start real SGLang or vLLM servers or a Ray cluster (:data:`SERIAL_MODULES`) run one after
# another on one worker, first: two servers at once need twice the memory, and Ray's local
# clusters share the host's auth token and directories. (A scheduler of our own: xdist's
# ``xdist_group`` marks no longer reach its scheduler under pytest 9.)
SERIAL_MODULES = frozenset(
    {
        "test_deploy.py",
        "test_ray.py",
        "test_ray_cluster.py",
        "test_ray_status_url.py",
        "test_real_midapply.py",
        "test_sglang_faults.py",
        "test_sglang_real.py",
        "test_sglang_real_kill.py",
        "test_sglang_real_plugin.py",
        "test_sglang_real_qwen2.py",
        "test_sglang_real_start.py",
        "test_slime_actor.py",
        "test_vllm_real.py",
        "test_vllm_tp.py",
    }
)
#: the marks of the tests that must be in :data:`SERIAL_MODULES` (tests/test_suite_split.py)
SERIAL_MARKS = frozenset({"sglang_real", "vllm_real", "ray_cluster"})
SERIAL_UNIT = "real servers"


def xdist_unit(nodeid: str) -> str:
    """The unit of work a test goes to one worker with: its module, or :data:`SERIAL_UNIT`."""
    module = nodeid.split("::", 1)[0]
    return SERIAL_UNIT if Path(module).name in SERIAL_MODULES else module


@pytest.hookimpl(optionalhook=True)  # (a run without pytest-xdist: -p no:xdist)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):  # type: ignore[misc]
        """A module a unit, the real-server modules one unit handed out first."""

        def _split_scope(self, nodeid: str) -> str:
            return xdist_unit(nodeid)

        def _assign_work_unit(self, node: Any) -> None:
            if SERIAL_UNIT in self.workqueue:  # the longest unit: first, not last
                self.workqueue.move_to_end(SERIAL_UNIT, last=False)
            super()._assign_work_unit(node)

    return ModuleScheduling(config, log)


@pytest.fixture(autouse=True)
def _root_logger_restored() -> Any:
    """A command run in-process (``receiver_main``, ``asyncsync.ops.cli.main``) configures the
    root logger (``setup_logging``: its level, a stderr handler of ours); put the level back
    and take that handler off after each test, or every later test's ``caplog`` misses the
    records below that level (seen: a receiver main run at ``--log-level ERROR`` emptied two
    later tests' warnings). pytest's own capture handlers come and go by themselves."""
    from asyncsync.console.logsetup import JsonFormatter, TextFormatter

    root = logging.getLogger()
    level = root.level
    yield
    root.setLevel(level)
    for h in list(root.handlers):
        if isinstance(h.formatter, TextFormatter | JsonFormatter):
            root.removeHandler(h)


@pytest.fixture(autouse=True)
def _ack_notices_uncapped() -> Any:
    """The WARNINGs about ack files are capped per minute, process-wide (a steady stream of
    junk acks is a line a minute): each test starts with the cap's whole minute, so that a
    test's ``caplog`` does not depend on how many earlier tests complained about acks."""
    from asyncsync.format import acks

    acks._capped.reset()
    yield


@pytest.fixture(scope="session", autouse=True)
def suite_tmpdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The suite's own temporary directory, ``$TMPDIR`` of this process and of every process it
    starts (receivers, servers), removed at the end: each receiver that opens a server takes a
    lock file named after the server's address in the temporary directory and leaves it there
    (``receiver/engines/server_lock.py``), hundreds a run, one per port, which piled up in the
    host's /tmp. Made in the host's temporary directory (pytest's own is under a 0700
    directory), mode 1777 like it, for the processes run as another uid."""
    tmp_path_factory.getbasetemp()  # pytest's own stays where it was, not in here
    # so does this process's multiprocessing directory (made on first use, removed by
    # multiprocessing at exit: after this fixture, which would have removed it first)
    multiprocessing.util.get_temp_dir()
    d = Path(tempfile.mkdtemp(prefix="asyncsync-tests-"))
    os.chmod(d, 0o1777)
    old_env, old_dir = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"], tempfile.tempdir = str(d), None  # (gettempdir() reads it again)
    try:
        yield d
    finally:
        if old_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = old_env
        tempfile.tempdir = old_dir
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A directory every uid can traverse (pytest's tmp_path lies under a 0700 directory), for
    tests that mount or run a process as another uid (root only: skipped otherwise)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount or to run a process as another uid")
    d = Path(tempfile.mkdtemp(prefix="asyncsync-uid-", dir="/tmp"))
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def flip_tensor_byte(ckpt: Path, name: str, *, keep_mtime: bool = False) -> None:
    """Flip a byte of tensor ``name`` in its data file of the checkpoint ``ckpt``, in place, as
    an edit behind the receiver's back (``keep_mtime``: the file's mtime put back, as bit rot
    or a careful edit leaves it, so its stamp (inode, size, mtime) is unchanged)."""
    weight_map = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    path = ckpt / weight_map[name]
    st = path.stat()
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        at = 8 + n + json.loads(f.read(n))[name]["data_offsets"][0]
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))
    # else a later mtime than the receiver's own last write, even within its clock tick
    # (``receiver.engines.checkpoint.stamps`` cannot tell two writes of one tick apart)
    mtime = st.st_mtime_ns if keep_mtime else max(path.stat().st_mtime_ns, st.st_mtime_ns + 1)
    os.utime(path, ns=(st.st_atime_ns, mtime))
