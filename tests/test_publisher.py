"""Publisher: what it commits, zero diff, keyframes, atomicity under injected failures."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors
import safetensors.torch
import torch

from asyncsync import (
    AckTimeout,
    ConfigError,
    FormatError,
    LockHeld,
    Publisher,
    PublishError,
    codec,
    fsio,
)
from asyncsync.codec import raw_clone, shards
from asyncsync.format import MANIFEST_NAME
from asyncsync.format import acks as acks_mod
from asyncsync.format.log import read_log
from asyncsync.format.store import list_versions, read_manifest
from asyncsync.publish import snapshot
from tests.conftest import mixed_state, mutate, same_bytes


def files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


async def test_seed_publish_and_format(tmp_path: Path) -> None:
    sd0 = mixed_state(0)
    async with Publisher(tmp_path, bucket_bytes=4096, keyframe_interval=0) as pub:
        r0 = await pub.seed(sd0)
        assert (r0.version, r0.kind, r0.base_version) == (0, "full", None)
        sd1 = mutate(sd0, 0.05, seed=1)
        r1 = await pub.publish(sd1)
    assert (r1.version, r1.kind, r1.base_version) == (1, "delta", 0)
    assert 0 < r1.changed < r1.total and r1.density == pytest.approx(r1.changed / r1.total)
    assert r1.shards > 1  # small buckets: several shards
    assert set(r1.seconds) >= {"encode", "write", "commit", "total"}
    m0, m1 = read_manifest(tmp_path, 0), read_manifest(tmp_path, 1)
    # full shards are plain safetensors checkpoints keyed by tensor name
    full: dict[str, torch.Tensor] = {}
    for s in m0.shards:
        with safetensors.safe_open(str(tmp_path / "v000000000000" / s.file), "pt") as f:
            full.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    for k, t in sd0.items():
        assert same_bytes(full[k], t), k  # a bool's bytes too, not 0/1
        assert full[k].dtype == t.dtype and full[k].shape == t.shape
    # delta shards: uint8 blobs named in the manifest
    for e in m1.tensors:
        if e.delta is not None:
            path = tmp_path / "v000000000001" / m1.shards[e.delta.shard].file
            with safetensors.safe_open(str(path), "pt") as f:
                assert f.get_tensor(e.delta.values).dtype == torch.uint8
    assert [r["version"] for r in read_log(tmp_path)] == [0, 1]
    assert m1.totals.wire_bytes == sum(s.bytes for s in m1.shards)
    assert not [f for f in files_under(tmp_path) if ".tmp." in f]


async def test_zero_diff_commits_a_version_without_shards(tmp_path: Path) -> None:
    sd = mixed_state(0)
    async with Publisher(tmp_path, keyframe_interval=0) as pub:
        await pub.seed(sd)
        r = await pub.publish({k: raw_clone(v) for k, v in sd.items()})  # a bool's bytes too
    assert r.zero_diff and r.shards == 0 and r.wire_bytes == 0
    m = read_manifest(tmp_path, 1)
    assert m.kind == "delta" and m.shards == () and m.totals.changed == 0
    assert m.fingerprint == read_manifest(tmp_path, 0).fingerprint
    assert sorted(os.listdir(tmp_path / "v000000000001")) == [MANIFEST_NAME]


async def test_keyframes_by_interval_and_request(tmp_path: Path) -> None:
    sd = mixed_state(0)
    async with Publisher(tmp_path, keyframe_interval=3) as pub:
        await pub.seed(sd)
        kinds = []
        for i in range(1, 7):
            sd = mutate(sd, 0.02, seed=i)
            kinds.append((await pub.publish(sd, keyframe=(i == 5))).kind)
    assert kinds == ["delta", "delta", "full", "delta", "full", "full"]
    m3 = read_manifest(tmp_path, 3)
    assert m3.base_version == 2 and m3.has_delta  # keyframes also carry the delta
    assert {s.role for s in m3.shards} == {"delta", "full"}


async def test_schema_change_publishes_full(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sd = mixed_state(0)
    async with Publisher(tmp_path) as pub:
        await pub.seed(sd)
        sd2 = dict(sd)
        sd2["new.tensor"] = torch.ones(3)
        gone, retyped = sorted(sd)[:2]
        del sd2[gone]
        sd2[retyped] = sd[retyped].double().reshape(-1)
        with caplog.at_level(logging.WARNING, logger="asyncsync"):
            r = await pub.publish(sd2)
    assert r.kind == "full" and r.base_version is None
    # (issue 20, operator) a WARNING naming what changed
    (msg,) = [r.getMessage() for r in caplog.records if "tensor set changed" in r.getMessage()]
    assert "added: new.tensor" in msg and f"removed: {gone}" in msg
    assert f"re-typed: {retyped} {sd[retyped].dtype}" in msg and "torch.float64" in msg


async def test_one_publisher_per_root(tmp_path: Path) -> None:
    async with Publisher(tmp_path):
        with pytest.raises(LockHeld, match="another publisher"):
            async with Publisher(tmp_path):
                pass


async def test_publish_needs_seed_and_validates(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        Publisher(tmp_path, encoding="nope")
    with pytest.raises(ConfigError):
        Publisher(tmp_path, bucket_bytes=0)
    # the wrong type is a ConfigError naming the option, never a TypeError from a comparison
    for bad in (
        {"keyframe_interval": None},
        {"bucket_bytes": "8M"},
        {"max_in_flight": 1.5},
        {"zstd_level": True},
        {"delta_shard_bytes": 2.0},
        {"mode": None},
        {"pipelined": "no"},  # (was taken as True: it ran pipelined)
        {"pipelined": None},
    ):
        name = next(iter(bad))
        with pytest.raises(ConfigError, match=name):
            Publisher(tmp_path, **bad)  # type: ignore[arg-type]
    Publisher(tmp_path, bucket_bytes=np.int64(1 << 20), delta_shard_bytes=None)
    for root in ("", None, b"/tmp/r"):  # "" published into the working directory
        with pytest.raises(ConfigError, match="root must be a non-empty path"):
            Publisher(root)  # type: ignore[arg-type]
    async with Publisher(tmp_path) as pub:
        with pytest.raises(PublishError, match="seed"):
            await pub.publish({"a": torch.ones(2)})
        with pytest.raises(ConfigError, match="dtype"):
            await pub.seed({"a": torch.ones(2, dtype=torch.complex128)})
        # a tensor without dense data: ConfigError naming it, at seed and at publish
        odd = {
            "meta tensor": torch.empty(4, device="meta"),
            "layout torch.sparse_coo": torch.ones(4).to_sparse(),
            "negated view": torch.ones(4)._neg_view(),
            "nested tensor": _nested(),
            "layout torch.jagged": torch.nested.nested_tensor(
                [torch.ones(2), torch.ones(3)], layout=torch.jagged
            ),
        }
        for what, t in odd.items():
            with pytest.raises(ConfigError, match=f"'a'.* {what}"):
                await pub.seed({"a": t})
        await pub.seed({"a": torch.ones(4)})
        for what, t in odd.items():
            with pytest.raises(ConfigError, match=f"'a'.* {what}"):
                await pub.publish({"a": t})
        assert (await pub.publish({"a": torch.ones(4)})).changed == 0
        # an empty state dict (helper-23, finding 8: it committed a version of no tensors,
        # which every engine applied, left with none)
        with pytest.raises(ConfigError, match="the state dict is empty"):
            await pub.publish({})
    assert list_versions(tmp_path) == [0, 1]
    async with Publisher(tmp_path / "empty") as pub:
        with pytest.raises(ConfigError, match="the state dict is empty"):
            await pub.seed({})
    assert list_versions(tmp_path / "empty") == []


def _nested() -> torch.Tensor:
    """A nested tensor of torch's default (strided) layout: a RuntimeError from deep inside the
    diff before (helper-23, finding 9)."""
    import warnings

    with warnings.catch_warnings():  # "the PyTorch API of nested tensors is in prototype stage"
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])


def _fail(*_a: object, **_k: object) -> None:
    raise OSError(28, "No space left on device (injected)")


@pytest.mark.parametrize("stage", ["encode", "write", "fsync", "hook", "manifest"])
async def test_failure_at_each_stage_commits_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stage: str
) -> None:
    sd0 = mixed_state(0)
    sd1 = mutate(sd0, 0.05, seed=1)
    calls = {"n": 0}
    hook_fails = {"on": False}

    def hook(vdir: Path) -> None:
        if hook_fails["on"]:
            raise RuntimeError("hook failed (injected)")

    async with Publisher(tmp_path, bucket_bytes=4096, pre_commit_hook=hook) as pub:
        await pub.seed(sd0)
        before = files_under(tmp_path)
        with monkeypatch.context() as mp:
            if stage == "encode":
                mp.setattr("asyncsync.publish.publisher.encode_bucket", _fail)
            elif stage == "write":
                real = fsio.atomic_write

                def flaky(path: Path, data: bytes, **kw: object) -> int:
                    calls["n"] += 1
                    if calls["n"] == 2:  # the second shard of the version
                        _fail()
                    return real(path, data, **kw)  # type: ignore[arg-type]

                mp.setattr("asyncsync.publish.writer.atomic_write", flaky)
            elif stage == "fsync":
                mp.setattr("asyncsync.publish.commit.fsync_dir", _fail)
            elif stage == "hook":
                hook_fails["on"] = True
            else:
                real_aw = fsio.atomic_write

                def fail_manifest(path: Path, data: bytes, **kw: object) -> int:
                    if path.name == MANIFEST_NAME:
                        _fail()
                    return real_aw(path, data, **kw)  # type: ignore[arg-type]

                mp.setattr("asyncsync.publish.commit.atomic_write", fail_manifest)
            with pytest.raises(PublishError, match="nothing was committed") as ei:
                await pub.publish(sd1)
            assert ei.value.__cause__ is not None
            # the step that failed (helper-23, finding 7: it said diff/encode/write for all)
            during = {"encode": "diff/encode/write", "write": "diff/encode/write",
                      "fsync": "fsync", "hook": "pre-commit hook",
                      "manifest": "manifest"}  # fmt: skip
            assert f"failed during {during[stage]}:" in str(ei.value), ei.value
        hook_fails["on"] = False
        assert files_under(tmp_path) == before  # no manifest, no shard, no temp file
        assert list_versions(tmp_path) == [0]
        snap = pub._base.tensors  # advanced in the diff's pass, then put back
        assert snap is not None and all(same_bytes(snap[k], t) for k, t in sd0.items())
        r = await pub.publish(sd1)  # the next publish works, against the unchanged snapshot
        assert r.version == 1 and r.kind == "delta"
    # the delta of v1 is relative to v0 exactly: its per-tensor checksums match sd1
    from asyncsync.format.checksum import checksum_tensor

    m1 = read_manifest(tmp_path, 1)
    for e in m1.tensors:
        assert e.checksum == checksum_tensor(sd1[e.name])


@pytest.mark.parametrize("encoding", ["xef", "indices", "deltas_zstd"])
@pytest.mark.parametrize("encoded", [False, True])
def test_undo_log_puts_back_what_the_diff_advanced(
    tmp_path: Path, encoding: str, encoded: bool
) -> None:
    """The publisher's UndoLog restores every snapshot tensor bit for bit, from the diff's own
    outputs (a bucket not encoded yet) or from its shard's bytes (xef: the XORs decoded; the
    other encodings: the old values kept), for sparse, dense (xef, > 80 % changed), unchanged,
    0-d and empty tensors of every dtype; and does nothing once the manifest is in place."""

    sd0 = mixed_state(3)
    sd0["model.dense.weight"] = torch.arange(512, dtype=torch.int16).view(torch.bfloat16)
    sd1 = mutate(sd0, 0.05, seed=4)
    sd1["model.dense.weight"] = (sd0["model.dense.weight"].view(torch.int16) ^ 1).view(
        torch.bfloat16
    )  # every element changes: xef codes it dense
    sd1["model.scalar"] = sd0["model.scalar"].clone()  # unchanged
    names = sorted(sd0)
    snap = {k: raw_clone(t) for k, t in sd0.items()}  # (clone() writes a bool's bytes as 0/1)
    log = snapshot.UndoLog(encoding)
    modes = set()
    for bucket in snapshot.plan_buckets([sd0[n].numel() * 4 for n in names], 4096):
        items = snapshot.bucket_items(bucket, names, sd1, snap, {})
        d = shards.diff_bucket(items, delta=True, algorithm="xxh3-128", advance=True)
        log.diffed(d)
        if encoded:
            e = shards.encode_bucket(
                d, version=1, run_id="r", delta=True, full=False, encoding=encoding, level=1,
                algorithm="xxh3-128",
            )  # fmt: skip
            log.encoded(d, e)
            modes |= {r.mode for r in e.items}
    assert all(same_bytes(snap[k], sd1[k]) for k in names)  # the diff advanced the snapshot
    assert log
    vdir = tmp_path / "v1"
    vdir.mkdir()
    log.revert(vdir)
    assert all(same_bytes(snap[k], sd0[k]) for k in names), encoding
    assert not log
    if encoded and encoding == "xef":
        assert "dense" in modes and "sparse" in modes
    # a version committed after all: its snapshot is right as it is
    again = snapshot.UndoLog(encoding)
    items = snapshot.bucket_items(list(range(len(names))), names, sd1, snap, {})
    again.diffed(shards.diff_bucket(items, delta=True, advance=True))
    (vdir / MANIFEST_NAME).write_text("{}")
    again.revert(vdir)
    assert all(same_bytes(snap[k], sd1[k]) for k in names)


@pytest.mark.parametrize("own", [False, True])
def test_bucket_items_keep_every_tensors_bytes_and_share_only_when_not_owned(own: bool) -> None:
    """A bucket's items hold each tensor's bytes (a bool's too, not 0/1: its copy is made as
    ints), the caller's own tensor where it is contiguous on the CPU and not owned, a copy
    where ``own`` (a keyframe's bytes read once) or where it is strided."""
    odd = torch.tensor([0, 1, 2, 255], dtype=torch.uint8).view(torch.bool)  # bytes 2 and 255
    sd = {
        "b": odd,
        "w": torch.randn(4, 6).to(torch.bfloat16),
        "t": torch.randn(6, 4).t(),  # strided
        "s": torch.tensor(3.5),  # 0-d
    }
    names = list(sd)
    items = snapshot.bucket_items(list(range(len(names))), names, sd, None, {}, own)
    for it in items:
        t = sd[it.name]
        assert it.new.is_contiguous() and it.new.dtype == t.dtype and it.new.shape == t.shape
        assert same_bytes(it.new, t), it.name
        shares = it.new.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
        assert shares == (not own and t.is_contiguous()), it.name
        assert it.owned == own


async def test_cancelled_publish_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sd0 = mixed_state(0, scale=4)
    async with Publisher(tmp_path, bucket_bytes=2048) as pub:
        await pub.seed(sd0)
        real = shards.encode_bucket
        started = asyncio.Event()
        loop = asyncio.get_running_loop()

        def slow(*a: object, **k: object) -> shards.EncodedBucket:
            loop.call_soon_threadsafe(started.set)
            import time

            time.sleep(0.05)
            return real(*a, **k)  # type: ignore[arg-type]

        monkeypatch.setattr("asyncsync.publish.publisher.encode_bucket", slow)
        task = asyncio.create_task(pub.publish(mutate(sd0, 0.1, seed=2)))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert list_versions(tmp_path) == [0]
        assert not (tmp_path / "v000000000001").exists()
        monkeypatch.setattr("asyncsync.publish.publisher.encode_bucket", real)
        assert (await pub.publish(mutate(sd0, 0.1, seed=2))).version == 1


@pytest.mark.parametrize("during", ["the snapshot's revert", "the directory's removal"])
async def test_a_publish_cancelled_again_while_it_undoes_returns_once_undone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, during: str
) -> None:
    """A cancelled publish undoes its version in threads: the snapshot's revert, the removal of
    the version's directory. A second cancel meanwhile (a timeout and a shutdown, a task
    group's abort) came out at once while the thread went on: the next publish diffed against
    a snapshot the revert was still rewriting, and v1, v2 and every delta after them failed
    their checksum on every engine (held at v0 until a keyframe); the removal raced the next
    publish's claim of the same directory. The undo now ends before the cancel comes out."""
    import threading
    import time

    from asyncsync import fsio

    root = tmp_path / "root"
    sd0 = mixed_state(0, scale=4)
    sd1, sd2 = mutate(sd0, 0.3, seed=1), mutate(sd0, 0.3, seed=2)
    sd3 = mutate(sd2, 0.3, seed=3)
    started, undoing, undone = threading.Event(), threading.Event(), threading.Event()
    real_encode, real_revert, real_remove = shards.encode_bucket, snapshot.UndoLog.revert, None

    def slow_encode(*a: Any, **k: Any) -> shards.EncodedBucket:
        started.set()
        time.sleep(0.05)
        return real_encode(*a, **k)

    def slow(real: Any) -> Any:
        def undo(*a: Any, **k: Any) -> Any:
            undoing.set()
            time.sleep(0.3)
            try:
                return real(*a, **k)
            finally:
                undone.set()

        return undo

    async with Publisher(root, keyframe_interval=0) as pub:
        await pub.seed(sd0)
        monkeypatch.setattr("asyncsync.publish.publisher.encode_bucket", slow_encode)
        if during == "the snapshot's revert":
            monkeypatch.setattr(snapshot.UndoLog, "revert", slow(real_revert))
        else:
            real_remove = fsio.remove_tree
            monkeypatch.setattr(fsio, "remove_tree", slow(real_remove))
        task = asyncio.create_task(pub.publish(sd1))
        await asyncio.to_thread(started.wait, 10)
        task.cancel()
        assert await asyncio.to_thread(undoing.wait, 10)
        task.cancel()  # again, while it undoes
        with pytest.raises(asyncio.CancelledError):
            await task
        assert undone.is_set()
        assert list_versions(root) == [0] and not (root / "v000000000001").exists()
        monkeypatch.undo()
        assert (await pub.publish(sd2)).version == 1
        assert (await pub.publish(sd3)).version == 2
    from receiver import ReceiverAgent
    from receiver.engines.checkpoint import LocalCheckpoint

    ckpt = LocalCheckpoint(tmp_path / "ckpt")
    async with ReceiverAgent(root, ckpt, "e", use_inotify=False) as agent:
        assert await agent.sync_once() == 2
    held = ckpt.load_state_dict()
    assert all(same_bytes(held[k], v) for k, v in sd3.items())


