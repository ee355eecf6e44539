"""A receiver's checkpoint touched behind its back, by real receiver processes
(``python -m receiver.cli``), each version a process of its own (``--once``) unless said.

* A data file hard-linked elsewhere (an operator's ``cp -al`` backup) or replaced by a symlink
  to a copy (a file linked from a model store): the receiver patched it in place through the
  link, so the file elsewhere changed with every version. It copies such a file into one of
  its own before the first in-place write now.
* A data file edited between two versions (a byte flipped, the file truncated, a backup of an
  older version put back): a tensor the next versions did not touch kept the edit for good,
  acknowledged version after version (and after restarts); a truncated file refused every delta
  ("buffer is smaller than requested size"), the ack left on the version before. The engine
  stamps its files (``receiver.engines.checkpoint.stamps``): a changed file is checked, and
  wiped if it no longer holds the version; the receiver re-initialises from a keyframe.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
from pathlib import Path

import pytest
import torch

from asyncsync import Publisher
from asyncsync.errors import EngineStateError
from asyncsync.format.acks import read_acks
from asyncsync.format.store import read_manifest
from receiver import ReceiverAgent
from receiver.engines.checkpoint import LocalCheckpoint, verify_checkpoint
from receiver.engines.st_layout import read_layout
from tests.conftest import flip_tensor_byte
from tests.test_flush_killed import _receivers, _wait
from tests.test_full_disk import _receive_once


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"l.{i}.w": torch.randn(16 << 10, generator=g) for i in range(4)}


def _step(sd: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """About 1 % of each tensor's elements changed."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, t in sd.items():
        t = t.clone()
        t[torch.rand(t.numel(), generator=g) < 0.01] += 1.0
        out[k] = t
    return out


def _holds(root: Path, ck: Path, version: int) -> bool:
    """The receiver acknowledged ``version`` and its checkpoint holds it bit for bit."""
    ack = read_acks(root).get("e")
    if ack is None or ack.version != version:
        return False
    try:
        return verify_checkpoint(ck, read_manifest(root, version)) == []
    except (OSError, EngineStateError):  # the receiver is wiping or re-writing it
        return False


@pytest.mark.parametrize("link", ["hard", "symbolic"])
async def test_a_linked_data_file_is_copied_before_it_is_patched(tmp_path: Path, link: str) -> None:
    root, ck, other = tmp_path / "root", tmp_path / "ck", tmp_path / "backup.safetensors"
    sd = _model()
    async with Publisher(root, keyframe_interval=0) as pub:
        await pub.seed(sd)
        proc = _receive_once(root, ck)
        assert proc.returncode == 0, proc.stderr
        (data,) = ck.glob("model-*.safetensors")
        if link == "hard":
            os.link(data, other)
        else:
            shutil.copyfile(data, other)
            data.unlink()
            data.symlink_to(other)
        kept = other.read_bytes()
        await pub.publish(_step(sd, 1))
        proc = _receive_once(root, ck)
    assert proc.returncode == 0, proc.stderr
    assert other.read_bytes() == kept  # the backup (or the store's file) is v0 still
    assert "had other links" in proc.stderr
    st = os.lstat(data)
    assert stat.S_ISREG(st.st_mode) and st.st_nlink == 1
    assert stat.S_IMODE(st.st_mode) == 0o644
    assert _holds(root, ck, 1)
    assert not [p for p in ck.iterdir() if p.name.startswith(".tmp.")]


def _flip(data: Path, name: str) -> None:
    """One byte of tensor ``name`` in ``data`` flipped, as an editor or a bad disk would."""
    loc = read_layout(data)[name]
    with open(data, "r+b") as f:
        f.seek(loc.begin + 7)
        b = f.read(1)
        f.seek(loc.begin + 7)
        f.write(bytes([b[0] ^ 0x40]))


@pytest.mark.parametrize("edit", ["flip", "truncate", "old-copy"])
async def test_a_data_file_edited_between_versions_is_caught_and_reinitialised(
    tmp_path: Path, edit: str
) -> None:
    """v1 touches every tensor but ``l.0.w``; the edit lands between v0 and v1 (the old copy:
    v0's file put back with ``cp -p`` after v1, then v2 comes, which touches ``l.0.w`` only:
    the other tensors stayed v0's, acknowledged as v2's)."""
    root, ck = tmp_path / "root", tmp_path / "ck"
    sd = _model()
    rest = [n for n in sd if n != "l.0.w"]
    async with Publisher(root, keyframe_interval=0) as pub:
        await pub.seed(sd)
        assert _receive_once(root, ck).returncode == 0
        (data,) = ck.glob("model-*.safetensors")
        if edit == "flip":
            _flip(data, "l.0.w")
        elif edit == "truncate":
            os.truncate(data, data.stat().st_size - 4096)
        else:
            shutil.copy2(data, tmp_path / "v0.safetensors")
        sd1 = {**sd, **{n: t for n, t in _step(sd, 1).items() if n in rest}}
        await pub.publish(sd1)
        proc = _receive_once(root, ck)
        last = 1
        if edit == "old-copy":
            assert proc.returncode == 0 and _holds(root, ck, 1), proc.stderr
            os.replace(tmp_path / "v0.safetensors", data)  # (its mtime kept: cp -p)
            await pub.publish({**sd1, "l.0.w": _step(sd1, 2)["l.0.w"]})  # the rest: v1's
            proc = _receive_once(root, ck)
            last = 2
    assert proc.returncode == 0, proc.stderr
    assert _holds(root, ck, last), proc.stderr  # l.0.w (and the rest) as published
    assert "changed behind the receiver's back" in proc.stderr


