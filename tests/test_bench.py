"""``asyncsync bench``: its plumbing on tiny sizes (JSON keys and types, plots, tables) and the
exact byte counts of the baselines. Timings are never asserted: they depend on the machine."""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import zstandard

from asyncsync import codec
from asyncsync.ops.bench import TARGETS, BenchConfig, BenchFailed
from asyncsync.ops.bench.baselines import BASELINES, LABELS, all_sizes, xor_zstd_bytes
from asyncsync.ops.bench.job import Job
from asyncsync.ops.bench.measure import _finish, _start
from asyncsync.ops.bench.probes import (
    RssSampler,
    load_state_dict,
    reset_peak_rss,
    rss,
    save_state_dict,
)
from asyncsync.ops.bench.scale_report import SCALE_TARGETS, scale_markdown
from asyncsync.ops.cli import main
from asyncsync.ops.workload import Workload, WorkloadConfig
from tests.conftest import mixed_state, same_bytes

PROMISED = (
    "publish_vs_ne_pass",
    "e2e_vs_transfer_bound",
    "full_sync_vs_ours",
    "pipelined_vs_serialized",
    "publisher_peak_rss_vs_model",
    "receiver_peak_rss_vs_model",
)
PLOTS = ("bytes_per_changed.png", "latency.png", "publish_cost.png", "memory.png")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """One tiny run of the real command: workloads, five child processes, report."""
    out = tmp_path_factory.mktemp("bench")
    argv = ["bench", "--elements", "300000", "--versions", "1", "--workdir", str(out)]
    argv += ["--json", str(out / "bench.json"), "--plot", str(out / "plots")]
    argv += ["--markdown", str(out / "bench.md")]
    assert main(argv) == 0
    return out, json.loads((out / "bench.json").read_text())


def _number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def test_json_has_the_promised_keys_as_numbers(run: tuple[Path, dict[str, Any]]) -> None:
    _, s = run
    bpc = s["bytes_per_changed"]
    assert set(bpc) == {"ours", *BASELINES}
    assert all(_number(v) and v > 0 for v in bpc.values())
    for key in PROMISED:
        assert _number(s[key]) and s[key] > 0, key
    assert set(s["targets"]) == set(TARGETS)
    for t in s["targets"].values():
        assert isinstance(t["pass"], bool) and _number(t["value"])
    assert s["command"].startswith("asyncsync bench --json")
    assert s["machine"]["cores"] >= 1
    assert [r["workload"] for r in s["details"]["sweep"]][-1] == "fp32 model"


def test_the_bytes_measured_are_the_publishers(run: tuple[Path, dict[str, Any]]) -> None:
    """``ours`` (computed in the parent) matches what the publisher child actually wrote."""
    _, s = run
    published = s["raw"]["cost"]["publishes"][0]
    d = s["details"]
    assert published["changed"] == d["changed"]
    assert published["wire_bytes"] == pytest.approx(s["bytes_per_changed"]["ours"] * d["changed"])