async def test_leftovers_of_a_crashed_publisher_are_removed(tmp_path: Path) -> None:
    async with Publisher(tmp_path) as pub:
        await pub.seed(mixed_state(0))
    (tmp_path / "v000000000001").mkdir()
    (tmp_path / "v000000000001" / "delta-00000.safetensors").write_bytes(b"partial")
    (tmp_path / ".tmp.log.jsonl.abc").write_bytes(b"x")
    async with Publisher(tmp_path) as pub:
        assert pub.version == 0
        assert not (tmp_path / "v000000000001").exists()
        assert not (tmp_path / ".tmp.log.jsonl.abc").exists()
        with pytest.raises(PublishError, match="seed"):
            await pub.publish(mixed_state(0))


async def test_hooks_sync_and_async_see_durable_shards(tmp_path: Path) -> None:
    seen: list[tuple[str, list[str]]] = []

    def sync_hook(vdir: Path) -> None:
        seen.append(("sync", sorted(os.listdir(vdir))))

    async def async_hook(vdir: Path) -> None:
        await asyncio.sleep(0)
        seen.append(("async", sorted(os.listdir(vdir))))

    sd = mixed_state(0)
    async with Publisher(tmp_path / "a", pre_commit_hook=sync_hook) as pub:
        await pub.seed(sd)
    async with Publisher(tmp_path / "b", pre_commit_hook=async_hook) as pub:
        await pub.seed(sd)
    assert [s[0] for s in seen] == ["sync", "async"]
    for _, files in seen:
        assert (
            MANIFEST_NAME not in files and files and all(f.endswith(".safetensors") for f in files)
        )


