"""Streaming apply (receiver/stream.py, FORMAT.md 8.1) over real FUSE mounts, with a real
``asyncsync-receiver`` process polling (a FUSE client sees no other host's writes through
inotify): what the mount itself does to a stream in flight. Mounts: tests/mounts.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncsync import Publisher
from asyncsync.format.store import read_manifest
from receiver.engines.checkpoint import verify_checkpoint
from tests.conftest import mixed_state, mutate, running
from tests.mounts import RCLONE_SETTLE, bindfs_mount, kill_rclone, rclone_mounts

REPO = Path(__file__).resolve().parent.parent
SHARD = 4096  # delta shard bytes: a version is several shards


def _state(i: int) -> dict[str, torch.Tensor]:
    sd = mixed_state(0, scale=16)
    return mutate(sd, 0.05, seed=i) if i else sd


def _engine(ckpt: Path) -> dict[str, object]:
    path = ckpt / ".asyncsync" / "state.json"
    return json.loads(path.read_text()) if path.exists() else {}


async def _until(cond: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"still waiting after {timeout}s for {what}"
        await asyncio.sleep(0.1)


async def _stop(task: asyncio.Task[object] | None) -> None:
    """Cancel a publish stalled in its hook (it holds the publisher until it ends)."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@dataclass
class Receiver:
    """A real receiver process (:func:`_receiving`); ``err`` its stderr once it has exited."""

    proc: subprocess.Popen[str]
    err: str = ""


@contextlib.contextmanager
def _receiving(
    root: Path, ckpt: Path, *extra: str, settle: float = RCLONE_SETTLE
) -> Iterator[Receiver]:
    """A receiver process polling ``root`` into the checkpoint ``ckpt``; SIGTERMed at the end,
    when it must exit with status 0 (unless the body failed)."""
    argv = [sys.executable, "-m", "receiver.cli", "--root", str(root), "--engine-id", "e1",
            "--checkpoint", str(ckpt), "--poll-interval", "0.2", "--force-polling",
            "--lease-settle", str(settle), "--verify-deadline", "1", *extra]  # fmt: skip
    r = Receiver(subprocess.Popen(argv, cwd=REPO, stderr=subprocess.PIPE, text=True))
    try:
        yield r
    finally:
        r.proc.send_signal(signal.SIGTERM)
        _, r.err = r.proc.communicate(timeout=120)
    assert r.proc.returncode == 0, r.err


@dataclass
class Streamed:
    """v2 held before its manifest, streamed by a receiver process (:func:`_v2_streamed`)."""

    receiver: Receiver
    publishing: asyncio.Task[object] | None = None

    async def stop_publishing(self) -> None:
        """The trainer dies: v2 is removed, never committed."""
        await _stop(self.publishing)
        self.publishing = None


@contextlib.asynccontextmanager
async def _v2_streamed(
    writer: Path, reader: Path, ckpt: Path, settle: float = RCLONE_SETTLE
) -> AsyncIterator[Streamed]:
    """v0 and v1 published through ``writer`` and applied by a receiver process reading
    ``reader``; then v2, its publish stalled before its manifest (the pre-commit hook) until
    the receiver streams it. At the end the receiver is stopped (status 0), then the stalled
    publish (it holds the publisher until it ends)."""
    held = asyncio.Event()

    async def hang(vdir: Path) -> None:  # the trainer stalls before v2's manifest
        held.set()
        await asyncio.Event().wait()

    async with Publisher(writer, bucket_bytes=SHARD, delta_shard_bytes=SHARD,
                         keyframe_interval=0) as pub:  # fmt: skip
        await pub.seed(_state(0))
        await pub.publish(_state(1))
        streamed: Streamed | None = None
        try:
            with _receiving(reader, ckpt, settle=settle) as child:
                streamed = Streamed(child)
                await _until(lambda: _engine(ckpt).get("version") == 1, "the receiver at v1")
                pub.pre_commit_hook = hang
                streamed.publishing = asyncio.create_task(pub.publish(_state(2)))
                await held.wait()
                await _until(lambda: _engine(ckpt).get("status") == "applying", "v2 streamed")
                yield streamed
        finally:
            if streamed is not None:
                await streamed.stop_publishing()


async def test_a_stream_cut_by_a_dead_mount_is_rolled_back(tmp_path: Path) -> None:
    """The receiver's rclone daemon dies while it streams v2 (every access: ENOTCONN) and the
    trainer never commits v2. The stream must roll the checkpoint back to v1: it ended as if
    v2's manifest had come (the failed look at it), leaving the transaction open with no one
    to close it: the checkpoint held half of v2 for good, after the mount was back too."""
    src = tmp_path / "src"
    with rclone_mounts(src, tmp_path / "a", tmp_path / "b") as (a, b):
        ckpt = tmp_path / "ckpt"
        async with _v2_streamed(a, b, ckpt) as v2:
            kill_rclone(b)  # the receiver's mount dies under the stream
            await _until(lambda: _engine(ckpt).get("status") == "clean", "the rollback")
            assert _engine(ckpt)["version"] == 1
            assert verify_checkpoint(ckpt, read_manifest(src, 1)) == []  # v1, bit for bit
            assert v2.receiver.proc.poll() is None
    assert "Transport endpoint is not connected" in v2.receiver.err  # said, in one line