def test_plots_are_small_pngs(run: tuple[Path, dict[str, Any]]) -> None:
    out, _ = run
    for name in PLOTS:
        data = (out / "plots" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        assert len(data) < 200_000


def test_markdown_has_every_table(run: tuple[Path, dict[str, Any]]) -> None:
    out, _ = run
    text = (out / "bench.md").read_text()
    for heading in (
        "Targets",
        "Wire bytes per changed element",
        "Publish cost",
        "End to end",
        "Receiver apply",
        "Peak RSS",
        "cProfile of one publish",
    ):
        assert f"### {heading}" in text
    assert all(f"`{name}`" in text for name in TARGETS)
    assert all(LABELS[k] in text for k in BASELINES)
    assert "at the sampled peak: anon / file-backed" in text


def test_the_peak_rss_is_split_by_kind(run: tuple[Path, dict[str, Any]]) -> None:
    """Each side's sampled peak (of the phase whose VmHWM is the peak) beside the VmHWM."""
    _, s = run
    for side in ("publisher", "receiver"):
        r = s["details"]["rss"][side]
        sp = r["peak_split"]
        assert sp["vmhwm"] == pytest.approx(r["peak"]) and sp["samples"] >= 1, side
        assert sp["rss"] == pytest.approx(sp["anon"] + sp["file"] + sp["shmem"])
        assert all(_number(sp[k]) for k in ("anon", "file", "shmem", "max_file", "cpu_s"))


def test_work_directory_is_removed(run: tuple[Path, dict[str, Any]]) -> None:
    out, _ = run
    assert not list(out.glob("asyncsync-bench-*"))


# ------------------------------------------------------------------------------ pure parts
def test_baseline_sizes_are_exact() -> None:
    wl = Workload(WorkloadConfig(layers=1, hidden=64, vocab=256, seed=5, lr=1e-5))
    old = wl.state_dict()
    wl.step()
    new = wl.state_dict()
    sizes = all_sizes(old, new, bucket_bytes=1 << 14)
    names = list(new)
    views = [(codec.int_view(old[k]), codec.int_view(new[k])) for k in names]
    pos = codec.changed_positions([a for a, _ in views], [b for _, b in views])
    n = [p.numel() for p in pos]
    width = [new[k].element_size() for k in names]
    assert sizes["changed"] == sum(n) > 0
    assert (
        sizes["indices"] == sizes["trl"] == sum(c * (4 + w) for c, w in zip(n, width, strict=True))
    )
    assert sizes["full"] == sum(t.numel() * t.element_size() for t in new.values())
    for enc in ("deltas", "deltas_zstd"):
        want = sum(
            codec.encoded_size(codec.encode_delta(a, b, p, enc))
            for (a, b), p in zip(views, pos, strict=True)
            if p.numel()
        )
        assert sizes[enc] == want
    assert 0 < sizes["ours_payload"] < sizes["ours"] < sizes["deltas_zstd"]


def test_xor_zstd_is_zstd_level_1_of_the_whole_xor() -> None:
    old = torch.zeros(4096, dtype=torch.bfloat16)
    new = old.clone()
    new[17] = 1.0
    (pos,) = codec.changed_positions([codec.int_view(old)], [codec.int_view(new)])
    xor = torch.bitwise_xor(codec.int_view(old), codec.int_view(new))
    want = len(zstandard.ZstdCompressor(level=1).compress(xor.view(torch.uint8).numpy().data))
    assert xor_zstd_bytes([old], [new], [pos]) == want
    assert xor_zstd_bytes([old], [old.clone()], [pos[:0]]) == 0  # unchanged tensors are not sent


def test_state_files_round_trip_in_place(tmp_path: Path) -> None:
    sd = mixed_state(seed=1)
    save_state_dict(sd, tmp_path / "a.safetensors")
    loaded = load_state_dict(tmp_path / "a.safetensors")
    assert list(loaded) == list(sd)  # in the state dict's order: the publisher numbers by it
    assert all(same_bytes(loaded[k], sd[k]) for k in sd)  # a bool's bytes too, not 0/1
    other = mixed_state(seed=2)
    save_state_dict(other, tmp_path / "b.safetensors")
    ptrs = {k: t.data_ptr() for k, t in loaded.items()}
    again = load_state_dict(tmp_path / "b.safetensors", into=loaded)
    assert all(again[k].data_ptr() == ptrs[k] for k in ptrs)  # overwritten, not reallocated
    assert all(same_bytes(loaded[k], other[k]) for k in other)
    loaded["model.scalar"] = torch.zeros(2)
    with pytest.raises(ValueError, match="does not fit"):
        load_state_dict(tmp_path / "b.safetensors", into=loaded)


def test_config_sizes_and_validation() -> None:
    quick = BenchConfig.quick()
    assert (quick.elements, quick.sweep_elements, quick.versions) == (32_000_000, 8_000_000, 3)
    assert quick.bucket_size == 4 << 20  # 1/16 of the 64 MB bf16 model
    assert BenchConfig.full().bucket_size == 11 << 20  # 12 MB, rounded to MiB
    assert BenchConfig.quick(elements=2000, sweep_elements=2000).bucket_size == 1 << 20
    assert BenchConfig.quick(bucket_bytes=123).bucket_size == 123
    with pytest.raises(ValueError):
        BenchConfig.quick(density=3.0)
    with pytest.raises(ValueError):
        BenchConfig.quick(throttle="fast")


def test_rss_readings() -> None:
    r = rss()
    assert r["peak"] >= r["now"] > 0 and r["anon"] > 0
    if reset_peak_rss():
        assert rss()["peak"] <= r["peak"] + (64 << 20)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_the_rss_sampler_splits_the_peak_by_kind(tmp_path: Path) -> None:
    """Anonymous memory reads in ``anon``; one file mapped twice and touched through both
    mappings reads twice in ``file`` (no second copy in memory): what the split tells apart.
    Each phase's peak is its own: the phase begun after the mappings were closed does not
    read them (the phase begun at the first take, while they were still mapped, may)."""
    mib = 1 << 20
    path = tmp_path / "data.bin"
    path.write_bytes(b"\x01" * (32 * mib))
    sampler = RssSampler(interval=0.001).start()
    try:
        before = sampler.take()["at_peak"]
        # written: resident. Its own mapping, not malloc's: freed memory an earlier test left
        # resident in this process's heap (a high trim threshold: ``keep_freed_memory``) would
        # serve a malloc without growing the RSS (seen under xdist: +16 MiB for 48)
        anon = mmap.mmap(-1, 48 * mib, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        for i in range(0, 48 * mib, mmap.PAGESIZE):
            anon[i] = 2
        with open(path, "r+b") as f:
            maps = [mmap.mmap(f.fileno(), 0) for _ in range(2)]
            for m in maps:
                sum(m[i] for i in range(0, len(m), mmap.PAGESIZE))  # read every page: mapped
            grown = sampler.take()
            for m in maps:
                m.close()
        sampler.take()  # a phase from here on: unmapped before it began
        time.sleep(0.02)  # samples in it (the thread's, beside the stop's own)
        anon.close()
        after = sampler.stop()
    finally:
        sampler.stop()
    at = grown["at_peak"]
    assert at["now"] == at["anon"] + at["file"] + at["shmem"]
    assert at["anon"] - before["anon"] >= 40 * mib
    assert at["file"] - before["file"] >= 2 * 30 * mib  # 32 MiB of pages, counted twice
    assert grown["max"]["file"] >= at["file"] and grown["samples"] >= 1 and grown["cpu_s"] >= 0
    assert after["at_peak"]["file"] < at["file"] - 30 * mib  # a new phase: unmapped since
    with pytest.raises(ValueError, match="interval"):
        RssSampler(interval=0)


def test_a_failing_child_is_reported_with_its_log(tmp_path: Path) -> None:
    job = Job(
        role="cost",
        root=str(tmp_path / "root"),
        result=str(tmp_path / "r.json"),
        states=[str(tmp_path / "missing.safetensors")] * 2,
    )
    proc, log = _start(job, tmp_path, "cost")
    with pytest.raises(BenchFailed, match=r"(?s)exited 1.*missing\.safetensors") as exc:
        _finish([(proc, log, job)], timeout=120)
    # the child's exception first, on the error's first line: not a traceback's start
    first = str(exc.value).split("\n", 1)[0]
    assert "exited 1: " in first and "Error" in first and "Traceback" not in first, first


def test_a_child_killed_by_a_signal_is_reported_as_such(tmp_path: Path) -> None:
    """A child the OOM killer (or anyone) killed: the error names the signal, not whatever
    line its log happened to end with."""
    import subprocess

    from asyncsync.ops.bench.measure import _exited

    log = tmp_path / "log.txt"
    log.write_text("bench: version 3 published\n")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    proc.kill()
    proc.wait()
    err = str(_exited(proc, log))
    assert err.startswith("benchmark child killed by SIGKILL (the OOM killer?)"), err
    assert "version 3 published" in err  # the log's end still follows


def _waiting_publisher(tmp_path: Path, timeout: float) -> tuple[Any, Path, Job]:
    """A real scale publisher child that seeds a 1 MiB model, then waits for a receiver that
    never says it is ready (up to ``timeout``)."""
    (tmp_path / "root").mkdir()
    job = Job(
        role="scale-publish", root=str(tmp_path / "root"), result=str(tmp_path / "pub.json"),
        ready=str(tmp_path / "never"), scale_bytes=1 << 20, versions=1, timeout=timeout,
    )  # fmt: skip
    return (*_start(job, tmp_path, "pub"), job)


def test_a_failing_child_fails_the_run_while_its_peer_still_waits(tmp_path: Path) -> None:
    """The receiver fails while the publisher waits for it (the publisher first in the list,
    as the bench passes them): the run fails at once with the receiver's log, not after the
    publisher has waited out its timeout, and the waiting child is stopped."""
    waiting = _waiting_publisher(tmp_path, timeout=3600)
    job = Job(
        role="cost",
        root=str(tmp_path / "root-cost"),
        result=str(tmp_path / "r.json"),
        states=[str(tmp_path / "missing.safetensors")] * 2,
    )
    failing = (*_start(job, tmp_path, "cost"), job)
    with pytest.raises(BenchFailed, match=r"(?s)exited 1.*missing\.safetensors"):
        _finish([waiting, failing], timeout=3600)
    assert waiting[0].poll() is not None


def test_a_child_past_its_timeout_is_reported_with_its_stacks(tmp_path: Path) -> None:
    """A child still running at the timeout: the error quotes every thread's stack (the
    child's faulthandler on SIGUSR1), here the publisher waiting for its receiver."""
    waiting = _waiting_publisher(tmp_path, timeout=3600)
    seeded = tmp_path / "root" / "v000000000000" / "manifest.json"
    for _ in range(12000):  # the child runs its job (faulthandler set) once it has seeded
        if seeded.exists() or waiting[0].poll() is not None:
            break
        time.sleep(0.01)
    assert seeded.exists(), waiting[1].read_text()
    with pytest.raises(
        BenchFailed, match=r"(?s)timed out after 1s.*asyncio.*in _wait.*Thread.*worker.py.*in main"
    ):
        _finish([waiting], timeout=1)
    assert waiting[0].poll() is not None


# ------------------------------------------------------------------------------ the scale sweep
SCALE_KEYS = (
    "model_bytes",
    "trainer_floor_s",
    "receiver_floor_s",
    "transfer_floor_s",
    "floor_s",
    "floor_production_s",
    "publish_s",
    "apply_s",
    "e2e_s",
    "full_sync_s",
    "publish_cpu_s_per_gib",
    "apply_cpu_s_per_gib",
    "e2e_vs_trainer_floor",
    "overlap",
    "publisher_peak_rss_vs_model",
    "receiver_peak_rss_vs_model",
)


def test_scale_sweep_writes_the_promised_keys(tmp_path: Path) -> None:
    """``--scale`` with two tiny sizes: the real children, the JSON keys, the plots."""
    argv = ["bench", "--scale", "--scale-sizes", "2MiB,4MiB", "--versions", "1"]
    # a child that hangs fails the bench with every thread's stack before pytest's timeout
    argv += ["--timeout", "200", "--workdir", str(tmp_path), "--json", str(tmp_path / "s.json")]
    argv += ["--plot", str(tmp_path / "plots")]
    assert main(argv) == 0
    s = json.loads((tmp_path / "s.json").read_text())
    assert [r["model_bytes"] for r in s["scale"]] == sorted(r["model_bytes"] for r in s["scale"])
    for row in s["scale"]:
        for key in SCALE_KEYS:
            assert _number(row[key]) and row[key] > 0, key
        assert row["floor_s"] >= max(
            row["trainer_floor_s"], row["receiver_floor_s"], row["transfer_floor_s"]
        )
        assert row["floor_s"] >= row["floor_production_s"]
        assert row["e2e_vs_trainer_floor"] == pytest.approx(row["e2e_s"] / row["trainer_floor_s"])
        # the slower side plus one shard's write and read at the default 200 MB/s + 5 ms
        one_shard = row["wire_bytes"] / row["shards"] / 200e6 + 2 * 0.005
        slower = max(row["publish_s"], row["apply_s"])
        assert row["overlap"] == pytest.approx(row["e2e_s"] / (slower + one_shard))
        assert 0.02 < row["density"] < 0.04
    for row in s["scale"]:  # the sampled peak of the VmHWM's phase, split by kind
        for side in ("publisher", "receiver"):
            sp = row[f"{side}_peak_rss_split"]
            assert sp["phase"] in ("startup", "steady") and sp["samples"] >= 1, side
            assert sp["vmhwm"] == pytest.approx(row[f"{side}_peak_rss_vs_model"])
            assert sp["rss"] == pytest.approx(sp["anon"] + sp["file"] + sp["shmem"])
            assert sp["max_file"] >= sp["file"] and sp["cpu_s"] >= 0
    assert "split at the sampled peak (anon + file + shmem)" in scale_markdown(s)
    assert s["command"].startswith("asyncsync bench --scale --scale-sizes")
    assert set(s["scale_targets"]) >= {"publish_linear", "apply_linear"}
    assert {"e2e_vs_trainer_floor", "overlap"} <= set(SCALE_TARGETS)
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "scale_ratios.png",
        "scale_seconds_per_gb.png",
    ]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("asyncsync-bench")] == []