async def test_seed_registers_existing_checkpoint_without_rewriting(tmp_path: Path) -> None:
    ckpt = tmp_path / "hf"
    ckpt.mkdir()
    sd = {k: v.contiguous() for k, v in mixed_state(0).items()}
    names = list(sd)
    safetensors.torch.save_file(
        {k: sd[k] for k in names[:6]}, ckpt / "model-00001-of-00002.safetensors"
    )
    safetensors.torch.save_file(
        {k: sd[k] for k in names[6:]}, ckpt / "model-00002-of-00002.safetensors"
    )
    mtimes = {p.name: p.stat().st_mtime_ns for p in ckpt.iterdir()}
    root = tmp_path / "root"
    async with Publisher(root) as pub:
        r0 = await pub.seed(ckpt)
        assert r0.kind == "full" and r0.wire_bytes == 0
        r1 = await pub.publish(mutate(sd, 0.05, seed=3))
        assert r1.kind == "delta" and r1.changed > 0
    m0 = read_manifest(root, 0)
    assert m0.shard_dir == str(ckpt.resolve())
    assert sorted(s.file for s in m0.shards) == sorted(mtimes)
    assert os.listdir(root / "v000000000000") == [MANIFEST_NAME]
    assert {p.name: p.stat().st_mtime_ns for p in ckpt.iterdir()} == mtimes