async def test_a_manifest_that_shows_and_goes_again_rolls_the_stream_back(tmp_path: Path) -> None:
    """A ``manifest.json`` shows in the streamed version's directory and goes again (a writer
    that put a wrong one there and took it back; a mount's cache), the trainer stalled before
    its commit. The stream ended at the sight of it; the sync found no committed v2 and took
    nothing: the transaction stayed open for good, the checkpoint half v2, and nothing said
    so (a trainer that died then left it so). It must be rolled back at once (the stream then
    starts again: v2 is still being written)."""
    with bindfs_mount(tmp_path / "src", tmp_path / "fuse") as root:
        ckpt = tmp_path / "ckpt"
        async with _v2_streamed(root, root, ckpt, settle=0.5) as v2:
            ghost = root / "v000000000002" / "manifest.json"
            ghost.write_text("{")  # does not parse: the sync re-reads it for 1 s
            await asyncio.sleep(0.5)  # the stream polls every 0.1 s at most: it saw it
            ghost.unlink()
            await asyncio.sleep(2)  # a sync or two: they find no v2 committed
            await v2.stop_publishing()  # the trainer dies: v2 removed before its manifest
            await _until(lambda: _engine(ckpt).get("status") == "clean", "the rollback")
            assert _engine(ckpt)["version"] == 1
            assert verify_checkpoint(ckpt, read_manifest(root, 1)) == []  # v1, bit for bit
    assert "its manifest was seen but is gone" in v2.receiver.err


async def test_a_receiver_started_before_the_root_record_shows_waits_for_it(
    tmp_path: Path,
) -> None:
    """rclone makes a directory in its backend at once but uploads a file only after its
    write-back delay: another mount shows the trainer's version directories before its
    ``asyncsync.json`` and manifests. A receiver started then called the root "not an asyncsync
    root" and exited (status 1): it must wait, as for a root its publisher has not opened."""
    src = tmp_path / "src"
    slow = ("--vfs-cache-mode", "writes", "--dir-cache-time", "1s", "--vfs-write-back", "10s")
    with (
        rclone_mounts(src, tmp_path / "a", flags=slow) as (a,),
        rclone_mounts(src, tmp_path / "b") as (b,),
    ):
        ckpt = tmp_path / "ckpt"
        async with Publisher(a, bucket_bytes=SHARD, keyframe_interval=0) as pub:
            await pub.seed(_state(0))
            await _until(lambda: (b / "v000000000000").is_dir(), "v0's directory through b")
            assert not (b / "asyncsync.json").exists()  # the premise: its upload is pending
            with _receiving(b, ckpt) as child:
                await _until(
                    lambda: child.proc.poll() is not None or _engine(ckpt).get("version") == 0,
                    "the receiver at v0",
                )
                assert child.proc.poll() is None
                assert verify_checkpoint(ckpt, read_manifest(src, 0)) == []


_TRAINER = """
import asyncio, sys
from asyncsync import Publisher
from tests.test_stream_mounts import SHARD, _state

async def held(vdir):  # v2's shards are written: wait for the test before the manifest
    print("held", flush=True)
    sys.stdin.readline()

async def main():
    async with Publisher(sys.argv[1], bucket_bytes=SHARD, delta_shard_bytes=SHARD,
                         keyframe_interval=0) as pub:
        await pub.seed(_state(0))
        await pub.publish(_state(1))
        pub.pre_commit_hook = held
        await pub.publish(_state(2))
    print("committed", flush=True)

asyncio.run(main())
"""


async def test_a_trainer_stopped_past_the_stream_timeout_is_rolled_back_then_applied(
    tmp_path: Path,
) -> None:
    """The trainer is SIGSTOPped after v2's shards, before its manifest, for longer than the
    receiver's ``--stream-timeout``: the receiver rolls the checkpoint back to v1 (bit for bit)
    meanwhile, and applies v2 once the trainer, resumed, commits it. (The option was not on
    the command line: a receiver process waited 120 s with the checkpoint half v2.)"""
    src = tmp_path / "src"
    with rclone_mounts(src, tmp_path / "a", tmp_path / "b") as (a, b):
        ckpt = tmp_path / "ckpt"
        trainer = subprocess.Popen(
            [sys.executable, "-c", _TRAINER, str(a)], cwd=REPO, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )  # fmt: skip
        assert trainer.stdin is not None and trainer.stdout is not None
        try:
            with _receiving(b, ckpt, "--stream-timeout", "3") as child:
                assert trainer.stdout.readline().strip() == "held"
                await _until(lambda: _engine(ckpt).get("target_version") == 2, "v2 streamed")
                trainer.send_signal(signal.SIGSTOP)
                await _until(lambda: _engine(ckpt).get("status") == "clean", "the rollback")
                assert _engine(ckpt)["version"] == 1
                assert verify_checkpoint(ckpt, read_manifest(src, 1)) == []  # v1, bit for bit
                trainer.send_signal(signal.SIGCONT)
                trainer.stdin.write("go\n")
                trainer.stdin.flush()
                assert trainer.stdout.readline().strip() == "committed"
                await _until(lambda: _engine(ckpt).get("version") == 2, "the receiver at v2")
                assert verify_checkpoint(ckpt, read_manifest(src, 2)) == []
        finally:
            trainer.send_signal(signal.SIGCONT)
            trainer.communicate("go\n", timeout=120)
    assert "no shard nor manifest of v2 for 3s" in child.err


