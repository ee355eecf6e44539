"""Large freed buffers go back to the OS: glibc's mmap threshold is fixed once per process."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncsync import Publisher, memory
from asyncsync.codec import shards
from asyncsync.errors import ConfigError
from asyncsync.format import Manifest, TensorEntry, checksum
from asyncsync.format.manifest import fingerprint

CHECK = """
import ctypes, sys
from asyncsync import memory
ok = memory.release_large_buffers()
kept = memory.keep_freed_memory(1 << 30)
print(ok, memory.release_large_buffers(), memory.trim_free_memory(), kept)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_threshold_is_set_once_and_can_be_disabled() -> None:
    out = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, check=True, env={"PATH": ""}
    )  # (not this process's environment: ASYNCSYNC_MALLOPT=0 there turned it off here too)
    assert out.stdout.split() == ["True"] * 4  # applied, then idempotent; trimmed; kept
    env = {"ASYNCSYNC_MALLOPT": "0", "PATH": ""}
    out = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.split() == ["False"] * 4


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
@pytest.mark.parametrize(("setting", "retained_mib"), [("1", (0, 1)), ("0", (6, 9))])
def test_freed_buffers_leave_rss_only_with_the_fix(
    setting: str, retained_mib: tuple[int, int]
) -> None:
    """glibc's dynamic threshold keeps a freed 8 MiB buffer resident; the fixed one does not.
    (A range: the interpreter's own pages move RSS by a few hundred KiB either way.)"""
    script = """
import numpy as np
from asyncsync import memory
memory.release_large_buffers()
def rss():
    return int(open('/proc/self/statm').read().split()[1]) * 4096
base = rss()
for _ in range(3):
    a = np.ones(8 << 20, dtype=np.uint8); del a
print((rss() - base) >> 20)
"""
    env = {"ASYNCSYNC_MALLOPT": setting, "PATH": ""}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env
    )
    lo, hi = retained_mib
    assert lo <= int(out.stdout.strip()) <= hi