async def test_statistics_and_repr(tmp_path: Path) -> None:
    sd = mixed_state(0)
    async with Publisher(tmp_path, keyframe_interval=0) as pub:
        await pub.seed(sd)
        await pub.publish(mutate(sd, 0.03, seed=1))
        await pub.publish(mutate(sd, 0.03, seed=1))  # same as before: zero diff
        st = pub.statistics()
        assert (st.published, st.keyframes, st.zero_diff, st.last_version) == (3, 1, 1, 2)
        assert st.last is not None and st.last.zero_diff
        assert "version=2" in repr(pub)
    log = read_log(tmp_path)
    assert [r["kind"] for r in log] == ["full", "delta", "delta"]
    assert json.loads((tmp_path / "asyncsync.json").read_text())["run_id"] == st.run_id


async def test_wait_acked(tmp_path: Path) -> None:
    async with Publisher(tmp_path) as pub:
        r = await pub.seed(mixed_state(0))
        acks_mod.write_ack(tmp_path, "e1", r.version, "ab" * 16, pub.run_id)
        got = await pub.wait_acked(r.version, engines=["e1"], timeout=5)
        assert got["e1"].version == 0
        assert len(await pub.wait_acked(0, quorum=1, timeout=5)) == 1
        with pytest.raises(AckTimeout) as ei:
            await pub.wait_acked(0, engines=["e1", "e2"], timeout=0.2)
        assert ei.value.behind == {"e2": None}
        assert "e2 at no ack" in str(ei.value)
        with pytest.raises(AckTimeout, match="e1 at 0"):
            await pub.wait_acked(1, engines=["e1"], timeout=0.2)
        with pytest.raises(ConfigError):
            await pub.wait_acked(0)

        async def late_ack() -> None:
            await asyncio.sleep(0.2)
            acks_mod.write_ack(tmp_path, "e2", 0, "ab" * 16, pub.run_id)

        t = asyncio.create_task(late_ack())
        assert set(await pub.wait_acked(0, engines=["e1", "e2"], timeout=5)) == {"e1", "e2"}
        await t


async def test_an_ack_of_another_run_is_named_as_such_not_as_behind(tmp_path: Path) -> None:
    """An engine whose ack names version 99 of another run (a receiver still on an earlier run
    of the root) does not satisfy the wait; the timeout said 'behind: e0 at 99' while waiting
    for version 1, a version lower than the one it named."""
    async with Publisher(tmp_path) as pub:
        r = await pub.seed(mixed_state(0))
        acks_mod.write_ack(tmp_path, "e0", 99, "ab" * 16, "deadbeefdeadbeef")
        for kw in ({"engines": ["e0"]}, {"quorum": 1}):
            with pytest.raises(AckTimeout) as ei:
                await pub.wait_acked(r.version, timeout=0.2, **kw)  # type: ignore[arg-type]
            assert "e0 at 99 of another run (deadbeefdeadbeef; this root is on run " in str(
                ei.value
            ), ei.value
            assert ei.value.behind == {"e0": 99}


async def test_a_wait_reads_only_the_acks_it_still_waits_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``acks/`` holds every engine's ack: a wait for some of them read and parsed all of them
    at each poll (at 1,000 engines ~85 ms of CPU a poll, as many opens on a network
    filesystem). Now the named engines' files only, and of those the ones not yet seen holding
    the version."""
    async with Publisher(tmp_path) as pub:
        await pub.seed(mixed_state(0))
        for i in range(20):
            acks_mod.write_ack(tmp_path, f"other{i}", 0, "ab" * 16, pub.run_id)
        acks_mod.write_ack(tmp_path, "e1", 0, "ab" * 16, pub.run_id)
        reads: list[str] = []
        real = acks_mod._read

        def counted(root: Path, path: Path) -> acks_mod.AckRecord:
            reads.append(path.name)
            return real(root, path)

        monkeypatch.setattr(acks_mod, "_read", counted)

        async def late_ack_of(engine: str, version: int = 1) -> None:
            await asyncio.sleep(0.3)
            acks_mod.write_ack(tmp_path, engine, version, "ab" * 16, pub.run_id)

        t = asyncio.create_task(late_ack_of("e2", 0))
        got = await pub.wait_acked(0, engines=["e1", "e2", "e1"], timeout=5)
        await t
        acks_mod.write_ack(tmp_path, "e1", 1, "ab" * 16, pub.run_id)
    assert set(got) == {"e1", "e2"} and got["e2"].version == 0
    assert set(reads) == {"e1.json", "e2.json"}
    assert reads.count("e1.json") == 1 and reads.count("e2.json") >= 3
    reads.clear()  # a quorum lists them all, and reads each until it is seen holding it
    t = asyncio.create_task(late_ack_of("e3"))
    got = await acks_mod.wait_acked(tmp_path, 1, quorum=2, timeout=5)
    await t
    assert set(got) == {"e1", "e3"} and all(reads.count(n) == 1 for n in ("e1.json", "e3.json"))
    assert reads.count("other0.json") >= 3  # (at version 0: read at every poll)


async def test_full_mode_publishes_complete_checkpoints(tmp_path: Path) -> None:
    sd = mixed_state(0)
    async with Publisher(tmp_path, mode="full") as pub:
        r1 = await pub.publish(sd)  # no seed needed
        r2 = await pub.publish(mutate(sd, 0.01, seed=1))
        assert pub._base.tensors in (None, {})  # keeps no model copy
    for r in (r1, r2):
        m = read_manifest(tmp_path, r.version)
        assert (m.kind, m.base_version) == ("full", None)
        assert all(e.full is not None and e.delta is None for e in m.tensors)
    with pytest.raises(ConfigError, match="mode"):
        Publisher(tmp_path, mode="sparse")  # type: ignore[arg-type]


async def test_progress_reports_buckets_of_the_publish_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sd = mixed_state(0, scale=4)
    seen: list[tuple[str, int, int]] = []
    async with Publisher(tmp_path, bucket_bytes=2048) as pub:
        assert pub.progress is None
        real = shards.encode_bucket

        def slow(*a: object, **k: object) -> shards.EncodedBucket:
            import time

            time.sleep(0.01)
            return real(*a, **k)  # type: ignore[arg-type]

        monkeypatch.setattr("asyncsync.publish.publisher.encode_bucket", slow)
        task = asyncio.create_task(pub.seed(sd))
        while not task.done():
            if pub.progress is not None:
                seen.append(pub.progress)
            await asyncio.sleep(0.005)
        r = await task
        assert pub.progress is None
    assert seen and seen[0][0] == "publish v0 (full)"
    assert max(t for _, _, t in seen) == r.shards and any(0 < d < t for _, d, t in seen)


async def test_cancel_after_the_manifest_rename_keeps_the_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the manifest is renamed into place readers may have seen the version: a cancel
    that lands then must not delete it, and the publisher must treat it as committed."""
    import threading

    sd0 = mixed_state(0)
    sd1, sd2 = mutate(sd0, 0.05, seed=1), mutate(mutate(sd0, 0.05, seed=1), 0.05, seed=2)
    renamed = threading.Event()
    release = threading.Event()
    real = fsio.atomic_write

    def slow_after_rename(path: Path, data: bytes, **kw: object) -> int:
        n = real(path, data, **kw)  # type: ignore[arg-type]
        if path.name == MANIFEST_NAME and path.parent.name == "v000000000001":
            renamed.set()
            release.wait(5)
        return n

    async with Publisher(tmp_path, keyframe_interval=0) as pub:
        await pub.seed(sd0)
        monkeypatch.setattr("asyncsync.publish.commit.atomic_write", slow_after_rename)
        task = asyncio.create_task(pub.publish(sd1))
        await asyncio.to_thread(renamed.wait, 5)
        task.cancel()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert list_versions(tmp_path) == [0, 1]  # still there
        assert pub.version == 1
        r = await pub.publish(sd2)  # diffs against v1, not v0
        assert (r.version, r.base_version) == (2, 1)
    # the chain v0 -> v1 -> v2 replays to exactly sd2
    from receiver import ReceiverAgent
    from receiver.engines.checkpoint import LocalCheckpoint

    ckpt = LocalCheckpoint(tmp_path.parent / f"{tmp_path.name}-ckpt")
    async with ReceiverAgent(tmp_path, ckpt, "e", use_inotify=False) as agent:
        assert await agent.sync_once() == 2
        held = ckpt.load_state_dict()
    for k, v in sd2.items():
        assert same_bytes(held[k], v), k