def _peak_rss(pid: int) -> int:
    """The highest resident memory of process ``pid`` so far (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmHWM")


async def test_a_huge_file_in_the_next_shards_place_is_not_read_into_memory(
    tmp_path: Path,
) -> None:
    """A writer puts a 2 GiB sparse file where the next shard of the streamed version goes: no
    manifest names its size yet, and the stream read it whole (a limit of 1 TiB), again at
    each re-read, in a receiver of a model of under 2 MiB. It is refused from its size."""
    with bindfs_mount(tmp_path / "src", tmp_path / "fuse") as root:
        ckpt = tmp_path / "ckpt"
        async with _v2_streamed(root, root, ckpt, settle=0.5) as v2:
            vdir = root / "v000000000002"
            n = len(list(vdir.glob("delta-*.safetensors")))  # every shard of v2 is written
            with open(vdir / f"delta-{n:05d}.safetensors", "wb") as f:
                f.truncate(2 << 30)  # sparse: no disk, 2 GiB to whoever reads it
            await _until(lambda: _engine(ckpt).get("status") == "clean", "the rollback")
            assert verify_checkpoint(ckpt, read_manifest(root, 1)) == []
            assert _peak_rss(v2.receiver.proc.pid) < 1 << 30
    assert f"delta-{n:05d}.safetensors is larger than" in v2.receiver.err  # one line names it


async def test_a_flapping_mount_costs_a_bounded_number_of_rollbacks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The receiver reads the root through a bindfs mount that goes and comes back again and
    again (a stale NFS/FUSE mount) while v2 is streamed, before its manifest (here in the
    process, to count the streams): each time the version's directory is gone the stream rolls
    back, and each time it shows again v2 was streamed again: one rollback and one re-apply
    per flap, for as long as it flapped. Now a version is streamed again at most
    ``MAX_RESTREAMS`` times, backed off; then it waits for its manifest, and applies."""
    import logging

    from receiver import ReceiverAgent, early
    from receiver.engines.checkpoint import LocalCheckpoint
    from receiver.stream import StreamApplier
    from tests.mounts import come_back, go_stale

    starts: list[StreamApplier] = []
    real = early.early_reader

    async def counted(*args: Any, **kw: Any) -> Any:
        r = await real(*args, **kw)
        if isinstance(r, StreamApplier) and r.version == 2:
            starts.append(r)
        return r

    monkeypatch.setattr(early, "early_reader", counted)
    caplog.set_level(logging.WARNING, logger="receiver.early")
    src, fuse = tmp_path / "src", tmp_path / "fuse"
    with bindfs_mount(src, fuse) as root:
        engine = LocalCheckpoint(tmp_path / "ckpt")
        agent = ReceiverAgent(root, engine, "e1", use_inotify=False, poll_interval=0.02)

        def capped() -> bool:
            return "it is applied after its manifest" in caplog.text

        async def flap(vdir: Path) -> None:
            n = 0  # the streams of v2 seen (the first may start before this hook)
            for _ in range(early.MAX_RESTREAMS + 3):
                await _until(lambda n=n: capped() or (len(starts) > n and starts[-1].txn_open),  # type: ignore[misc]
                             "v2 streamed (again)")  # fmt: skip
                if capped():
                    return
                s, n = starts[-1], len(starts)
                go_stale(fuse, tmp_path / "empty")  # the mount goes stale...
                await _until(lambda s=s: bool(s.failed) and not s.txn_open, "the rollback")  # type: ignore[misc]
                come_back(fuse)  # ...and comes back
            pytest.fail("v2 was streamed again at every flap")

        async with Publisher(src, bucket_bytes=SHARD, delta_shard_bytes=SHARD,
                             keyframe_interval=0) as pub:  # fmt: skip
            await pub.seed(_state(0))
            await pub.publish(_state(1))
            async with running(agent, 1):
                pub.pre_commit_hook = flap
                await pub.publish(_state(2))
                await _until(lambda: agent.version == 2, "the receiver at v2")
        assert len(starts) == 1 + early.MAX_RESTREAMS
        assert verify_checkpoint(tmp_path / "ckpt", read_manifest(src, 2)) == []
