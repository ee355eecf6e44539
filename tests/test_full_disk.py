"""A full disk under a receiver's checkpoint or the publisher's root, on real filesystems.

* The undo record of a delta fills the checkpoint's disk: the rollback must not need the space
  the record took, and the receiver goes on once space is back, without a restart (it stayed
  "rollback failed; close and reopen it" for good).
* A rollback that fails all the same (any error) is done again at the next version.
* A full copy-on-write filesystem (btrfs): every overwrite through the mapping needs new space,
  and a write fault that cannot get it is SIGBUS. The receiver was killed mid-patch; the
  checkpoint's files are no-copy-on-write now, and a delta applies on a full btrfs.
* A log line appended to a full root was cut short and glued to the next line (both lost).

The mounts need root (and, for btrfs, a loop device and btrfs-progs); each test skips with the
reason otherwise and unmounts what it mounted.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncsync import Publisher
from asyncsync.errors import ApplyFailed, ConfigError
from asyncsync.format.log import read_log
from asyncsync.format.store import read_manifest
from receiver import ReceiverAgent
from receiver.engines.checkpoint import LocalCheckpoint, inplace, verify_checkpoint
from receiver.state import StateStore
from tests.conftest import mixed_state
from tests.mounts import btrfs, fill, tmpfs

REPO = Path(__file__).resolve().parent.parent


def _model(mib: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """8 bf16 tensors of ``mib`` MiB in all."""
    g = torch.Generator().manual_seed(seed)
    n = (mib << 20) // 2 // 8
    return {f"layer.{i}.weight": torch.randn(n, generator=g).to(torch.bfloat16) for i in range(8)}


def _step(sd: dict[str, torch.Tensor], density: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, t in sd.items():
        t = t.clone()
        mask = torch.rand(t.numel(), generator=g) < density
        t[mask] = (t[mask].float() + 0.5).to(torch.bfloat16)
        out[k] = t
    return out


def _acked(root: Path, engine_id: str) -> int | None:
    path = root / "acks" / f"{engine_id}.json"
    return json.loads(path.read_text())["version"] if path.exists() else None


def failing_patch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every delta's patch done, then EIO (the version rolled back)."""
    real_patch = inplace.journal_and_patch

    def patch_then_fail(*args: object, **kw: object) -> object:
        real_patch(*args, **kw)  # type: ignore[arg-type]
        raise OSError(errno.EIO, "injected after the patch")

    monkeypatch.setattr(inplace, "journal_and_patch", patch_then_fail)