async def test_a_second_cancel_while_it_checks_the_rename_keeps_the_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cancel during the manifest's write waits for it, then looks whether the rename took
    place. A second cancel during that look came out at once: v1 committed in the root, the
    publisher still at v0, and every later publish failed ("version 1 is already committed")
    until it was reopened and seeded again. The look now ends whatever comes meanwhile."""
    import threading
    import time

    from asyncsync import fsio

    sd0 = mixed_state(0)
    sd1, sd2 = mutate(sd0, 0.05, seed=1), mutate(mutate(sd0, 0.05, seed=1), 0.05, seed=2)
    writing, looking = threading.Event(), threading.Event()
    real_write, real_lstat = fsio.atomic_write, fsio.lstat

    def slow_write(path: Path, data: bytes, **kw: Any) -> int:
        n = real_write(path, data, **kw)
        if path.name == MANIFEST_NAME and path.parent.name == "v000000000001":
            writing.set()
            time.sleep(0.3)  # renamed; the first cancel comes now
        return n

    def slow_lstat(path: Any, **kw: Any) -> Any:
        if writing.is_set() and Path(path).name == MANIFEST_NAME:
            looking.set()
            time.sleep(0.3)  # the second cancel comes now
        return real_lstat(path, **kw)

    async with Publisher(tmp_path, keyframe_interval=0) as pub:
        await pub.seed(sd0)
        monkeypatch.setattr("asyncsync.publish.commit.atomic_write", slow_write)
        monkeypatch.setattr(fsio, "lstat", slow_lstat)
        task = asyncio.create_task(pub.publish(sd1))
        assert await asyncio.to_thread(writing.wait, 10)
        task.cancel()
        assert await asyncio.to_thread(looking.wait, 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        monkeypatch.undo()
        assert list_versions(tmp_path) == [0, 1]
        assert pub.version == 1
        r = await pub.publish(sd2)
        assert (r.version, r.base_version) == (2, 1)
    from receiver import ReceiverAgent
    from receiver.engines.checkpoint import LocalCheckpoint

    ckpt = LocalCheckpoint(tmp_path.parent / f"{tmp_path.name}-ckpt")
    async with ReceiverAgent(tmp_path, ckpt, "e", use_inotify=False) as agent:
        assert await agent.sync_once() == 2
    held = ckpt.load_state_dict()
    assert all(same_bytes(held[k], v) for k, v in sd2.items())


@pytest.mark.parametrize("ranked", [False, True])
async def test_a_cancel_as_the_commit_ends_keeps_the_publisher_at_the_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ranked: bool
) -> None:
    """The caller's cancel lands after the round's end (commit, clean-up) has returned but
    before the publish has taken its result (one turn of the loop: a timeout, a failing
    sibling task). The version is committed: the cancel must wait for the bookkeeping. It
    was raised at once, the publisher left at the version before, so every later publish
    tried to rewrite the committed version ("already committed") until it was reopened and
    seeded again; a group of ranks stuck that way for good."""
    from asyncsync import FileRendezvous
    from asyncsync.publish import ranked as ranked_mod
    from receiver import ReceiverAgent
    from receiver.engines.checkpoint import LocalCheckpoint

    root = tmp_path / "root"
    sd0 = mixed_state(0)
    sd1 = mutate(sd0, 0.05, seed=1)
    sd2 = mutate(sd1, 0.05, seed=2)
    cls = ranked_mod.RankedCommitter if ranked else ranked_mod.SoloCommitter
    real, task = cls.finish, []

    async def finish(self: Any, *a: Any, **k: Any) -> Any:
        m = await real(self, *a, **k)
        if task:  # the cancel comes once this has returned, before the publish resumes
            loop = asyncio.get_running_loop()
            loop.call_soon(loop.call_soon, task[0].cancel)
        return m

    coord = FileRendezvous(root, 0, 1, timeout=10, poll_interval=0.002) if ranked else None
    async with Publisher(root, keyframe_interval=0, coordinator=coord) as pub:
        await pub.seed(sd0)
        monkeypatch.setattr(cls, "finish", finish)
        task.append(asyncio.ensure_future(pub.publish(sd1)))
        with pytest.raises(asyncio.CancelledError):
            await task[0]
        assert list_versions(root) == [0, 1] and pub.version == 1
        task.clear()
        r = await pub.publish(sd2)
        assert (r.version, r.kind, r.base_version) == (2, "delta", 1)
    ckpt = LocalCheckpoint(tmp_path / "ckpt")
    async with ReceiverAgent(root, ckpt, "e", use_inotify=False) as agent:
        assert await agent.sync_once() == 2
    held = ckpt.load_state_dict()
    assert all(same_bytes(held[k], v) for k, v in sd2.items())


async def test_directory_fsync_failure_after_the_rename_is_not_a_failed_publish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = {"n": 0}
    real = fsio.fsync_dir

    def flaky(path: Path, **kw: object) -> None:
        calls["n"] += 1
        if calls["n"] == 3:  # vdir, root, then the version dir after the manifest rename
            raise OSError(5, "Input/output error (injected)")
        real(path, **kw)  # type: ignore[arg-type]

    sd = mixed_state(0)
    async with Publisher(tmp_path, keyframe_interval=0) as pub:
        await pub.seed(sd)
        monkeypatch.setattr("asyncsync.publish.commit.fsync_dir", flaky)
        r = await pub.publish(mutate(sd, 0.05, seed=1))
    assert r.version == 1 and list_versions(tmp_path) == [0, 1] and calls["n"] == 3


async def test_bad_roots_raise_our_errors(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(ConfigError, match="cannot open the root"):
        async with Publisher(tmp_path / "file"):
            pass
    async with Publisher(tmp_path / "root") as pub:
        await pub.seed(mixed_state(0))
        (pub.root / "acks").write_text("a file where the acks directory should be")
        with pytest.raises(AckTimeout):
            await pub.wait_acked(0, engines=["e"], timeout=0.1)


async def test_a_foreign_folder_is_not_turned_into_a_root(tmp_path: Path) -> None:
    """A typo'd root naming someone's folder became a root (asyncsync.json, v0, log.jsonl
    among their files); now refused, nothing written. A root's own acks/ and leases/ (made
    by `asyncsync prepare` before the first publish) and dot files are not foreign."""
    home = tmp_path / "home"
    (home / "data").mkdir(parents=True)
    (home / "notes.txt").write_text("mine\n")
    before = sorted(os.listdir(home))
    with pytest.raises(ConfigError, match=r"not an asyncsync root and is not empty \(it holds "
                       r"data, notes.txt\)"):  # fmt: skip
        async with Publisher(home):
            pass
    assert sorted(n for n in os.listdir(home) if not n.startswith(".")) == before
    with pytest.raises(ConfigError, match="not an asyncsync root"):  # the lock was released
        async with Publisher(home):
            pass
    prepared = tmp_path / "prepared"
    for name in ("acks", "leases", ".hidden"):
        (prepared / name).mkdir(parents=True)
    async with Publisher(prepared) as pub:
        await pub.seed(mixed_state(0))
    async with Publisher(prepared) as pub:  # a root now, with versions: reopened as before
        assert pub.version == 0


def test_delta_packer_fills_shards_in_order() -> None:
    def blobs(*sizes: int) -> dict[str, bytes]:
        return {f"k{s}.{i}": bytes(s) for i, s in enumerate(sizes)}

    p = shards.DeltaPacker(100)
    assert p.add(blobs(30)) == [] and p.add({}) == []
    assert p.add(blobs(40)) == [] and p.nbytes == 70
    done = p.add(blobs(50))  # would pass the limit: the first two buckets go out first
    assert [sorted(g) for g in done] == [["k30.0", "k40.0"]] and p.nbytes == 50
    done = p.add(blobs(20, 30))  # reaches the limit exactly: out at once
    assert [sorted(g) for g in done] == [["k20.0", "k30.1", "k50.0"]] and p.take() == {}
    done = p.add(blobs(300))  # larger than the limit: a shard of its own
    assert [list(g) for g in done] == [["k300.0"]]


async def test_sparse_deltas_share_shards_and_full_shards_keep_buckets(tmp_path: Path) -> None:
    """Buckets are cut by model bytes; delta shards by encoded bytes, so a sparse delta is
    a few files, and every tensor's entry names the shard that holds its blobs."""
    sd0 = mixed_state(0, scale=4)
    async with Publisher(tmp_path, bucket_bytes=8192, keyframe_interval=3) as pub:
        await pub.seed(sd0)
        sd1 = mutate(sd0, 0.01, seed=1)
        r1 = await pub.publish(sd1)
        sd2 = mutate(sd1, 0.01, seed=2)
        await pub.publish(sd2)
        r3 = await pub.publish(mutate(sd2, 0.01, seed=3))  # a keyframe
    m1, m3 = read_manifest(tmp_path, 1), read_manifest(tmp_path, 3)
    nbuckets = len(read_manifest(tmp_path, 0).shards)  # full shards: one per bucket
    assert nbuckets > 4 and m3.is_keyframe and m3.has_delta and r3.kind == "full"
    assert r1.shards == len(m1.shards) < nbuckets / 2
    assert sum(s.role == "full" for s in m3.shards) == nbuckets
    assert 0 < sum(s.role == "delta" for s in m3.shards) < nbuckets / 2
    for m in (m1, m3):
        for s in m.shards:
            if s.role == "delta":
                assert s.bytes < 2 * 8192
        held: dict[int, set[str]] = {}
        for i, s in enumerate(m.shards):
            if s.role == "delta":
                path = tmp_path / f"v{m.version:012d}" / s.file
                with safetensors.safe_open(str(path), "pt") as f:
                    held[i] = set(f.keys())
        refs = [e.delta for e in m.tensors if e.delta is not None]
        assert refs and all({r.positions, r.values} <= held[r.shard] for r in refs)
        assert sorted(k for keys in held.values() for k in keys) == sorted(
            k for r in refs for k in (r.positions, r.values)
        )