async def test_a_running_receiver_catches_an_edit_before_the_next_version(tmp_path: Path) -> None:
    """The same in one receiver process that runs throughout: the edit is seen at its next sync
    (nothing newer) or at the next delta's begin, whichever comes first; its ack of v0 is
    withdrawn or replaced, never left on bytes that are not v0's."""
    root, ck = tmp_path / "root", tmp_path / "ck"
    sd = _model()
    async with Publisher(root, keyframe_interval=0) as pub:
        await pub.seed(sd)
        with _receivers(root, ck, tmp_path / "receiver.log") as r:
            r.start()
            _wait(lambda: _holds(root, ck, 0), "v0", r)
            (data,) = ck.glob("model-*.safetensors")
            _flip(data, "l.0.w")
            _wait(lambda: r.said("changed behind the receiver's back"), "the edit seen", r)
            _wait(lambda: _holds(root, ck, 0), "v0 again", r)
            _flip(data, "l.0.w")  # again, now with a delta that does not touch it on the way
            await pub.publish({n: t if n == "l.0.w" else t + 1 for n, t in sd.items()})
            _wait(lambda: _holds(root, ck, 1), "v1", r)
            assert r.proc is not None
            r.proc.send_signal(signal.SIGTERM)
            assert r.proc.wait(60) == 0


class _EditedBeforeItsFlush(LocalCheckpoint):
    """A checkpoint whose data file is edited after the commit of a delta and before its flush
    starts (``acknowledged``): in the window the flush after the ack runs in."""

    edit: str | None = None

    async def acknowledged(self) -> None:
        if self._unflushed is not None and self.edit is not None:
            flip_tensor_byte(self.directory, self.edit)
            self.edit = None
        await super().acknowledged()


async def test_an_edit_while_a_delta_is_flushed_is_not_taken_for_the_receivers_own(
    tmp_path: Path,
) -> None:
    """The flush after the ack saved state.json again (``synced``) and so stamped the files
    again as they were then: an edit made meanwhile passed for the receiver's own write, and
    its bytes were held (and acknowledged) for good."""
    root = tmp_path / "root"
    sd = _model()
    async with Publisher(root, keyframe_interval=0) as pub:
        await pub.seed(sd)
        engine = _EditedBeforeItsFlush(tmp_path / "ck")
        async with ReceiverAgent(root, engine, "e", use_inotify=False) as agent:
            assert await agent.sync_once() == 0
            await pub.publish(_step(sd, 1))
            engine.edit = "l.0.w"
            assert await agent.sync_once() == 1
            assert engine.edit is None  # made, then the flush ran
            await engine.flushed()
            await engine.reconcile()  # a sync with nothing newer: the stamps compared
            assert engine.state.version is None  # wiped: the agent re-initialises
            assert await agent.sync_once() == 1
    assert _holds(root, tmp_path / "ck", 1)


@pytest.mark.parametrize("when", ["commit", "rollback"])
async def test_a_file_truncated_during_an_apply_is_not_stamped_as_the_receivers_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """A data file truncated while a delta is applied (found by attack: ``truncate`` on the
    checkpoint of a running receiver), after the begin's check: the commit, or the rollback
    of a version that failed, stamped the files as they were then, as the receiver's own; a
    committed version was acknowledged on the cut file, and every later delta failed on it
    ("ValueError: buffer is smaller than requested size"), its ack kept. A delta never changes
    a file's inode or size: one that changed keeps the stamps it had, and the next check (a
    sync with nothing newer, or the next begin) finds it and re-initialises from a keyframe."""
    from receiver.engines.checkpoint import engine as engine_mod

    root, ck = tmp_path / "root", tmp_path / "ck"
    real = engine_mod.inplace.first_mismatch

    def cut_then_check(*args, **kwargs):  # type: ignore[no-untyped-def]
        (data,) = ck.glob("model-*.safetensors")
        os.truncate(data, data.stat().st_size + 4096)  # (its size changed; longer: no map cut)
        bad = real(*args, **kwargs)
        return ("l.0.w", "other bytes") if when == "rollback" else bad

    sd = _model()
    async with Publisher(root, keyframe_interval=0) as pub:
        await pub.seed(sd)
        engine = LocalCheckpoint(ck)
        async with ReceiverAgent(root, engine, "e", use_inotify=False) as agent:
            assert await agent.sync_once() == 0
            await pub.publish(_step(sd, 1))
            monkeypatch.setattr(engine_mod.inplace, "first_mismatch", cut_then_check)
            if when == "commit":
                assert await agent.sync_once() == 1
            else:
                with pytest.raises(Exception, match=r"l\.0\.w"):
                    await agent.sync_once()
                assert engine.state.version == 0
            monkeypatch.setattr(engine_mod.inplace, "first_mismatch", real)
            await engine.flushed()
            await engine.reconcile()  # a sync with nothing newer: the stamps compared
            assert engine.state.version is None  # wiped: the agent re-initialises
            assert await agent.sync_once() == 1
    assert _holds(root, ck, 1)