def test_scale_sweep_with_the_redo_log_charges_its_compactions(tmp_path: Path) -> None:
    """``--scale --redo-log 2``: 4 versions (two cycles), each compaction in the run timed, the
    mean CPU over the run (compactions charged) beside the per-version median."""
    argv = ["bench", "--scale", "--scale-sizes", "2MiB", "--redo-log", "2", "--timeout", "200"]
    argv += ["--workdir", str(tmp_path), "--json", str(tmp_path / "s.json")]
    assert main(argv) == 0
    (row,) = json.loads((tmp_path / "s.json").read_text())["scale"]
    assert row["redo_log"] == 2 and row["repeats"]["versions"] == 4
    assert [n for n, _secs in row["compactions"]] == [2, 2]
    assert row["apply_cpu_cycle_s_per_gib"] > 0
    assert row["disk_writes_per_version_vs_model"] is not None


def test_peers_run_every_system_interleaved(tmp_path: Path) -> None:
    """``--peers`` at a tiny size: the real children, every system's versions, the appliers'
    results bit-exact (each peer's engine state is checked against the trainer's)."""
    argv = ["bench", "--peers", "--scale-sizes", "2MiB", "--versions", "2", "--threads", "1"]
    argv += ["--workdir", str(tmp_path), "--json", str(tmp_path / "p.json")]
    assert main(argv) == 0
    s = json.loads((tmp_path / "p.json").read_text())
    (row,) = s["peers"]
    assert set(row["e2e_s"]) == {"ours", "ours-mem", "gen1", "gen2", "full"}
    for system, versions in row["raw"].items():  # a warm-up round, then the timed versions
        assert [(v["version"], v.get("warmup", False)) for v in versions] == [
            (1, True), (2, False), (3, False)], system  # fmt: skip
        assert all(v["e2e"] >= v["write"] > 0 for v in versions)
    assert row["versions"] == 2
    assert set(row["peer_vs_ours"]) == {"ours-mem", "gen1", "gen2", "full"}
    assert "--peers" in s["command"] and "--threads 1" in s["command"]