@pytest.mark.parametrize("sizes", [[], [0], [5, 0, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9], [1000, 1]])
def test_delta_shard_blob_is_a_safetensors_file(sizes: list[int]) -> None:
    blobs = {f"t{i}.{'pos' if i % 2 else 'val'}": os.urandom(n) for i, n in enumerate(sizes)}
    data = shards.delta_shard_blob(blobs, version=7, run_id="ab" * 8)
    assert int.from_bytes(data[:8], "little") % 8 == 0  # header padded like safetensors' own
    loaded = safetensors.torch.load(data)
    assert {k: t.numpy().tobytes() for k, t in loaded.items()} == blobs
    assert all(t.dtype == torch.uint8 and t.dim() == 1 for t in loaded.values())
    got = shards.parse_shard(data, where="x", version=7, run_id="ab" * 8, role="delta")
    assert {k: t.numpy().tobytes() for k, t in got.items()} == blobs
    views = shards.parse_delta_shard(data, where="x", version=7, run_id="ab" * 8)
    assert {k: bytes(v) for k, v in views.items()} == blobs
    assert all(v.readonly for v in views.values())


_HEADER = (
    '{"__metadata__": {"asyncsync.role": "delta"}, '
    '"a": {"dtype": "U8", "shape": [10], "data_offsets": [0, 10]}}'
)


