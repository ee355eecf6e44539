"""An undo record is written back only by the apply that wrote it: each record names the
version its apply moved to (``target_version``), and an undo (at open after a crash, or a
rollback) removes, never replays, a record of another version than the one ``state.json``
says is being applied. Such a record is stale: its apply committed (the files hold its new
bytes), and its old values are of a version before the files' base.

A compaction of the redo log marks the state ``applying`` before it clears the journal, so a
crash between the two (or a failed rollback there) met the records of the compaction before
it wherever their clearing after its commit had failed: they were written back, the files
became a mix of versions, and the checkpoint was wiped (progressive: the re-check at open;
durable: the next compaction's checksums)."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncsync import Publisher
from receiver import ReceiverAgent
from receiver.engines.checkpoint import LocalCheckpoint
from tests.conftest import assert_holds
from tests.test_engines import undo_records
from tests.test_progressive_journal import _crashed_mid_delta, needs_kernel
from tests.test_redolog import _publish


def _state(ck: Path) -> dict[str, Any]:
    st: dict[str, Any] = json.loads((ck / ".asyncsync" / "state.json").read_text())
    return st


@pytest.mark.parametrize("durable", [False, True], ids=["progressive", "durable"])
async def test_a_crash_beside_an_earlier_versions_undo_records_does_not_write_them_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, durable: bool
) -> None:
    """v1's compaction committed and the removal of its undo records failed (kept, a warning);
    v2's compaction marked the state ``applying`` v2 and a crash came before it cleared the
    journal (a copy of the directory: a killed process keeps the page cache). The open undoes
    v2 (nothing of it written) without writing v1's old bytes back, merges v2's redo record,
    and holds v2 bit-exact; it was wiped."""
    root, ck, crashed = tmp_path / "root", tmp_path / "ck", tmp_path / "crashed"
    async with Publisher(root, keyframe_interval=0) as pub:
        sds = await _publish(pub, [], 2)
    eng = LocalCheckpoint(ck, redo_log=1, compact_idle=1e9, sync_before_ack=durable)
    journal, real_clear = eng._store.journal_dir, eng._store.clear_dir
    seen: list[list[str]] = []

    def clear_dir(path: Path, **kw: Any) -> None:
        ps = eng._ps
        if path == journal and ps.applying and ps.target_version == 2 and not seen:
            seen.append(sorted(p.name for p in journal.iterdir()))
            shutil.copytree(ck, crashed)  # the crash: v2's compaction begun, v1's records kept
        elif path == journal and not ps.applying and (ps.version, ps.redo) == (1, ()):
            raise OSError(errno.EIO, "injected: v1's undo records not removed")
        real_clear(path, **kw)

    monkeypatch.setattr(eng._store, "clear_dir", clear_dir)
    async with ReceiverAgent(root, eng, "e", use_inotify=False, prefetch=False) as agent:
        assert await agent.sync_once() == 2
    assert seen and seen[0], "v1's compaction left no undo record"
    st = _state(crashed)
    assert (st["status"], st["version"], st["target_version"]) == ("applying", 1, 2)
    again = LocalCheckpoint(crashed)
    assert (await again.open()).version == 2  # was: None (wiped)
    try:
        assert _state(crashed)["version"] == 2 and "redo" not in _state(crashed)
        assert not undo_records(crashed)  # (the merge's own record kept as a spare)
        assert_holds(again.load_state_dict(), sds[2])
    finally:
        await again.close()


def _hostile(record: Path, header: str) -> None:
    """Beside the real record ``record`` (its header rewritten in its own length, its data
    kept): ``nested``, a record whose header nests past the JSON parser's depth; ``inf``, the
    real record saying its version is ``1e999`` (a number no int holds), all else intact."""
    data = record.read_bytes()
    hlen = int.from_bytes(data[:8], "little")
    if header == "nested":
        text = b"[" * 100_000 + b"]" * 100_000
        (record.parent / "undo-000009.progressive").write_bytes(
            len(text).to_bytes(8, "little") + text
        )
        return
    meta = json.loads(data[8 : 8 + hlen])
    text = (
        json.dumps(meta, separators=(",", ":"))
        .replace(f'"target_version":"{meta["target_version"]}"', '"target_version":1e999')
        .encode()
    )
    assert b"1e999" in text and len(text) <= hlen
    record.write_bytes(data[:8] + text.ljust(hlen) + data[8 + hlen :])


@needs_kernel
@pytest.mark.parametrize("header", ["nested", "inf"])
async def test_a_record_whose_header_is_hostile_is_left_to_the_undo(
    tmp_path: Path, header: str
) -> None:
    """The version check reads each record's header: one it cannot read is left to the undo,
    as before it (``nested``: unreadable, the files wiped for a keyframe; ``inf``: read and
    written back, v0 held). It raised RecursionError / OverflowError out of ``open()``, at
    every restart."""
    sd0, record = await _crashed_mid_delta(tmp_path)
    _hostile(record, header)
    ck = LocalCheckpoint(tmp_path / "c")
    try:
        state = await ck.open()
        if header == "nested":
            assert state.version is None
        else:
            assert state.version == 0
            assert_holds(ck.load_state_dict(), sd0)
        assert not list((tmp_path / "c" / ".asyncsync" / "journal").iterdir())
    finally:
        await ck.close()


async def _crashed_mid_durable_delta(tmp_path: Path) -> tuple[dict[str, torch.Tensor], Path]:
    """A checkpoint at v0 (durable records: ``sync_before_ack``) whose delta to v1 was
    interrupted after its first group (a real child process, os._exit at the second patch
    call): state ``applying`` v1, the first group's record durable, its patch written."""
    from tests.test_engines import (
        build_manifest,
        init_checkpoint,
        mixed_state,
        mutate,
        run_crashing_child,
        xef_batches,
    )

    sd0 = mixed_state(0)
    ck = await init_checkpoint(tmp_path / "c", sd0)
    await ck.close()
    sd1 = mutate(sd0, 0.2, seed=1)
    m1 = build_manifest(sd1, 1, base=sd0)
    run_crashing_child(
        tmp_path, tmp_path / "c", m1, xef_batches(m1, sd0, sd1), "delta", durable=True
    )
    records = sorted((tmp_path / "c" / ".asyncsync" / "journal").glob("undo-*.safetensors"))
    assert records
    return sd0, records[0]


@needs_kernel
async def test_a_needed_record_whose_version_digit_flipped_is_still_written_back(
    tmp_path: Path,
) -> None:
    """A durable record of the delta being undone, one bit of its header's ``target_version``
    flipped (``"1"`` -> ``"0"``, bit rot): the version check took it for a stale record and
    removed it, so its group's new bytes stayed in the files, served as v0 (a durable undo is
    trusted, not re-checked). Before the check the record was read and written back; now a
    removal at open makes the files checked against v0's checksums: wiped, not served."""
    sd0, record = await _crashed_mid_durable_delta(tmp_path)
    data = bytearray(record.read_bytes())
    at = data.index(b'"target_version":"1"') + len(b'"target_version":"')
    data[at] ^= 0x01  # "1" -> "0"
    record.write_bytes(bytes(data))
    ck = LocalCheckpoint(tmp_path / "c", sync_before_ack=True)
    try:
        state = await ck.open()
        assert state.version in (0, None)  # exact, or wiped: never v1's bytes as v0's
        if state.version == 0:
            assert_holds(ck.load_state_dict(), sd0)
    finally:
        await ck.close()