async def test_peers_receiver_looks_for_the_next_turn_only_between_windows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The peers bench's receiver runs one system's engine side per window: while a window is
    open it reads no turn (nor starts another system's loop), even when the next is announced;
    the next is handed over once the window closes, and ``done`` ends the dispatch."""
    import asyncio

    from asyncsync.ops.bench import peers

    reads: list[tuple[str, int] | None] = []
    real = peers._read_turn

    def counted(root: Path) -> tuple[str, int] | None:
        reads.append(turn := real(root))
        return turn

    monkeypatch.setattr(peers, "_read_turn", counted)
    opened, release = asyncio.Event(), asyncio.Event()
    windows: list[tuple[str, int, int]] = []

    async def window(system: str, version: int) -> None:
        windows.append((system, version, len(reads)))
        if system == "gen1":
            opened.set()
            await release.wait()
            assert len(reads) == windows[-1][2]  # no turn read while it was open

    peers._announce(tmp_path, "gen1", 1)
    task = asyncio.create_task(peers._dispatch(tmp_path, window))
    await opened.wait()
    peers._announce(tmp_path, "ours", 1)  # announced while gen1's window is open
    for _ in range(3):
        await asyncio.sleep(peers._POLL)  # a dispatcher that polled would have read it
    assert [w[:2] for w in windows] == [("gen1", 1)]
    release.set()
    while len(windows) < 2:
        await asyncio.sleep(peers._POLL)
    peers._announce(tmp_path, peers._DONE, 1)
    await asyncio.wait_for(task, 30)
    assert [w[:2] for w in windows] == [("gen1", 1), ("ours", 1)]


def test_peer_appliers_reproduce_the_new_state(tmp_path: Path) -> None:
    from asyncsync.ops.bench import peers
    from asyncsync.ops.bench.scale import make_state, step_state

    old = make_state(1 << 20, seed=3)
    new = {k: t.clone() for k, t in old.items()}
    step_state(new, 1, 0.03, seed=3)
    for system in ("gen1", "gen2", "full"):
        state = {k: t.clone() for k, t in old.items()}
        path = tmp_path / f"{system}.safetensors"
        peers._WRITERS[system](path, old, new)
        peers._APPLIERS[system](path.read_bytes(), state)
        assert all(same_bytes(state[k], new[k]) for k in new), system


def test_scale_states_are_seeded_and_change_one_ulp() -> None:
    from asyncsync.ops.bench.scale import make_state, step_state

    def same(x: dict[str, torch.Tensor], y: dict[str, torch.Tensor]) -> bool:
        return list(x) == list(y) and all(same_bytes(x[k], y[k]) for k in x)

    a, b = make_state(1 << 20, seed=3), make_state(1 << 20, seed=3)
    assert same(a, b)
    assert 0.9 * (1 << 20) < sum(t.numel() * 2 for t in a.values()) < 1.1 * (1 << 20)
    old = {k: t.clone() for k, t in a.items()}
    step_state(a, 1, 0.03, seed=3)
    step_state(b, 1, 0.03, seed=3)
    assert same(a, b)
    changed = total = 0
    for k, t in a.items():
        d = (t.view(torch.int16).int() - old[k].view(torch.int16).int()).abs()
        assert int(d.max()) <= 1  # one ulp (the sign bit never moves)
        changed += int((d != 0).sum())
        total += t.numel()
    assert 0.025 < changed / total < 0.031  # ~3 %, less the positions drawn twice


def test_the_trainer_floor_times_one_thread_too() -> None:
    """A multi-thread torch.ne pass beside another process's work waits for its descheduled
    thread (1 GiB read 1.8-3.7 s against ~0.2 s quiet on the 2-core host): the floor is also
    timed on one thread, and torch's own thread count is left as it was."""
    from asyncsync.ops.bench.scale import make_state, ne_passes, step_state, trainer_floor

    old = make_state(1 << 20, seed=1)
    new = {k: t.clone() for k, t in old.items()}
    step_state(new, 1, 0.03, seed=1)
    threads = torch.get_num_threads()
    seen: list[int] = []
    real_ne = torch.ne

    def ne(*args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(torch.get_num_threads())
        return real_ne(*args, **kwargs)

    try:
        torch.set_num_threads(2)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch, "ne", ne)
            passes = ne_passes(old, new)
        assert len(passes) == 2 and all(w > 0 and c >= 0 for w, c in passes)
        assert set(seen) == {1, 2} and torch.get_num_threads() == 2
        assert trainer_floor(old, new) > 0
        torch.set_num_threads(1)
        assert len(ne_passes(old, new)) == 1  # one thread already: one pass
    finally:
        torch.set_num_threads(threads)


def test_scale_flag_validation(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--scale", "--scale-sizes", "12"]) == 2  # under 1 MiB
    assert "at least 1 MiB" in capsys.readouterr().err
    assert main(["bench", "--scale", "--scale-sizes", "lots"]) == 2
    assert "is not a size" in capsys.readouterr().err
    assert main(["bench", "--redo-log", "2"]) == 1  # not a --scale run (a ConfigError)
    assert "--redo-log is an option of --scale" in capsys.readouterr().err
    assert main(["bench", "--scale", "--redo-log", "4", "--versions", "3"]) == 1
    assert "no compaction would fall in the timed versions" in capsys.readouterr().err


def test_scale_sizes_memory_cannot_hold_are_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A model size whose run needs more memory than the host has available: a ConfigError
    (exit 1) naming both, before any child starts, for the scale sweep, the peers and the
    profile; a size that fits is let through."""
    from asyncsync.ops.bench import cli

    monkeypatch.setattr(cli, "page_cache_room", lambda: 200 << 20)
    started: list[object] = []
    monkeypatch.setattr("asyncsync.ops.bench.measure.run_bench", lambda *a, **k: started.append(a))
    monkeypatch.setattr("asyncsync.ops.bench.profile.main", lambda *a, **k: started.append(a))
    for argv in (
        ["bench", "--scale", "--scale-sizes", "64MiB,1GiB"],
        ["bench", "--peers", "--scale-sizes", "1GiB"],
        ["bench", "--profile", "/nonexistent", "--scale-sizes", "1GiB"],
    ):
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert "1.0 GiB needs about 3.5 GiB" in err and "200.0 MiB is available" in err, err
        assert "give smaller --scale-sizes" in err, err
    assert not started
    cli.check_memory([32 << 20])  # 112 MiB: fits
    cli.check_memory([])  # nothing to run


def test_device_check_runs_on_cpu(tmp_path: Path) -> None:
    """``--device`` is for a GPU; on the CPU the same code checks itself (bit-exact asserts)."""
    argv = ["bench", "--device", "cpu", "--scale-sizes", "2MiB", "--versions", "1"]
    assert main([*argv, "--json", str(tmp_path / "d.json")]) == 0
    d = json.loads((tmp_path / "d.json").read_text())["device"]
    assert d["bit_exact"] is True and d["device"] == "cpu" and d["changed"] > 0
    for key in ("ne_pass_s", "diff_s", "publish_s", "apply_on_device_s"):
        assert _number(d[key]) and d[key] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has CUDA")
def test_device_cuda_without_a_gpu_is_one_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--device", "cuda", "--scale-sizes", "2MiB"]) != 0
    assert "no CUDA device" in capsys.readouterr().err


def test_profile_writes_both_sides_and_unwraps(tmp_path: Path) -> None:
    """``--profile DIR``: a stage table and a sampled top-N per side; every stage function is
    put back afterwards and the work directory is removed."""
    from asyncsync.ops.bench.profile import APPLY_STAGES, PUBLISH_STAGES, _resolve

    def current() -> list[Any]:
        out = []
        for _, _, target in PUBLISH_STAGES + APPLY_STAGES:
            owner, attr = _resolve(target)
            out.append(owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr))
        return out

    before = current()
    out = tmp_path / "prof"
    argv = ["bench", "--profile", str(out), "--scale-sizes", "2MiB", "--versions", "1"]
    assert main([*argv, "--workdir", str(tmp_path)]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "profile_apply_2m.txt",
        "profile_publish_2m.txt",
    ]
    apply_text = (out / "profile_apply_2m.txt").read_text()
    labels = ("journal record created", "patch", "verify tensors", "read shard", "top 25 by self")
    labels += ("pool workers (asyncsync-cpu), measured per thread",)
    for label in labels:
        assert label in apply_text, label
    assert "diff (C kernel" in (out / "profile_publish_2m.txt").read_text()
    assert current() == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("asyncsync-profile")] == []


@pytest.mark.skipif(not Path("/proc/thread-self/schedstat").exists(), reason="Linux schedstat")
def test_profile_stage_table_splits_the_wall_into_cpu_queued_and_asleep() -> None:
    """A stage's wall beyond its CPU was one number: a prefault reading 178 ms of wall for
    25 ms of CPU could not tell a wait on the disk from a wait for a core. The table now says
    how long the thread was runnable but not running (schedstat) and asleep (the rest)."""
    from asyncsync.ops.bench.profile import StageTimers, _stage_table

    stages = tuple((0, name, f"{__name__}:_profile_{name}") for name in ("sleeps", "spins"))
    timers = StageTimers(stages)
    with timers.installed():
        mod = sys.modules[__name__]
        mod._profile_sleeps(0.05)  # type: ignore[attr-defined]
        mod._profile_spins(0.02)  # type: ignore[attr-defined]
    assert sys.modules[__name__]._profile_sleeps is _profile_sleeps  # put back
    slept, spun = timers.tallies["sleeps"], timers.tallies["spins"]
    for t in (slept, spun):
        assert t.calls == 1 and t.queued >= 0 and t.cpu + t.queued <= t.wall + 1e-3
    assert slept.wall - slept.cpu - slept.queued >= 0.045  # the sleep is neither CPU nor queued
    assert spun.cpu > 0
    table = _stage_table(timers, 1, "sleeps")
    assert table[0].split()[-5:] == ["queued", "asleep", "%", "of", "wall"]
    row = table[1].split()
    assert row[0] == "sleeps" and float(row[5]) >= 45.0  # the asleep column, in ms


def test_the_run_queue_reader_reopens_a_dead_threads_descriptor_under_a_reused_id() -> None:
    """``_RunQueue`` keeps one /proc/thread-self/schedstat descriptor per native thread id. A
    thread started after another ended may get its id: it read the dead thread's descriptor
    (ESRCH) and every stage on it read NaN. Here the dead thread's descriptor is put under
    this thread's id, as the reuse would leave it."""
    import threading

    from asyncsync.ops.bench.profile import _RunQueue

    rq = _RunQueue()
    got: list[tuple[int, float]] = []
    t = threading.Thread(target=lambda: got.append((threading.get_native_id(), rq())))
    t.start()
    t.join()
    dead, first = got[0]
    if math.isnan(first):
        pytest.skip("no /proc/thread-self/schedstat here")
    fd = rq._fds[dead][0]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # join() returns before the kernel's thread is gone
        try:
            os.pread(fd, 128, 0)
        except ProcessLookupError:
            break
        time.sleep(0.01)
    else:
        pytest.fail("the joined thread's schedstat still reads after 30 s")
    me = threading.get_native_id()
    rq._fds.pop(me, None)
    rq._fds[me] = rq._fds.pop(dead)
    try:
        assert not math.isnan(rq()) and not math.isnan(rq())
    finally:
        rq.close()


def test_profile_measures_the_pool_workers_glue_apart_from_their_items() -> None:
    """The sampler charges a waiting frame (the pool's ``_worker``) the CPU of the work before
    it, so the pool workers' CPU between their items is measured per thread instead: every
    item on the pool is counted, and its CPU is inside the workers' own."""
    from asyncsync.ops.bench.profile import StackSampler
    from asyncsync.pipeline import SMALL_WORK_BYTES, run_all, set_threads

    set_threads(2)
    try:
        with StackSampler() as s:
            done = run_all(_profile_spins, [0.02] * 4, cost=lambda _: SMALL_WORK_BYTES)
    finally:
        set_threads(None)
    assert done == [None] * 4
    assert s.pool_items == 4
    assert 0.08 <= s.pool_items_cpu <= s.pool_cpu


def _profile_sleeps(seconds: float) -> None:
    time.sleep(seconds)


def _profile_spins(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_profile_takes_throttle_none(tmp_path: Path) -> None:
    """``--profile DIR --throttle none`` profiles over the local filesystem, as ``--peers`` and
    the sweep take it (it was a ValueError traceback: 'cannot parse throttle')."""
    out = tmp_path / "prof"
    argv = ["bench", "--profile", str(out), "--scale-sizes", "2MiB", "--versions", "1"]
    assert main([*argv, "--throttle", "none", "--workdir", str(tmp_path)]) == 0
    assert "no throttle on the shared root" in (out / "profile_apply_2m.txt").read_text()


def test_the_sglang_pause_bench_measures_gaps_and_bounds_its_ratio() -> None:
    """tests/sglang_env/bench_reload.py's arithmetic (the real runs take minutes: make
    bench-sglang): the longest gap overlapping each window, the floor outside them, and the
    lowest ratio possible (the in-engine floor over the full reload's pause)."""
    from tests.sglang_env import bench_reload as b

    done = [0.0, 0.1, 0.2, 0.6, 0.7, 0.8, 1.5, 1.6]
    assert b.pauses(done, [(0.25, 0.3), (1.0, 1.1)]) == pytest.approx([0.4, 0.7])
    assert b.floor_gap(done, [(0.25, 0.3), (1.0, 1.1)]) == pytest.approx(0.1)

    def series(kind: str, pause: float, floor: float) -> dict[str, object]:
        rows = [
            {"fraction": f, "client_pause": pause, "client_pause_server_paused": pause,
             "server_pause": pause / 2, "apply_ms": 30.0}
            for f in b.FRACTIONS
        ]  # fmt: skip
        return {"kind": kind, "rows": rows, "floor": floor, "floor_idle": floor}

    text = b.table([series("in-engine", 0.2, 0.08), series("full", 0.32, 0.08)])
    row = next(line for line in text.splitlines() if line.startswith("| 3% |"))
    assert "| 0.62x |" in row and row.endswith("| 30 ms (30-30) | 0.25x |"), row


def test_passes_bench_runs_every_row(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m asyncsync.ops.bench.passes`` at a small size: every pass it compares runs
    (the AVX2 diff row where the CPU has it) and their results agree (it asserts so)."""
    from asyncsync.codec import native
    from asyncsync.ops.bench import passes

    if native.kernels is None:
        pytest.skip("the C kernels are not built")
    assert passes.main(["200000"]) == 0
    out = capsys.readouterr().out
    for row in ("diff+hash+advance", "journal in the patch pass", "patch+hash C", "unplanes C"):
        assert row in out, row
    assert ("diff word loop" in out) == bool(native.kernels.simd())


@pytest.mark.parametrize("arg", ["--help", "abc", "5", "1e9", str(1 << 40)])
def test_passes_bench_arguments(arg: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Its one argument: ``--help`` is the usage, a bad size a usage error (exit 2) naming it,
    not a traceback and not a run."""
    from asyncsync.ops.bench import passes

    with pytest.raises(SystemExit) as exc:
        passes.main([arg])
    err = capsys.readouterr()
    if arg == "--help":
        assert exc.value.code == 0 and "elements" in err.out
    else:
        assert exc.value.code == 2 and "argument elements" in err.err and "Traceback" not in err.err


def test_syncfloor_measures_and_checks_every_pass(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m asyncsync.ops.bench.syncfloor`` at 1 MiB: every row, and its passes really
    made the new state (``measure`` checks the snapshot, the engine and the digests; a pass
    that wrote other bytes fails it, as shown by breaking the engine's pass)."""
    from asyncsync.codec import native
    from asyncsync.ops.bench import syncfloor

    if native.kernels is None:
        pytest.skip("the C kernels are not built")
    assert syncfloor.main(["--size", "1MiB", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    for row in ("trainer floor", "1 thread)", "on 2 threads", "engine pass", "at once"):
        assert row in out, row
    floors = syncfloor.measure(1 << 20, 1)
    assert all(len(v) == 1 and v[0] > 0 for v in vars(floors).values())

    real = syncfloor._Passes.engine_pass

    def skips_one(self: object, k: int) -> list[str]:  # a pass that leaves one tensor alone
        got = real(self, k)  # type: ignore[arg-type]
        self.engine[0][:] = self.base[0]  # type: ignore[attr-defined]
        return got

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(syncfloor._Passes, "engine_pass", skips_one)
        with pytest.raises(AssertionError, match="other bytes"):
            syncfloor.measure(1 << 20, 1)


def test_syncfloor_refuses_a_size_memory_cannot_hold(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A model whose copies do not fit the memory available: exit 1 saying so, before any
    allocation (not the OOM killer midway)."""
    from asyncsync.ops.bench import cli, syncfloor

    monkeypatch.setattr(cli, "page_cache_room", lambda: 5 << 20)
    monkeypatch.setattr(syncfloor, "_Passes", None)  # nothing may be allocated
    assert syncfloor.main(["--size", "1MiB"]) == 1
    err = capsys.readouterr().err
    assert "1.0 MiB needs about 6.0 MiB" in err and "5.0 MiB is available" in err, err
    assert "give a smaller --size" in err, err


@pytest.mark.parametrize(
    "args", [["--size", "1KiB"], ["--size", "lots"], ["--repeats", "0"], ["--repeats", "x"]]
)
def test_syncfloor_arguments(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """A bad size or count is a usage error (exit 2) naming the argument, not a run."""
    from asyncsync.ops.bench import syncfloor

    with pytest.raises(SystemExit) as exc:
        syncfloor.main(args)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and args[0] in err and "Traceback" not in err


def test_pertensor_bench_measures_both_sides(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m asyncsync.ops.bench.pertensor``: CPU per tensor of each side, per version."""
    from asyncsync.ops.bench import pertensor

    assert pertensor.main(["--tensors", "30", "--numel", "256", "--versions", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("us/tensor") == 2 and "30 tensors of 256 elements" in out
    for bad in (["--tensors", "0"], ["--threads", "0"], ["--threads", "5000"]):
        with pytest.raises(SystemExit) as ei:  # a usage error (helper-21: --threads 0 raised)
            pertensor.main(bad)
        assert ei.value.code == 2


def test_catchup_bench_applies_a_keyframe_in_fresh_processes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``python -m asyncsync.ops.bench.catchup``: each repeat a process of its own (its own
    peak RSS) that applies the keyframe into an empty checkpoint; the figures measured."""
    import re

    from asyncsync.ops.bench import catchup

    res = catchup.measure(5 << 20, 2)
    assert all(len(xs) == 2 for xs in res.values())
    assert all(x > 0 for x in res["wall"] + res["cpu"] + res["floor"])
    assert min(res["peak"]) >= 0  # above the process's peak before the agent starts
    assert catchup.main(["--size", "2MiB", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"catch-up of a 0\.00 GiB keyframe \(1 repeats\): wall [0-9.]+ \[", out)
    for bad in (["--size", "1KiB"], ["--size", "lots"], ["--repeats", "0"]):
        with pytest.raises(SystemExit) as ei:
            catchup.main(bad)
        assert ei.value.code == 2


def test_profile_runs_on_the_threads_given_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--profile --threads N`` ran on every core whatever N was (the sweep's children take
    it): the pool and torch now run publish and apply at N threads, the report says which,
    and both are put back afterwards."""
    from asyncsync import pipeline

    torch_before, pool_before = torch.get_num_threads(), pipeline.threads()
    seen: set[tuple[int, int]] = set()
    real = pipeline.threads

    def watched() -> int:  # what parallel_map sizes its pool by, with torch's count
        seen.add((real(), torch.get_num_threads()))
        return real()

    monkeypatch.setattr(pipeline, "threads", watched)
    out = tmp_path / "prof"
    argv = ["bench", "--profile", str(out), "--scale-sizes", "2MiB", "--versions", "1"]
    argv += ["--threads", "1", "--throttle", "none", "--workdir", str(tmp_path)]
    assert main(argv) == 0
    assert (1, 1) in seen and all(pool == 1 for pool, _ in seen), seen
    for side in ("publish", "apply"):
        text = (out / f"profile_{side}_2m.txt").read_text()
        assert "--threads 1" in text
        assert "CPU pool (asyncsync-cpu) 1 threads, torch 1 intra-op threads" in text
        assert "1-thread pool" in text
    assert (torch.get_num_threads(), real()) == (torch_before, pool_before)


def test_a_terminated_bench_stops_its_children(tmp_path: Path) -> None:
    """(attack-42) SIGTERM to ``asyncsync bench`` (a CI job cancelled, ``timeout``) ended it
    at once and left its child processes running on for 15-20 s, a core each. It unwinds as
    Ctrl-C does now: the children are stopped, status 143."""
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncsync", "bench", "--peers", "--scale-sizes", "32MiB",
         "--throttle", "none", "--timeout", "120"],
        cwd=repo, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    children: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not children:
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "the bench started no child"
            with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
                children = [int(c) for c in f.read().split()]
            time.sleep(0.1)
        time.sleep(1.0)  # the children at work
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM
    alive = [c for c in children if Path(f"/proc/{c}").exists()]
    for c in alive:  # (not ours to leave behind, whatever the outcome)
        with contextlib.suppress(ProcessLookupError):
            os.kill(c, signal.SIGKILL)
    assert alive == [], "children left running"


def test_every_profile_stage_names_a_function_that_exists() -> None:
    """The profiles' stage targets (``module:qualname``) are strings: a function renamed or
    removed is skipped by the timers without a word (as a stage of another code's version), so
    the table would silently lose that row. Every target of ``asyncsync bench --profile`` and of
    the GPU machine's ``stress/device_profile.py`` resolves here."""
    import importlib

    from asyncsync.ops.bench.profile import APPLY_STAGES, PUBLISH_STAGES
    from stress import device_profile

    missing = []
    for _, _, target in (*PUBLISH_STAGES, *APPLY_STAGES, *device_profile.APPLY):
        module, _, qualname = target.partition(":")
        owner: Any = importlib.import_module(module)
        for part in qualname.split("."):
            owner = getattr(owner, part, None)
            if owner is None:
                missing.append(target)
                break
    assert not missing, missing