@pytest.mark.parametrize(
    "header",
    [
        _HEADER.encode("utf-16"),
        _HEADER.encode("utf-32"),
        b"\xef\xbb\xbf" + _HEADER.encode(),  # a UTF-8 byte order mark
        _HEADER.replace('"delta"}', '"delta", "x": NaN}').encode(),
        _HEADER.replace('"delta"}', '"delta", "x": 1}').encode(),  # metadata values are strings
        _HEADER.replace("[10]", "[1e1]").encode(),  # 1e1 == 10 in Python
        _HEADER.replace("[10]", "[" * 50_000 + "]" * 50_000).encode(),  # RecursionError
    ],
    ids=["utf16", "utf32", "bom", "NaN", "int-metadata", "shape-1e1", "nested"],
)
def test_parse_delta_shard_reads_the_header_as_safetensors_does(header: bytes) -> None:
    """helper-21: headers safetensors refuses were taken by the delta shard reader (json.loads
    guesses UTF-16/32, takes NaN; a float shape equals an int). Each is a FormatError now."""
    data = len(header).to_bytes(8, "little") + header + bytes(10)
    with pytest.raises(Exception):  # noqa: B017 (the reference: whatever safetensors raises)
        safetensors.torch.load(data)
    with pytest.raises(FormatError, match=r"header|1-D U8|metadata"):
        shards.parse_delta_shard(data, where="x")


def test_a_bad_positions_blob_names_its_bytes_not_a_memory_address() -> None:
    """helper-21: the decoder's error printed the repr of a memoryview of the shard ('<memory
    at 0x...>'), different at every try, so the agent logged the same failure at every retry."""
    blobs = {"t0.pos": b"\x09" + bytes(7), "t0.val": b""}
    data = shards.delta_shard_blob(blobs, version=1, run_id="ab" * 8)
    msgs = []
    for _ in range(2):
        views = shards.parse_delta_shard(data, where="x")
        with pytest.raises(FormatError) as ei:
            codec.decode_delta("xef", "sparse", views["t0.pos"], views["t0.val"],
                               changed=3, numel=1000, dtype=torch.int16)  # fmt: skip
        msgs.append(str(ei.value))
    assert msgs[0] == msgs[1] and "<memory" not in msgs[0] and "b'\\t'" in msgs[0]