def rollback_state_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's state saved, but for a clean one (a rollback's): EIO."""
    real_save = StateStore.save

    def save(store: StateStore, state: object, **kw: bool) -> object:
        if getattr(state, "status", None) == "clean":
            raise OSError(errno.EIO, "injected: state not saved")
        return real_save(store, state, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(StateStore, "save", save)


async def test_an_undo_record_filling_the_disk_rolls_back_and_the_receiver_goes_on(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    with tmpfs(tmp_path / "small", "12m") as mnt:
        sd = _model(8)
        async with Publisher(root, keyframe_interval=0) as pub:
            await pub.seed(sd)
            sd = _step(sd, 0.03, 1)
            await pub.publish(sd)
            agent = ReceiverAgent(root, LocalCheckpoint(mnt / "ck"), "e", use_inotify=False)
            async with agent:
                assert await agent.sync_once() == 1
                await agent.engine.flushed()  # type: ignore[attr-defined]
                nxt = _step(sd, 0.3, 2)  # a record ~10x v1's spare (whose room it reuses)
                await pub.publish(nxt)
                fill(mnt, 100_000)  # the record's header fits, its old values do not
                with pytest.raises(ApplyFailed, match="No space left") as failed:
                    await agent.sync_once()
                assert "undo-" in str(failed.value)  # the record the disk refused, named
                assert agent.version == 1 and _acked(root, "e") == 1
                assert verify_checkpoint(mnt / "ck", read_manifest(root, 1)) == []
                (mnt / "ballast").unlink()
                assert await agent.sync_once() == 2  # the same agent: no reopen
                assert _acked(root, "e") == 2
            assert verify_checkpoint(mnt / "ck", read_manifest(root, 2)) == []


async def test_a_rollback_that_failed_is_done_again_at_the_next_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, ck = tmp_path / "root", tmp_path / "ck"
    sd = _model(1)
    async with Publisher(root, keyframe_interval=0) as pub:
        await pub.seed(sd)
        agent = ReceiverAgent(root, LocalCheckpoint(ck), "e", use_inotify=False)
        async with agent:
            assert await agent.sync_once() == 0
            await pub.publish(_step(sd, 0.03, 1))
            failing_patch(monkeypatch)
            rollback_state_refused(monkeypatch)
            with pytest.raises(ApplyFailed, match="injected after the patch"):
                await agent.sync_once()
            monkeypatch.undo()
            assert agent.version == 0 and _acked(root, "e") == 0
            assert await agent.sync_once() == 1  # was: "rollback of v1 failed; close and reopen"
        assert verify_checkpoint(ck, read_manifest(root, 1)) == []


async def test_a_rollback_that_failed_is_done_again_when_nothing_newer_comes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rollback that failed was done again only at the next version's begin (or bump): with
    the failed version marked bad and nothing newer, state.json said ``applying`` until then.
    A sync with nothing newer (``reconcile``) does it again now."""
    from tests.test_engines import build_manifest, delta_batches, init_checkpoint

    sd0 = _model(1)
    ck = await init_checkpoint(tmp_path / "ck", sd0)
    sd1 = _step(sd0, 0.03, 1)
    m1 = build_manifest(sd1, 1, base=sd0)
    await ck.begin(m1, "delta")
    for b in delta_batches(m1, sd0, sd1):
        await ck.apply(b)
    with monkeypatch.context() as m:
        rollback_state_refused(m)
        with pytest.raises(ApplyFailed, match="injected: state not saved"):
            await ck.abort()
    state = ck.directory / ".asyncsync" / "state.json"
    assert json.loads(state.read_text())["status"] == "applying"
    await ck.reconcile()
    st = json.loads(state.read_text())
    assert (st["version"], st["status"]) == (0, "clean")  # was: "applying" until a newer begin
    assert not any((ck.directory / ".asyncsync" / "journal").iterdir())
    await ck.close()
    assert verify_checkpoint(ck.directory, build_manifest(sd0, 0)) == []