_CHURN = """
import resource, sys, threading
import numpy as np
from asyncsync import memory
memory.release_large_buffers()
for model in map(int, sys.argv[1:]):  # (raised, never lowered: the largest model counts)
    assert memory.keep_freed_memory(model)
def work(out):
    f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(50):  # a bucket's temporaries under the mmap threshold, then freed
        bufs = [np.ones(512 << 10, np.uint8) for _ in range(4)]
        del bufs
    out.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0)
got = []
t = threading.Thread(target=work, args=(got,))
t.start()
t.join()
print(got[0])
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
@pytest.mark.parametrize(
    ("models", "kept"),
    [([1 << 30], True), ([1 << 30, 1 << 20], True), ([], False), ([4 << 20], False)],
)
def test_freed_temporaries_under_the_threshold_are_not_faulted_in_again(
    models: list[int], kept: bool
) -> None:
    """With the mmap threshold fixed, glibc's trim threshold stays at 128 KiB: an arena gave
    back the 2 MiB a bucket's temporaries freed, and the next bucket faulted them in again
    (50 rounds: ~5,200 minor faults, ~100 a round). ``keep_freed_memory`` (the publisher's,
    1/32 of the model up to 32 MiB) keeps them for a 1 GiB model (the first round's ~512
    faults only), and still after a smaller model's call; for a 4 MiB model glibc's own 128
    KiB stays (a small model's process keeps no more than before)."""
    out = subprocess.run(
        [sys.executable, "-c", _CHURN, *map(str, models)], capture_output=True, text=True,
        check=True, env={"PATH": ""},
    )  # fmt: skip
    faults = int(out.stdout)
    if kept:
        assert 256 <= faults <= 768, out.stdout  # 4 x 512 KiB touched once: 512 pages
    else:
        assert faults > 2000, out.stdout  # the churn (shows the test can tell them apart)


_FULL_APPLY = """
import asyncio, sys
from pathlib import Path
from receiver.agent import ReceiverAgent
from receiver.engines.checkpoint import LocalCheckpoint
def anon():
    for line in open('/proc/self/status'):
        if line.startswith('RssAnon:'):
            return int(line.split()[1]) * 1024
async def main(root, ckpt):
    agent = ReceiverAgent(Path(root), LocalCheckpoint(Path(ckpt)), "t", use_inotify=False)
    async with agent:
        base = anon()
        assert await agent.sync_once() == 0
        await agent.engine.flushed()
        print(anon() - base)
asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc arenas")
async def test_a_full_apply_leaves_no_freed_temporaries_resident(tmp_path: Path) -> None:
    """A model whose tensors are each under the 1 MiB mmap threshold: the full apply's
    whole-tensor temporaries come from the worker threads' malloc arenas, which kept 0.75-1x
    the model's bytes free but resident once the apply was done (a 64 MB model: 48 MB; the
    scale sweep's receiver at 64 MiB read 0.82x anonymous above its baseline, issue 26) until
    the agent gave them back (``memory.trim_free_memory``). Measured in a fresh receiver
    process: its anonymous RSS growth from the open agent to the applied version."""
    g = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(416, 1024, generator=g).bfloat16() for i in range(24)}
    model = sum(t.numel() * t.element_size() for t in state.values())  # 20 MB, 852 KB each
    async with Publisher(tmp_path / "root", keyframe_interval=0) as pub:
        await pub.seed(state)
    env = {k: v for k, v in os.environ.items() if k != "ASYNCSYNC_MALLOPT"}  # (on: the default)
    out = subprocess.run(
        [sys.executable, "-c", _FULL_APPLY, str(tmp_path / "root"), str(tmp_path / "ckpt")],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[1],
        env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) < 0.25 * model, out.stdout  # 1.0x before


def test_freeze_startup_objects_takes_them_out_of_later_collections() -> None:
    """After it, a full collection walks only what was made since (in a child: freezing the
    test process would hide its objects from the tests that look for leaks)."""
    code = """
import gc
import torch
from asyncsync import memory
assert gc.get_freeze_count() == 0
memory.freeze_startup_objects()
frozen = gc.get_freeze_count()
assert frozen > 10_000, frozen
assert sum(gc.get_count()) < 1000
cycle = []  # made afterwards: collected as before
cycle.append(cycle); del cycle
assert gc.collect() >= 1
print("ok", frozen)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok")


_SMALL_MANIFEST = (  # a delta version's manifest, its tensors replaced below
    '{"format":"asyncsync","format_version":3,"run_id":"run","version":1,"base_version":0,'
    '"kind":"delta","encoding":"xef","checksum_algorithm":"xxh3-128","shard_dir":null,'
    '"shards":[{"file":"delta-00000.safetensors","role":"delta","bytes":711,'
    '"checksum":"9603370967a0f66ac70ef725ff1648ae"}],"tensors":[],"totals":{"tensors":1,'
    '"elements":2048,"changed":1,"density":0.00048828125,"model_bytes":4096,"wire_bytes":711,'
    '"delta_bytes":711,"raw_bytes":5},"fingerprint":"484531f327ec24ec41a30749ec5b3ad7",'
    '"producer":{"host":"vm","pid":1},"created_at":1796476660.25,"committed_at":1796476660.25}'
)


@contextlib.contextmanager
def _paused_in_another_thread() -> Iterator[None]:
    """A gc_paused block running in another thread for the with block (a receiver's parse)."""
    entered, leave = threading.Event(), threading.Event()

    def parse() -> None:
        with memory.gc_paused():
            entered.set()
            leave.wait(30)

    t = threading.Thread(target=parse)
    t.start()
    try:
        assert entered.wait(30)
        yield
    finally:
        leave.set()
        t.join(30)


def test_gc_paused_holds_the_collector_off_until_the_last_block_ends() -> None:
    """Nested and overlapping blocks (threads): on again only after the last; an error inside
    ends the block too; a collector that was off before stays off."""
    assert gc.isenabled()
    with memory.gc_paused():
        assert not gc.isenabled()
        with memory.gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(KeyError), memory.gc_paused():
        raise KeyError("x")
    assert gc.isenabled()
    with _paused_in_another_thread():
        with memory.gc_paused():
            pass
        assert not gc.isenabled()  # the other thread's block still runs
    assert gc.isenabled()
    gc.disable()
    try:
        with memory.gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_process_forked_during_a_pause_collects() -> None:
    """A child forked while another thread parses (an engine's workers: vLLM forks them) has
    no block running: its collector is on, as the parent's was; before, it inherited the
    pause and its count, and never collected a cycle again."""
    with _paused_in_another_thread():
        pid = os.fork()
        if pid == 0:  # the child: 0 when its collector is on, with and after a block of its own
            with memory.gc_paused():
                paused = not gc.isenabled()
            os._exit(0 if paused and gc.isenabled() else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert not gc.isenabled()  # the parent's block still runs
    assert gc.isenabled()


def test_a_moe_models_records_parse_without_a_collection() -> None:
    """A manifest of 20,000 tensor entries and a delta shard of 40,000 blobs (a MoE model's
    version): their JSON's dicts and lists, freed right after, are never traced: no collection
    runs inside either parse (542 before; issue 26: ~9 us of a small tensor's ~110 in each)."""
    n = 20_000
    blobs = {f"t{i}.{k}": bytes([i % 251 + 1]) for i in range(n) for k in ("pos", "val")}
    data = shards.delta_shard_blob(blobs, version=1, run_id="run")
    entry = {"dtype": "bfloat16", "shape": [2048], "checksum": "ab" * 16, "changed": 1}
    tensors = [
        {**entry, "name": f"t{i}", "delta": {"shard": 0, "mode": "sparse",
         "positions": f"t{i}.pos", "values": f"t{i}.val"}}
        for i in range(n)
    ]  # fmt: skip
    d = {**json.loads(_SMALL_MANIFEST), "tensors": tensors}
    d["totals"].update(tensors=n, elements=2048 * n, changed=n, density=n / (2048 * n))
    entries = [TensorEntry.from_dict(t, "t") for t in tensors]
    text = json.dumps({**d, "fingerprint": fingerprint(entries, "xxh3-128")})
    runs: list[int] = []

    def seen(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            runs.append(info["generation"])

    gc.collect()
    gc.callbacks.append(seen)
    try:
        got = shards.parse_delta_shard(data, where="w", version=1, run_id="run")
        m = Manifest.from_json(text)
    finally:
        gc.callbacks.remove(seen)
    assert len(got) == 2 * n and len(m.tensors) == n
    assert len(runs) <= 2  # one of what each parse keeps (the blobs' views, the records), if any


# ------------------------------------------------------- device-to-host staging (pinned buffers)

_DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def _odd_tensors(device: str) -> dict[str, torch.Tensor]:
    """Tensors whose bytes a careless copy would change or lose: a bool whose bytes are not
    all 0/1, a non-contiguous view, a 0-d, an empty, one large enough for the pinned pool and
    one spanning several of host_chunks' chunks."""
    g = torch.Generator().manual_seed(5)
    big = torch.randint(
        -(2**15), 2**15, (3 * memory.CHUNK // 2 + 7,), dtype=torch.int16, generator=g
    )
    odd_bool = torch.randint(0, 256, (4099,), dtype=torch.uint8, generator=g).view(torch.bool)
    wide = torch.randn(700, 900, generator=g).to(torch.bfloat16)
    out = {
        "big": big.view(torch.bfloat16),
        "bool": odd_bool,
        "transposed": wide.t(),
        "strided_bool": odd_bool[1::3],
        "scalar": torch.tensor(3.5, dtype=torch.float32),
        "empty": torch.empty(0, 4, dtype=torch.float16),
        "pool_sized": torch.randn(memory.MIN_BYTES // 2 + 3, generator=g).to(torch.float16),
    }
    return {k: t.to(device) for k, t in out.items()}


def _raw_bytes(t: torch.Tensor) -> bytes:
    """The reference: a tensor's row-major bytes, copied element by element as integers."""
    ints = t.detach().cpu().view(torch.uint8) if t.dtype == torch.bool else t.detach().cpu()
    return ints.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("device", _DEVICES)
def test_host_copy_keeps_every_byte(device: str) -> None:
    ts = _odd_tensors(device)
    together = dict(zip(ts, memory.host_copies(list(ts.values())), strict=True))
    for name, t in ts.items():
        got = memory.host_copy(t)
        assert _raw_bytes(together[name]) == _raw_bytes(t), name
        assert got.device.type == "cpu" and got.is_contiguous(), name
        assert (got.dtype, tuple(got.shape)) == (t.dtype, tuple(t.shape)), name
        assert _raw_bytes(got) == _raw_bytes(t), name


@pytest.mark.parametrize("device", _DEVICES)
def test_host_chunks_and_streamed_checksums_match_the_whole_bytes(device: str) -> None:
    for name, t in _odd_tensors(device).items():
        whole = _raw_bytes(t)
        for start, stop in ((0, None), (1, len(whole) - 1), (len(whole) // 2, len(whole) // 2)):
            if stop is not None and stop < start:
                continue
            got = b"".join(bytes(c) for c in memory.host_chunks(t, start, stop))
            assert got == whole[start:stop], (name, start, stop)
        flat = t.reshape(-1)
        layout = [(0, flat.numel() // 3), (flat.numel() // 3, flat.numel() - flat.numel() // 3)]
        for parts in (None, layout):
            want = checksum.layout_checksum(whole, t.element_size(), parts)
            assert checksum._streamed(t, t.element_size(), parts, "xxh3-128") == want, name
            assert checksum.checksum_tensor(t, layout=parts) == want, name
    with pytest.raises(ValueError, match="bytes 5:3"):
        next(memory.host_chunks(torch.zeros(8, device=device), 5, 3))


def test_pinned_pool_hands_a_buffer_out_again_only_once_free(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: list[int] = []

    def alloc(n: int) -> np.ndarray:
        made.append(n)
        return np.empty(n, np.uint8)

    pool = memory.ScratchPool(8 * memory.MIN_BYTES, alloc)
    a = pool.empty(2 * memory.MIN_BYTES, np.uint8)
    b = pool.empty(2 * memory.MIN_BYTES, np.uint8)  # `a` is in use: a second buffer
    assert made == [2 * memory.MIN_BYTES] * 2 and not np.shares_memory(a, b)
    del a
    c = pool.empty(memory.MIN_BYTES, np.uint8)  # best fit: `a`'s buffer, not a new one
    assert len(made) == 2 and pool.reused == 1 and not np.shares_memory(b, c)
    d = pool.empty(6 * memory.MIN_BYTES, np.uint8)  # over the limit: a plain array
    assert len(made) == 2 and d.nbytes == 6 * memory.MIN_BYTES
    # powers of two, as torch's pinned allocator pins: the pool counts what is pinned
    made.clear()
    pinned = memory.ScratchPool(8 * memory.MIN_BYTES, alloc, pow2=True)
    e = pinned.empty(memory.MIN_BYTES + 1, np.uint8)
    assert made == [2 * memory.MIN_BYTES] and e.nbytes == memory.MIN_BYTES + 1
    assert pinned.held == 2 * memory.MIN_BYTES
    del e
    f = pinned.empty(2 * memory.MIN_BYTES, np.uint16)  # 4 MIN_BYTES: a new buffer of 4
    g = pinned.empty(memory.MIN_BYTES + 5, np.uint8)  # the free one of 2 fits it
    assert made == [2 * memory.MIN_BYTES, 4 * memory.MIN_BYTES] and pinned.reused == 1
    h = pinned.empty(3 * memory.MIN_BYTES, np.uint8)  # 4 more would make 10 of 8: plain
    assert len(made) == 2 and pinned.spilled == 1 and h.nbytes == 3 * memory.MIN_BYTES
    assert not np.shares_memory(f, g)
    monkeypatch.setenv("ASYNCSYNC_PINNED_MB", "abc")
    with pytest.raises(ConfigError, match="ASYNCSYNC_PINNED_MB"):
        memory._pinned_limit()
    monkeypatch.setenv("ASYNCSYNC_PINNED_MB", "0")
    assert memory._pinned_limit() == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine that cannot pin memory")
def test_a_pinned_allocation_that_fails_falls_back_to_plain_memory(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Here torch has no pinned allocator: the real failure a host out of page-locked memory
    gives. The copy still gets a buffer, one warning is logged, and the pool stops trying."""
    pool = memory.ScratchPool(64 * memory.MIN_BYTES, memory._pinned_alloc)
    monkeypatch.setattr(memory, "_pinned", pool)
    a = pool.empty(2 * memory.MIN_BYTES, np.uint8)
    a[:] = 7
    assert a.nbytes == 2 * memory.MIN_BYTES and pool.limit == 0
    b = pool.empty(2 * memory.MIN_BYTES, np.uint8)
    assert not np.shares_memory(a, b)
    assert [r.levelname for r in caplog.records if "pinned" in r.message] == ["WARNING"]


def _tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_page_cache_room_is_the_tightest_of_the_host_and_the_cgroup_less_its_non_file_use(
    tmp_path: Path,
) -> None:
    gib = 1 << 30
    meminfo = f"MemTotal: {64 * gib >> 10} kB\nMemAvailable: {16 * gib >> 10} kB\n"
    _tree(tmp_path / "v2", {  # a 10 GiB limit above a cgroup using 7 GiB, 5 of it file cache
        "proc/meminfo": meminfo, "proc/self/cgroup": "0::/a/b\n",
        "cg/a/memory.max": f"{10 * gib}\n", "cg/a/b/memory.max": "max\n",
        "cg/a/b/memory.current": f"{7 * gib}\n", "cg/a/b/memory.stat": f"anon 1\nfile {5 * gib}\n",
    })  # fmt: skip
    v2 = tmp_path / "v2"
    assert memory.page_cache_room(v2 / "proc", v2 / "cg") == 8 * gib
    _tree(tmp_path / "v1", {
        "proc/meminfo": meminfo, "proc/self/cgroup": "5:cpu:/\n4:memory:/x\n",
        "cg/memory/x/memory.usage_in_bytes": f"{3 * gib}\n",
        "cg/memory/x/memory.stat": f"total_cache {2 * gib}\nhierarchical_memory_limit {4 * gib}\n",
    })  # fmt: skip
    v1 = tmp_path / "v1"
    assert memory.page_cache_room(v1 / "proc", v1 / "cg") == 3 * gib
    (v1 / "cg/memory/x/memory.stat").write_text(
        f"total_cache 0\nhierarchical_memory_limit {2**63 - 4096}\n"
    )
    assert memory.page_cache_room(v1 / "proc", v1 / "cg") == 16 * gib  # no limit: the host's
    assert memory.page_cache_room(tmp_path / "none", tmp_path / "none") is None