def _with_header(data: bytes, edit: Any) -> bytes:
    """``data`` (a delta shard) with its JSON header edited by ``edit``, the blobs kept."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    edit(header)
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data[8 + n :]


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda h: h["t0.pos"].update(dtype="I8"), "not a 1-D U8"),
        (lambda h: h["t0.pos"].update(shape=[3]), "not a 1-D U8"),
        (lambda h: h["t0.pos"].update(shape=[[4]]), "not a 1-D U8"),
        (lambda h: h["t0.pos"].update(shape="4"), "not a 1-D U8"),
        (lambda h: h["t0.pos"].update(shape=None), "not a 1-D U8"),
        (lambda h: h["t0.pos"].update(shape=4), "not a 1-D U8"),
        (lambda h: h["t0.pos"].update(shape={"4": 4}), "not a 1-D U8"),
        (lambda h: h["t1.val"].update(data_offsets=[4, 5], shape=[True]), "not a 1-D U8"),
        (lambda h: h["t0.pos"].update(data_offsets=[True, 4]), "not a 1-D U8"),
        (lambda h: h["t0.pos"].update(data_offsets=[4, 0], shape=[-4]), "not a 1-D U8"),
        (lambda h: h["t0.pos"].update(data_offsets=[0, 4, 8]), "not a 1-D U8"),
        (lambda h: h.update({"t9.pos": 5}), "not a 1-D U8"),
        (lambda h: h["t1.val"].update(data_offsets=[5, 10], shape=[5]), "does not start"),
        (lambda h: h["t1.val"].update(data_offsets=[3, 8], shape=[5]), "does not start"),
        (lambda h: h.pop("t1.val"), "the blobs hold 4 bytes"),
        (lambda h: h["__metadata__"].update({"asyncsync.role": "full"}), "another version"),
        (lambda h: h["__metadata__"].update({"asyncsync.version": "8"}), "another version"),
    ],
)
def test_parse_delta_shard_refuses_a_malformed_header(edit: Any, match: str) -> None:
    """The delta shard reader takes the blobs as views of the bytes (no copy), so it checks
    what safetensors would: every entry a 1-D U8 tensor, the entries tiling the data exactly,
    the metadata naming this version, run and the delta role; anything else is FormatError."""
    blobs = {"t0.pos": b"abcd", "t1.val": b"efghi"}
    data = shards.delta_shard_blob(blobs, version=7, run_id="ab" * 8)
    bad = _with_header(data, edit)
    with pytest.raises(FormatError, match=match):
        shards.parse_delta_shard(bad, where="x", version=7, run_id="ab" * 8)
    with pytest.raises(FormatError, match="safetensors header length"):
        shards.parse_delta_shard(data[:8] + b"{", where="x")
    assert bytes(shards.parse_delta_shard(data + b"", where="x")["t1.val"]) == b"efghi"
    with pytest.raises(FormatError, match="the blobs hold 9 bytes"):
        shards.parse_delta_shard(data + b"x", where="x")


@pytest.mark.parametrize("name", ["__metadata__", "x" * 4097])
async def test_a_tensor_name_no_reader_takes_is_refused_at_publish(
    tmp_path: Path, name: str
) -> None:
    """Issue 22, finding 6: a tensor named ``__metadata__`` (the safetensors header's key) was
    published without error and broke every receiver; names readers refuse (FORMAT.md section
    3: 1 to 4096 characters, not ``__metadata__``) are refused at publish, nothing written."""
    async with Publisher(tmp_path) as pub:
        with pytest.raises(ConfigError, match=r"__metadata__|4096"):
            await pub.seed({"w": torch.zeros(4), name: torch.zeros(2)})
    assert list_versions(tmp_path) == []


async def test_a_registered_checkpoint_made_of_symlinks_is_read_through_them(
    tmp_path: Path,
) -> None:
    """FORMAT.md 11.5 (issue 22): a registered checkpoint (``shard_dir``) lies outside the root;
    a writer resolves a snapshot's symlinks (the manifest names the blobs), but one that did
    not left files that are symlinks there: readers follow them there, and only there (the
    file they reach must still be a regular file of the manifest's size and checksum). A
    checkpoint inside the root is refused (nothing in the root is followed)."""
    from receiver import ReceiverAgent
    from receiver.engines.checkpoint import LocalCheckpoint, verify_checkpoint

    sd = {k: v.contiguous() for k, v in mixed_state(0).items()}
    ckpt, elsewhere = tmp_path / "ckpt", tmp_path / "blobs"
    ckpt.mkdir()
    elsewhere.mkdir()
    safetensors.torch.save_file(sd, ckpt / "model.safetensors")
    root = tmp_path / "root"
    async with Publisher(root) as pub:
        await pub.seed(ckpt)
        inside = root / "ckpt"
        shutil.copytree(ckpt, inside)
        with pytest.raises(ConfigError, match="inside the root"):
            await pub.seed(inside)
    assert read_manifest(root, 0).shard_dir == str(ckpt.resolve())
    shutil.move(ckpt / "model.safetensors", elsewhere / "0f1e2d3c")
    (ckpt / "model.safetensors").symlink_to(elsewhere / "0f1e2d3c")
    agent = ReceiverAgent(root, LocalCheckpoint(tmp_path / "c"), "e1", use_inotify=False)
    async with agent:
        assert await agent.sync_once() == 0  # today's main: "shards may not be symlinks"
    assert verify_checkpoint(tmp_path / "c", read_manifest(root, 0)) == []


def _hf_cache_snapshot(cache: Path, sd: dict[str, torch.Tensor]) -> Path:
    """A Hugging Face cache layout: snapshots/<rev>/<file> are relative symlinks to blobs/."""
    repo = cache / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    names = sorted(sd)
    half = len(names) // 2
    weight_map = {}
    for k, part in enumerate((names[:half], names[half:]), 1):
        f = f"model-{k:05d}-of-00002.safetensors"
        blob = repo / "blobs" / f"{k:064x}"
        safetensors.torch.save_file({n: sd[n].contiguous() for n in part}, blob)
        (snap / f).symlink_to(Path("..") / ".." / "blobs" / blob.name)
        weight_map.update(dict.fromkeys(part, f))
    index = repo / "blobs" / f"{9:064x}"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (snap / "model.safetensors.index.json").symlink_to(Path("..") / ".." / "blobs" / index.name)
    return snap


async def test_seed_from_a_hugging_face_cache_snapshot_references_the_blobs(
    tmp_path: Path,
) -> None:
    """(issue 20, failure 3) A snapshot's files are symlinks, which receivers refuse as shards:
    the base version references the blobs they point to, and receivers sync it bit-exact."""
    from receiver import ReceiverAgent
    from receiver.engines.checkpoint import LocalCheckpoint
    from tests.conftest import same_bytes

    sd = mixed_state(0)
    snap = _hf_cache_snapshot(tmp_path / "hub", sd)
    root = tmp_path / "root"
    async with Publisher(root) as pub:
        await pub.seed(snap)
        sd2 = mutate(sd, 0.05, seed=1)
        await pub.publish(sd2)
    m = read_manifest(root, 0)
    assert m.shard_dir == str((tmp_path / "hub" / "models--org--tiny" / "blobs").resolve())
    agent = ReceiverAgent(root, LocalCheckpoint(tmp_path / "ck"), "e1", use_inotify=False)
    async with agent:
        assert await agent.sync_once() == 1
        held = agent.engine.load_state_dict()  # type: ignore[attr-defined]
    assert all(same_bytes(held[k], v) for k, v in sd2.items())


async def test_seed_from_a_checkpoint_missing_a_file_names_it_and_commits_nothing(
    tmp_path: Path,
) -> None:
    snap = _hf_cache_snapshot(tmp_path / "hub", mixed_state(0))
    next(p for p in snap.iterdir() if p.name.startswith("model-00002")).resolve().unlink()
    root = tmp_path / "root"
    async with Publisher(root) as pub:
        with pytest.raises(ConfigError, match=r"model-00002-of-00002.safetensors is named by the"):
            await pub.seed(snap)
    assert list_versions(root) == []


async def test_delta_shards_are_sized_by_the_last_delta(tmp_path: Path) -> None:
    """Default delta shards: ~1/8 of the last delta within [1 MiB, min(bucket, 4 MiB)] (the
    model's bytes / 512 before the first delta), so a version is several shards a receiver can
    apply while the rest are written; a given ``delta_shard_bytes`` stays fixed. (Shards are
    cut between buckets: 8 MiB buckets here, each ~1 MB of delta. The default size also cuts
    shard 0 alone and tapers the last shards: tests/test_plan.py.)"""
    mib = 1 << 20
    gen = torch.Generator().manual_seed(0)
    sd = {f"t{i}": torch.randn(65536, generator=gen) for i in range(512)}  # 128 MiB float32

    def step() -> None:  # 10 % of the elements of every tensor get new random values
        for t in sd.values():
            mask = torch.rand(t.shape, generator=gen) < 0.1
            t[mask] = torch.randn(int(mask.sum()), generator=gen)

    def shard_sizes(root: Path, version: int) -> list[int]:
        return [s.bytes for s in read_manifest(root, version).shards]

    auto = tmp_path / "auto"
    async with Publisher(auto, bucket_bytes=8 * mib, keyframe_interval=0) as pub:
        await pub.seed(sd)
        step()
        first = await pub.publish(sd)  # no delta yet: 128 MiB / 512 -> the 1 MiB floor
        step()
        second = await pub.publish(sd)  # ~1/8 of the first delta: ~2 MiB shards
        await pub.publish(sd)  # a zero diff (no shards): the next ones go back to the floor
        step()
        fourth = await pub.publish(sd)
    one, two, four = (shard_sizes(auto, r.version) for r in (first, second, fourth))
    assert sum(one) > 10 * mib and max(one) < 1.5 * mib and len(one) >= 12
    assert 6 <= len(two) <= 11 and max(two) > 1.5 * mib  # 8 + shard 0 and the tapered tail
    assert len(four) >= 12
    fixed = tmp_path / "fixed"
    async with Publisher(fixed, bucket_bytes=8 * mib, delta_shard_bytes=4 * mib) as p:
        await p.seed(sd)
        step()
        r = await p.publish(sd)
    assert len(shard_sizes(fixed, r.version)) <= 5


async def test_a_delta_reads_each_tensors_size_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The publisher reads each tensor's byte size once per version (its ``sizes``, which the
    plan takes) and sizes the shards and their taper from those: before the first delta the
    shard sizer summed the state's tensors three times more (``tapers`` twice, ``next`` once)."""
    publish_dir = Path(snapshot.__file__).parent
    reads: list[str] = []
    element_size = torch.Tensor.element_size

    def counted(t: torch.Tensor) -> int:
        where = Path(sys._getframe(1).f_code.co_filename)
        if where.parent == publish_dir:
            reads.append(where.name)
        return element_size(t)

    gen = torch.Generator().manual_seed(0)
    sd = {f"t{i}": torch.randn(4096, generator=gen) for i in range(24)}
    async with Publisher(tmp_path / "root", bucket_bytes=32 << 10) as pub:
        await pub.seed(sd)
        for t in sd.values():
            t[::5] += 1
        monkeypatch.setattr(torch.Tensor, "element_size", counted)
        first = await pub.publish(sd)  # the first delta: the model's bytes estimate the shards
        assert sorted(reads) == ["publisher.py"] * len(sd)
        reads.clear()
        for t in sd.values():
            t[1::5] += 1
        await pub.publish(sd)  # the last delta's bytes estimate them
        assert sorted(reads) == ["publisher.py"] * len(sd)
    assert len(read_manifest(tmp_path / "root", first.version).shards) >= 1