def _receive_once(root: Path, ck: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "receiver.cli", "--root", str(root), "--engine-id", "e",
         "--checkpoint", str(ck), "--once", "--log-level", "WARNING"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip


@pytest.mark.parametrize(
    ("density", "leave"), [(0.03, 6 << 20), (0.0002, 2 << 20)], ids=["most-pages", "sparse"]
)
async def test_a_full_btrfs_neither_stops_a_delta_nor_kills_the_receiver(
    tmp_path: Path, density: float, leave: int
) -> None:
    """On btrfs every overwrite through the mapping of a copy-on-write file needs new space; on
    a full disk the write fault was SIGBUS, mid-patch. The prefault now turns that into an
    error (``FileMaps.prefault``), which btrfs still races by writing pages back in between
    (SIGBUS 3 times in 10 runs); the checkpoint's directory is no-copy-on-write instead, so its
    files are overwritten in place and a delta applies on a full disk (its undo record fits)."""
    root = tmp_path / "root"
    with btrfs(tmp_path / "cow") as mnt:
        ck = mnt / "ck"
        sd = _model(16)
        async with Publisher(root, keyframe_interval=0) as pub:
            await pub.seed(sd)
            sd = _step(sd, 0.03, 1)
            await pub.publish(sd)
            assert _receive_once(root, ck).returncode == 0 and _acked(root, "e") == 1
            await pub.publish(_step(sd, density, 2))
        files = sorted(ck.glob("*.safetensors"))
        assert files and all(_nocow(p) for p in files)
        # room for the undo record, not for the pages a copy-on-write patch would copy
        fill(mnt, leave)
        r = _receive_once(root, ck)
        assert r.returncode == 0, (r.returncode, r.stderr[-2000:])  # was -7: SIGBUS
        assert _acked(root, "e") == 2
        assert verify_checkpoint(ck, read_manifest(root, 2)) == []


def _nocow(path: Path) -> bool:
    r = subprocess.run(["lsattr", "-d", str(path)], capture_output=True, text=True, check=True)
    return "C" in r.stdout.split()[0]


async def test_a_log_line_cut_short_by_a_full_root_is_taken_back(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "small", "2m") as mnt:
        root = mnt / "root"
        async with Publisher(root, keyframe_interval=0) as pub:
            await pub.seed({"w": torch.zeros(16)})
            log = root / "log.jsonl"
            for _ in range(40):  # zero-diff versions: a manifest and a log line each
                size, line = log.stat().st_size, len(log.read_bytes().splitlines()[-1]) + 1
                if size % 4096 + line > 4096:  # the next line needs a new page
                    break
                await pub.publish({"w": torch.zeros(16)})
            else:
                pytest.fail("the log never reached the end of a page")
            assert fill(mnt, 4096) == 4096  # one page: the manifest's
            v = (await pub.publish({"w": torch.zeros(16)})).version  # committed; its line not
            data = log.read_bytes()
            assert data.endswith(b"\n"), data[-200:]  # was: the line cut at the page's end
            (mnt / "ballast").unlink()
            w = (await pub.publish({"w": torch.zeros(16)})).version
        assert [r["version"] for r in read_log(root)][-2:] == [v - 1, w]


async def test_a_root_on_a_full_disk_is_refused_with_what_to_do(tmp_path: Path) -> None:
    """(helper-28, finding 4) Opening a publisher on a new root of a full filesystem said "pass
    a directory this process can write"; the remedy is space."""
    with tmpfs(tmp_path / "full", "1m") as mnt:
        fill(mnt, 0)
        with pytest.raises(ConfigError, match=r"No space left.*; free space on its filesystem"):
            async with Publisher(mnt / "root"):
                pass


async def test_an_ack_that_a_full_root_refuses_names_the_ack(tmp_path: Path) -> None:
    """(helper-28, finding 4) The ack's write failing on a full root was logged as "sync failed:
    [Errno 28] No space left on device", naming no file; it names the ack now."""
    with tmpfs(tmp_path / "shared", "24m") as mnt:
        root = mnt / "root"
        sd = _model(4)
        agent = ReceiverAgent(root, LocalCheckpoint(tmp_path / "ck"), "e", use_inotify=False)
        async with Publisher(root, keyframe_interval=0) as pub, agent:
            await pub.seed(sd)
            assert await agent.sync_once() == 0
            await pub.publish(_step(sd, 0.03, 1))
            fill(mnt, 0)
            with pytest.raises(OSError, match=r"No space left.*writing the ack.*acks/e\.json"):
                await agent.sync_once()
        assert _acked(root, "e") == 0


def _unsynced(ck: Path) -> None:
    """What a failed flush leaves: state.json at the version with ``synced: false``."""
    st = json.loads((ck / ".asyncsync" / "state.json").read_text())
    st["synced"] = False
    (ck / ".asyncsync" / "state.json").write_text(json.dumps(st))


@pytest.mark.parametrize("damaged", [False, True])
async def test_a_checkpoint_opens_on_its_full_disk(tmp_path: Path, damaged: bool) -> None:
    """A receiver (re)started while its checkpoint's disk is full: every open wrote state.json
    again, unchanged, and the full disk refused it: the receiver could not even start to serve
    what it held. And a version not known durable whose bytes no longer match (a failed
    flush's lost pages) is wiped, state first: the full disk refused that too, so the open
    failed with the files (and the ack naming them) kept. An open writes the state only where
    it changed, and a wipe the disk refuses (here with no state spare to write over, as an
    older receiver left it) removes the files first (the state left, not known durable, makes
    an open wipe again), which frees the room its state needs."""
    from tests.test_engines import build_manifest, full_batches, init_checkpoint

    with tmpfs(tmp_path / "small", "4m") as mnt:
        ck = await init_checkpoint(mnt / "ck", _model(1))
        await ck.close()
        if damaged:
            _unsynced(mnt / "ck")
            (mnt / "ck" / ".asyncsync" / "state.json.spare").unlink()
            loc = next(iter(ck.files.load_layout().values()))
            with open(mnt / "ck" / loc.file, "r+b") as f:
                f.seek(loc.begin)
                f.write(b"\x00\x01\x02\x03")
        fill(mnt, 0)
        ck = LocalCheckpoint(mnt / "ck")
        assert (await ck.open()).version == (None if damaged else 0)
        (mnt / "ballast").unlink()
        if damaged:
            assert not ck.files.data_files()
            sd = _model(1, seed=2)
            m = build_manifest(sd, 3)
            await ck.begin(m, "full")
            for b in full_batches(m, sd):
                await ck.apply(b)
            await ck.commit()
        await ck.close()
        ck = LocalCheckpoint(mnt / "ck")
        assert (await ck.open()).version == (3 if damaged else 0)
        await ck.close()


async def test_a_lost_delta_is_wiped_on_a_full_disk(tmp_path: Path) -> None:
    """A receiver killed mid-delta whose progressive undo record no longer reads (the machine
    went down) reopens on a full disk: the wipe's state (no version) was refused, and its
    fallback (the files first, freeing their room) is only for a state that makes an open
    wipe again, not for a delta in flight (the files would go under a state naming them):
    the open failed with ENOSPC until space came back. The wipe writes its state over the
    state's spare (no new block), as a rollback does: it opens empty, and the files' room
    is freed for the keyframe."""
    from tests.test_engines import init_checkpoint

    with tmpfs(tmp_path / "small", "4m") as mnt:
        ck = await init_checkpoint(mnt / "ck", _model(1))
        await ck.close()
        state = mnt / "ck" / ".asyncsync"
        st = json.loads((state / "state.json").read_text())
        st.update(status="applying", target_version=1, mode="delta", progressive=True,
                  format_version=2)  # fmt: skip
        (state / "state.json").write_text(json.dumps(st))
        (state / "journal" / "undo-000000.progressive").write_bytes(b"\0" * 100)  # torn
        fill(mnt, 0)
        ck = LocalCheckpoint(mnt / "ck")
        assert (await ck.open()).version is None  # was: ApplyFailed, No space left
        assert not ck.files.data_files()
        assert json.loads((state / "state.json").read_text())["version"] is None
        await ck.close()


_FLUSH_FAILS_ON_A_FULL_DISK = """
import asyncio, errno, os, sys
from pathlib import Path
from receiver.engines.checkpoint import LocalCheckpoint
from receiver.engines.st_layout import FileMaps
from tests.conftest import mixed_state, mutate
from tests.mounts import fill
from tests.test_engines import apply_version, build_manifest, delta_batches

async def main(ck: str, mnt: str, full_at_open: bool) -> None:
    c = LocalCheckpoint(ck)
    if full_at_open:  # no spare note can be made
        fill(Path(mnt), 0)
    await c.open()
    if full_at_open:
        (Path(mnt) / "ballast").unlink()
    sd0 = mixed_state(0)
    sd1 = mutate(sd0, 0.05, seed=1)
    m1 = build_manifest(sd1, 1, base=sd0)
    await apply_version(c, m1, delta_batches(m1, sd0, sd1), "delta")
    def failed(self: FileMaps) -> None:  # the writeback fails (a tmpfs has none to fail)
        raise OSError(errno.EIO, "Input/output error")
    FileMaps.sync = failed
    fill(Path(mnt), 0)  # and the disk refuses the note's new file
    await c.acknowledged()
    await c.flushed()
    os.kill(os.getpid(), 9)

asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3] == "full"))
"""


@pytest.mark.parametrize("at_open", ["room", "full"])
async def test_a_flush_failure_is_noted_on_a_disk_full_to_the_last_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, at_open: str
) -> None:
    """A flush fails on a disk so full that the note of the failure (a new file) is refused,
    and the receiver is killed before its close could write it: the next open in a new
    process found no note, trusted a plain fsync (the pages the failed writeback left clean
    write nothing) and marked the version durable with them lost at the next reboot. An
    open makes a spare note beforehand; a failure the disk refuses a new file for renames the
    spare into place (no new block), and the next open writes the data files again. A disk
    already full at open (``full``; the spare of an earlier open used up, or never made by
    an older receiver) gets no spare: the failure was lost as before; it is noted by an
    empty note then (a new name, no data block)."""
    from receiver.engines.checkpoint import files
    from receiver.engines.checkpoint.flusher import SPARE_NAME
    from tests.test_engines import init_checkpoint

    with tmpfs(tmp_path / "small", "8m") as mnt:
        ck = await init_checkpoint(mnt / "ck", mixed_state(0))
        await ck.close()
        if at_open == "full":
            (mnt / "ck" / ".asyncsync" / SPARE_NAME).unlink()
        r = subprocess.run(
            [sys.executable, "-c", _FLUSH_FAILS_ON_A_FULL_DISK, str(mnt / "ck"), str(mnt), at_open],
            cwd=REPO, capture_output=True, text=True, timeout=300,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        assert r.returncode == -9, r.stderr
        (mnt / "ballast").unlink()
        rewritten: list[int] = []
        rewrite = files.CheckpointFiles.rewrite_data_files

        def spy(self: files.CheckpointFiles, chunk: int = 16 << 20) -> None:
            rewritten.append(1)
            rewrite(self, chunk)

        monkeypatch.setattr(files.CheckpointFiles, "rewrite_data_files", spy)
        ck = LocalCheckpoint(mnt / "ck")
        assert (await ck.open()).version == 1
        assert rewritten == [1]  # written again before it is trusted
        assert not (mnt / "ck" / ".asyncsync" / "flush-failed").exists()
        await ck.close()


async def test_the_spare_note_is_made_again_once_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The spare note renamed for one failed flush is made again when the recovery clears the
    note, so a second failure on a full disk in the same process is noted too."""
    from receiver.engines.checkpoint.flusher import FAILED_NAME, SPARE_NAME
    from receiver.engines.st_layout import FileMaps
    from tests.conftest import mutate
    from tests.test_engines import apply_version, build_manifest, delta_batches, init_checkpoint

    with tmpfs(tmp_path / "small", "8m") as mnt:
        sd0 = mixed_state(0)
        ck = await init_checkpoint(mnt / "ck", sd0)
        state = mnt / "ck" / ".asyncsync"
        sd1 = mutate(sd0, 0.05, seed=1)
        m1 = build_manifest(sd1, 1, base=sd0)
        await apply_version(ck, m1, delta_batches(m1, sd0, sd1), "delta")

        def failed(self: FileMaps) -> None:  # the disk full when the flush fails (filled
            fill(mnt, 0)  # after the ack cleared the undo records, which gives room back)
            raise OSError(errno.EIO, "Input/output error")

        with monkeypatch.context() as m:
            m.setattr(FileMaps, "sync", failed)
            await ck.acknowledged()
            await ck.flushed()
        assert (state / FAILED_NAME).exists() and not (state / SPARE_NAME).exists()
        (mnt / "ballast").unlink()
        sd2 = mutate(sd1, 0.05, seed=2)
        m2 = build_manifest(sd2, 2, base=sd1)
        await apply_version(ck, m2, delta_batches(m2, sd1, sd2), "delta")  # recovers first
        assert not (state / FAILED_NAME).exists() and (state / SPARE_NAME).exists()
        await ck.close()


async def test_a_rollback_on_a_disk_filled_meanwhile_needs_no_new_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills (another writer) after a delta's patch: the commit's state is refused
    and the rollback's state (a new file, the size of every tensor's checksum) did not fit in
    the room the cleared undo record gave back, so every sync said "rollback of v1 failed (No
    space left); retried: the same" until space came back. The state is written over a spare
    made beforehand (allocated and written: no new block, even on a thinly provisioned disk),
    so the rollback completes on the full disk, the version is refused in one line, and it
    applies once there is room."""
    root = tmp_path / "root"
    g = torch.Generator().manual_seed(0)
    sd = {f"layer.{i}.weight": torch.randn(16, generator=g) for i in range(600)}  # a long state
    with tmpfs(tmp_path / "small", "4m") as mnt:
        async with Publisher(root, keyframe_interval=0) as pub:
            await pub.seed(sd)
            agent = ReceiverAgent(root, LocalCheckpoint(mnt / "ck"), "e", use_inotify=False)
            async with agent:
                assert await agent.sync_once() == 0
                await agent.engine.flushed()  # type: ignore[attr-defined]
                sd = {**sd, "layer.7.weight": sd["layer.7.weight"] + 1}
                await pub.publish(sd)
                real_patch = inplace.journal_and_patch

                def patch_then_fill(*args: object, **kw: object) -> object:
                    out = real_patch(*args, **kw)  # type: ignore[arg-type]
                    fill(mnt, 0)  # another writer fills the disk meanwhile
                    return out

                monkeypatch.setattr(inplace, "journal_and_patch", patch_then_fill)
                with pytest.raises(ApplyFailed, match="No space left") as failed:
                    await agent.sync_once()
                monkeypatch.undo()
                assert "rollback of" not in str(failed.value)
                st = json.loads((mnt / "ck" / ".asyncsync" / "state.json").read_text())
                assert (st["version"], st["status"]) == (0, "clean")  # rolled back, on disk
                with pytest.raises(ApplyFailed, match="No space left") as again:
                    await agent.sync_once()  # refused in one line: nothing to roll back
                assert "rollback of" not in str(again.value)
                assert agent.version == 0 and _acked(root, "e") == 0
                assert verify_checkpoint(mnt / "ck", read_manifest(root, 0)) == []
                (mnt / "ballast").unlink()
                assert await agent.sync_once() == 1  # the same agent, once there is room
            assert verify_checkpoint(mnt / "ck", read_manifest(root, 1)) == []


async def test_a_checkpoint_with_redo_records_opens_on_its_full_disk(tmp_path: Path) -> None:
    """A receiver with a redo log (re)started while it holds records and its checkpoint's disk
    is full: the compaction at open could not write (the state, the undo records) and failed
    the open, so the receiver could not start to serve the version it had acknowledged, where
    one without a log opens (test_a_checkpoint_opens_on_its_full_disk). The records are kept,
    as at close, and merged once space is back; the files are untouched meanwhile."""
    from tests.test_redolog import _four_records

    root = tmp_path / "root"
    with tmpfs(tmp_path / "small", "8m") as mnt:
        ck = mnt / "ck"
        await _four_records(root, ck)
        before = {p.name: p.read_bytes() for p in ck.glob("*.safetensors")}
        fill(mnt, 0)
        eng = LocalCheckpoint(ck, redo_log=10, compact_idle=1e9)
        assert (await eng.open()).version == 4  # was: ApplyFailed, No space left on device
        assert (
            eng.redo_held == 4
            and {p.name: p.read_bytes() for p in ck.glob("*.safetensors")} == before
        )
        (mnt / "ballast").unlink()
        await eng.close()  # merged at close, now that there is room
        st = json.loads((ck / ".asyncsync" / "state.json").read_text())
        assert st["version"] == 4 and "redo" not in st
        assert verify_checkpoint(ck, read_manifest(root, 4)) == []
