"""LocalCheckpoint with a redo log (``redo_log=N``): deltas kept as redo records, the files
untouched until a compaction merges them; every reader of the bytes compacts first; the state
format and the start-up hold of the plugins while records are held."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncsync import Publisher
from asyncsync.codec import raw_view
from asyncsync.errors import ApplyFailed
from asyncsync.format.store import read_manifest
from receiver import ReceiverAgent
from receiver.engines.checkpoint import LocalCheckpoint, inplace, verify_checkpoint
from receiver.engines.checkpoint.redo import Record
from receiver.plugins.clean_load import load_whole_version
from receiver.plugins.held import Unverified, checkpoint_snapshot
from receiver.state import PersistedState, StateStore
from tests.conftest import assert_holds, flip_tensor_byte, mixed_state, mutate


def _files_digest(ck: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(ck.glob("model*.safetensors")):
        h.update(p.read_bytes())
    return h.hexdigest()


def _state(ck: Path) -> dict:
    return json.loads((ck / ".asyncsync" / "state.json").read_text())


async def _publish(
    pub: Publisher, sds: list[dict[str, torch.Tensor]], n: int, density: float = 0.05
) -> list[dict[str, torch.Tensor]]:
    """Seed v0 (first call), then publish versions until ``n``; returns every state so far."""
    if not sds:
        sds.append(mixed_state(0))
        await pub.seed(sds[0])
    while len(sds) <= n:
        sds.append(mutate(sds[-1], density, seed=len(sds)))
        await pub.publish(sds[-1])
    return sds


@contextlib.asynccontextmanager
async def _running(
    root: Path, ck: Path, redo_log: int
) -> AsyncIterator[tuple[LocalCheckpoint, Publisher, ReceiverAgent]]:
    """A publisher and an agent on a checkpoint with a redo log that is never idle."""
    eng = LocalCheckpoint(ck, redo_log=redo_log, compact_idle=1e9)
    async with (
        Publisher(root, keyframe_interval=0) as pub,
        ReceiverAgent(root, eng, "e", use_inotify=False, prefetch=False) as agent,
    ):
        yield eng, pub, agent


async def _sync(root: Path, engine: LocalCheckpoint) -> int | None:
    async with ReceiverAgent(root, engine, "e", use_inotify=False, prefetch=False) as agent:
        return await agent.sync_once()


async def test_deltas_become_records_and_the_files_stay_until_n(tmp_path: Path) -> None:
    root, ck = tmp_path / "root", tmp_path / "ck"
    async with Publisher(root, keyframe_interval=0) as pub:
        sds = await _publish(pub, [], 1)
        assert await _sync(root, LocalCheckpoint(ck, redo_log=3)) == 1  # merged at close
        assert _state(ck)["version"] == 1 and "redo" not in _state(ck)
        base = _files_digest(ck)
        await _publish(pub, sds, 3)
    eng = LocalCheckpoint(ck, redo_log=3, compact_idle=1e9)  # never idle in this test
    try:
        async with ReceiverAgent(root, eng, "e", use_inotify=False, prefetch=False) as agent:
            assert await agent.sync_once() == 3
            st = _state(ck)
            assert st["format_version"] == 3 and st["version"] == 1
            assert [r["version"] for r in st["redo"]] == [2, 3]
            assert eng.state.version == 3 and eng.redo_held == 2
            status = agent.status().engine
            assert status == {"redo_log": 3, "redo_records": [2, 3], "files_version": 1,
                              "files_loadable": False}  # fmt: skip
            assert eng.metrics()["redo_records"][1] == 2
            assert _files_digest(ck) == base  # not a byte of the files written
            assert sorted(p.name for p in (ck / ".asyncsync" / "redo").iterdir()) == [
                "redo-000000000002.rec",
                "redo-000000000003.rec",
            ]
            with pytest.raises(Unverified, match="redo records"):
                checkpoint_snapshot(ck)
            assert_holds(eng.load_state_dict(), sds[3])  # a reader of the bytes: merged first
            assert eng.redo_held == 0 and _state(ck)["format_version"] == 1
            assert not list((ck / ".asyncsync" / "redo").iterdir())
            assert checkpoint_snapshot(ck) is not None
    finally:
        await eng.close()
    assert verify_checkpoint(ck, read_manifest(root, 3)) == []


async def test_the_nth_record_is_merged_after_its_ack(tmp_path: Path) -> None:
    root, ck = tmp_path / "root", tmp_path / "ck"
    async with Publisher(root, keyframe_interval=0) as pub:
        sds = await _publish(pub, [], 5)
    eng = LocalCheckpoint(ck, redo_log=2, compact_idle=1e9)
    seen: list[int] = []
    real = eng._compact

    def compact(why: str) -> None:
        seen.append(len(eng._ps.redo))
        real(why)

    eng._compact = compact  # type: ignore[method-assign]
    async with ReceiverAgent(root, eng, "e", use_inotify=False, prefetch=False) as agent:
        assert await agent.sync_once() == 5
        assert seen[:2] == [2, 2]  # after v2's and v4's acks; v5 held
        assert eng.redo_held == 1 and _state(ck)["version"] == 4
    assert seen[-1] == 1 and _state(ck)["version"] == 5  # merged at close
    assert verify_checkpoint(ck, read_manifest(root, 5)) == []
    eng = LocalCheckpoint(ck)
    await eng.open()
    assert_holds(eng.load_state_dict(), sds[5])
    await eng.close()


async def test_records_held_at_open_are_merged_even_with_the_log_off(tmp_path: Path) -> None:
    root, ck = tmp_path / "root", tmp_path / "ck"
    async with Publisher(root, keyframe_interval=0) as pub:
        sds = await _publish(pub, [], 3)
    eng = LocalCheckpoint(ck, redo_log=10, compact_idle=1e9)
    await eng.open()
    async with ReceiverAgent(root, eng, "e", use_inotify=False, prefetch=False) as agent:
        await agent.sync_once()
        assert eng.redo_held == 3
        eng._store.close()  # a kill: nothing merged at close
        eng._ps = PersistedState()
    eng = LocalCheckpoint(ck)  # redo_log=0
    assert (await eng.open()).version == 3
    assert "redo" not in _state(ck) and _state(ck)["version"] == 3
    assert_holds(eng.load_state_dict(), sds[3])
    await eng.close()


async def test_a_full_version_drops_the_records_and_a_zero_diff_merges_them(
    tmp_path: Path,
) -> None:
    root, ck = tmp_path / "root", tmp_path / "ck"
    async with _running(root, ck, 10) as (eng, pub, agent):
        sds = await _publish(pub, [], 2)
        await agent.sync_once()
        assert eng.redo_held == 2
        await pub.publish(sds[-1])  # a zero-diff v3
        await agent.sync_once()
        assert eng.redo_held == 0 and _state(ck)["version"] == 3
        await pub.publish(mutate(sds[-1], 0.05, seed=9))  # v4: a record
        await agent.sync_once()
        assert eng.redo_held == 1
        await pub.publish(mixed_state(5, scale=2))  # v5: other shapes, a full version
        await agent.sync_once()
        assert eng.redo_held == 0 and _state(ck)["version"] == 5
        assert not list((ck / ".asyncsync" / "redo").iterdir())
    assert verify_checkpoint(ck, read_manifest(root, 5)) == []


async def test_an_aborted_or_incomplete_version_leaves_no_record(tmp_path: Path) -> None:
    root, ck = tmp_path / "root", tmp_path / "ck"
    async with _running(root, ck, 4) as (eng, pub, agent):
        sds = await _publish(pub, [], 1)
        await agent.sync_once()
        await _publish(pub, sds, 2)
        m2 = read_manifest(root, 2)
        await eng.begin(m2, "delta")
        assert list((ck / ".asyncsync" / "redo").glob(".redo-*.part"))
        await eng.abort()
        assert [p.name for p in (ck / ".asyncsync" / "redo").iterdir()] == ["redo-000000000001.rec"]
        await eng.begin(m2, "delta")
        with pytest.raises(ApplyFailed, match="not applied"):
            await eng.commit()  # nothing applied
        assert eng.state.version == 1 and eng.redo_held == 1
        assert [p.name for p in (ck / ".asyncsync" / "redo").iterdir()] == ["redo-000000000001.rec"]
    await eng.close()


def test_options_are_checked() -> None:
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="redo_log"):
            LocalCheckpoint("/tmp/x", redo_log=bad)  # type: ignore[arg-type]
    for bad_idle in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="compact_idle"):
            LocalCheckpoint("/tmp/x", redo_log=2, compact_idle=bad_idle)


def test_state_with_records_is_format_version_3_and_checked() -> None:
    ps = PersistedState(version=4, redo=((5, "a"), (6, None)))
    d = json.loads(ps.to_json())
    assert d["format_version"] == 3 and d["redo"] == [
        {"version": 5, "fingerprint": "a"},
        {"version": 6, "fingerprint": None},
    ]
    back = PersistedState.from_json(ps.to_json(), where="x")
    assert back.redo == ps.redo and back.head_version == 6 and back.version == 4
    for edit, why in (
        ({"redo": []}, "non-empty exactly"),
        ({"format_version": 1}, "non-empty exactly"),
        ({"redo": [{"version": 3}]}, "not after"),
        ({"redo": [{"version": 6}, {"version": 5}]}, "increasing"),
        ({"redo": [{"version": "5"}]}, "integer version"),
        ({"redo": {"version": 5}}, "must be a list"),
    ):
        with pytest.raises(Exception, match=why):
            PersistedState.from_json(json.dumps({**d, **edit}), where="x")


async def test_a_server_start_waits_while_records_are_held(tmp_path: Path) -> None:
    """The plugins' start-up load (clean_load) holds while records are held: the files are an
    older version than the receiver acknowledged."""
    root, ck = tmp_path / "root", tmp_path / "ck"
    async with Publisher(root, keyframe_interval=0) as pub:
        await _publish(pub, [], 2)
    eng = LocalCheckpoint(ck, redo_log=10, compact_idle=1e9)
    loads: list[int] = []
    log = logging.getLogger("test")
    async with ReceiverAgent(root, eng, "e", use_inotify=False, prefetch=False) as agent:
        await agent.sync_once()
        assert eng.redo_held == 2
        with pytest.raises(RuntimeError, match="still being patched"):
            load_whole_version(ck, lambda: loads.append(1), log, wait=0.3)
        assert loads == []
    # closed: merged
    assert load_whole_version(ck, lambda: loads.append(1) or 7, log, wait=0.3) == 7
    assert StateStore(ck / ".asyncsync").load().redo == ()  # type: ignore[union-attr]


async def test_verify_checks_the_files_version_and_says_records_are_held(tmp_path: Path) -> None:
    from asyncsync.errors import ConfigError
    from asyncsync.ops.cli.verify import verify_checkpoint_dir

    root, ck = tmp_path / "root", tmp_path / "ck"
    async with _running(root, ck, 10) as (eng, pub, agent):
        await _publish(pub, [], 2)
        await agent.sync_once()
        assert eng.redo_held == 2
        report = verify_checkpoint_dir(root, ck)
        assert report.ok and report.version == 0
        assert report.note is not None and "2 redo records (v1..v2)" in report.note
        assert "the receiver holds v2" in report.describe()
        with pytest.raises(ConfigError, match="its files are at v0, not v2"):
            verify_checkpoint_dir(root, ck, 2)
    report = verify_checkpoint_dir(root, ck)  # merged at close
    assert report.ok and report.version == 2 and report.note is None


def test_the_receiver_option_is_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from receiver.cli import main

    base = ["--root", str(tmp_path / "r"), "--engine-id", "e", "--checkpoint", str(tmp_path / "c")]
    assert main([*base, "--checkpoint-redo-log", "2", "--vllm-url", "http://127.0.0.1:9"]) == 2
    assert "--checkpoint-redo-log is for a checkpoint the receiver alone keeps" in (
        capsys.readouterr().err
    )
    assert main([*base, "--checkpoint-redo-log", "-1"]) == 2
    assert "--checkpoint-redo-log" in capsys.readouterr().err
    assert main([*base, "--checkpoint-redo-log", "2", "--checkpoint-compact-idle", "0"]) == 2
    assert "--checkpoint-compact-idle" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()  # refused before anything was opened


async def _four_records(root: Path, ck: Path) -> list[dict[str, torch.Tensor]]:
    """v0 and four deltas published (the last changes two tensors only), then a checkpoint
    left holding v0 in its files and v1..v4 as records (its receiver killed): every state."""
    async with Publisher(root, keyframe_interval=0) as pub:
        sds = await _publish(pub, [], 3)
        sds.append(mutate(sds[-1], 0.05, seed=4, names=[_PATCHED, "model.layers.0.weight"]))
        await pub.publish(sds[-1])
    eng = LocalCheckpoint(ck, redo_log=10, compact_idle=1e9)
    await eng.open()
    async with ReceiverAgent(root, eng, "e", use_inotify=False, prefetch=False) as agent:
        assert await agent.sync_once() == 4
        assert eng.redo_held == 4
        eng._store.close()  # a kill: nothing merged at close
        eng._ps = PersistedState()
    return sds


_PATCHED = "model.layers.2.weight"  # patched by every record


@pytest.mark.parametrize("sync_before_ack", [False, True])  # progressive / durable undo records
async def test_a_compaction_hashes_each_tensor_in_its_last_pass_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sync_before_ack: bool
) -> None:
    """A compaction of four records, most tensors patched by each: every pass took each
    tensor's checksum as it patched it, though only the last pass over a tensor gives its
    final digest (the others were thrown away). Each tensor is hashed once now, in its last
    pass, to the newest version's checksum; the files are those an in-place receiver writes,
    byte for byte, and the state records the same checksums."""
    root = tmp_path / "root"
    sds = await _four_records(root, tmp_path / "ck")
    changed = {
        n for n in sds[0]
        if any(not torch.equal(raw_view(a[n]), raw_view(b[n])) for a, b in itertools.pairwise(sds))
    }  # fmt: skip
    digests: list[str] = []
    real = inplace.patch_and_checksum

    def counted(*args: Any, **kw: Any) -> str:
        digests.append(real(*args, **kw))
        return digests[-1]

    real_run = inplace.JournalPass.run

    def counted_run(self: Any, journal: Any) -> str | None:  # a progressive record's pass
        digest = real_run(self, journal)
        if digest is not None:  # (one that hashes: not a pass a later record patches again)
            digests.append(digest)
        return digest

    monkeypatch.setattr(inplace, "patch_and_checksum", counted)
    monkeypatch.setattr(inplace.JournalPass, "run", counted_run)
    eng = LocalCheckpoint(tmp_path / "ck", sync_before_ack=sync_before_ack)
    assert (await eng.open()).version == 4  # the records compacted
    monkeypatch.undo()
    assert_holds(eng.load_state_dict(), sds[4])
    await eng.close()
    m4 = read_manifest(root, 4)
    assert sorted(digests) == sorted(e.checksum for e in m4.tensors if e.name in changed)
    assert verify_checkpoint(tmp_path / "ck", m4) == []
    assert await _sync(root, LocalCheckpoint(tmp_path / "inplace")) == 4
    assert _files_digest(tmp_path / "ck") == _files_digest(tmp_path / "inplace")
    assert _state(tmp_path / "ck")["checksums"] == _state(tmp_path / "inplace")["checksums"]


@pytest.mark.parametrize("sync_before_ack", [False, True])
async def test_a_compaction_over_a_wrong_base_is_wiped_and_reinitialised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, sync_before_ack: bool
) -> None:
    """The files held other bytes than the records' base (a byte flipped in a tensor that every
    record patches, its stamp kept): the compaction, which hashes that tensor in its last pass
    only, still finds it (ChecksumMismatch), wipes the files, and the receiver applies the
    versions again from the keyframe, bit-exact."""
    root, ck = tmp_path / "root", tmp_path / "ck"
    sds = await _four_records(root, ck)
    flip_tensor_byte(ck, _PATCHED, keep_mtime=True)
    eng = LocalCheckpoint(ck, sync_before_ack=sync_before_ack)
    with caplog.at_level(logging.ERROR):
        assert (await eng.open()).version is None  # the records compacted: a mismatch, wiped
    assert "not the base the records apply on" in caplog.text and _PATCHED in caplog.text
    assert _state(ck)["version"] is None and not list(ck.glob("model*.safetensors"))
    assert await _sync(root, eng) == 4
    assert verify_checkpoint(ck, read_manifest(root, 4)) == []
    assert_holds(LocalCheckpoint(ck).load_state_dict(), sds[4])


def _damage_record(redo: Path, how: str) -> None:
    """A record in ``redo`` damaged on disk, its trailer still whole JSON: one xef-coded patch
    of v2's, or the trailer of the newest (v4), which gives the merged files' checksums."""
    path = sorted(redo.iterdir())[3 if how in ("algorithm", "names", "nested") else 1]
    if how == "nested":  # the trailer whole JSON nested too deeply to parse (RecursionError)
        data = path.read_bytes()
        tlen, magic = struct.unpack("<Q8s", data[-16:])
        trailer = b"[" * 100_000 + b"]" * 100_000
        path.write_bytes(data[: -16 - tlen] + trailer + struct.pack("<Q8s", len(trailer), magic))
        return
    rec = Record.open(path)
    try:
        at = next(e.pos_at for e in rec.entries.values() if e.enc == "xef")
    finally:
        rec.close()
    data = path.read_bytes()
    if how == "positions":  # the Elias-Fano blob's header byte: the decoder refuses it
        data = data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1 :]
    elif how == "coding":  # the chunk header's name of its coding: an unknown one
        data = data.replace(b'"xef"', b'"hef"', 1)
    elif how == "algorithm":  # the trailer's checksum algorithm: an unknown one
        data = data.replace(b'"xxh3-', b'"hxh3-', 1)
    else:  # a tensor's name in the trailer's checksums: another tensor set
        data = data.replace(b'"model.scalar":', b'"model.scalaR":', 1)
    assert data != path.read_bytes()
    path.write_bytes(data)


@pytest.mark.parametrize("how", ["positions", "coding", "algorithm", "names", "nested"])
async def test_a_record_damaged_on_disk_is_wiped_not_merged_again_for_ever(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    """A record whose trailer reads but one of whose patches does not decode, or whose trailer
    names an unknown checksum algorithm or other tensors (a bit flipped on the local disk), or
    is JSON nested too deeply to parse (a RecursionError, which no handler took: the lead):
    the compaction at open was rolled back ("the records are kept and merged again later") or
    refused, and every open after it failed the same way: the receiver could never start
    again. It is a record that cannot be read: the files are removed and the receiver
    re-initialises them from a keyframe, bit-exact."""
    root, ck = tmp_path / "root", tmp_path / "ck"
    sds = await _four_records(root, ck)
    _damage_record(ck / ".asyncsync" / "redo", how)
    eng = LocalCheckpoint(ck)
    with caplog.at_level(logging.ERROR):
        assert (await eng.open()).version is None
    assert "a redo record cannot be read" in caplog.text and ".rec" in caplog.text
    assert _state(ck)["version"] is None and not list(ck.glob("model*.safetensors"))
    assert not list((ck / ".asyncsync" / "redo").iterdir())
    assert await _sync(root, eng) == 4
    assert verify_checkpoint(ck, read_manifest(root, 4)) == []
    assert_holds(LocalCheckpoint(ck).load_state_dict(), sds[4])


async def test_a_compaction_after_one_whose_rollback_failed_undoes_it_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compaction failed midway (a full disk) and its rollback failed too (the files half
    patched, its undo records kept for a retry): the next compaction cleared those undo
    records and patched the records over the half-patched files, found a mismatch and wiped
    the checkpoint (the whole model shipped again). It finishes the rollback first, then
    merges: the files end at the version acknowledged, bit-exact."""
    root, ck = tmp_path / "root", tmp_path / "ck"
    sds = await _four_records(root, ck)
    real = inplace.journal_and_patch
    calls: list[int] = []

    def patch_then_fail(*args: Any, **kw: Any) -> Any:
        calls.append(1)
        out = real(*args, **kw)
        if len(calls) == 2:  # two groups patched, then the disk is full
            raise OSError(28, "injected: no space left")
        return out

    eng = LocalCheckpoint(ck, redo_log=10, compact_idle=1e9)
    real_undo = eng._undo

    def undo_fails_once(*args: Any, **kw: Any) -> None:
        if len(calls) <= 2:
            calls.append(1)
            raise OSError(5, "injected: the undo failed")
        real_undo(*args, **kw)

    with monkeypatch.context() as m:
        m.setattr("receiver.engines.checkpoint.redolog._GROUP_BYTES", 1)  # a group a tensor
        m.setattr(inplace, "journal_and_patch", patch_then_fail)
        m.setattr(eng, "_undo", undo_fails_once)
        assert (await eng.open()).version == 4  # the compaction at open failed: kept
        assert eng._undo_pending is not None and eng.redo_held == 4
    await eng.close()  # compacted at close
    assert _state(ck)["version"] == 4 and "redo" not in _state(ck)  # was: None (wiped)
    assert verify_checkpoint(ck, read_manifest(root, 4)) == []
    assert_holds(LocalCheckpoint(ck).load_state_dict(), sds[4])


async def test_a_directory_in_the_redo_directory_is_removed_at_open(tmp_path: Path) -> None:
    """Anything in ``redo/`` no state names is removed at open (a record cut short by a kill,
    ``.redo-*.part``): a directory there (``mkdir redo/old``, a copy put back) failed every
    open with IsADirectoryError, the receiver never started. It goes as in journal/ and
    staging/ (StateStore.clear_dir); the records named are merged."""
    root, ck = tmp_path / "root", tmp_path / "ck"
    sds = await _four_records(root, ck)
    redo = ck / ".asyncsync" / "redo"
    (redo / "old").mkdir()
    (redo / "old" / "redo-000000000001.rec").write_bytes(b"junk")
    (redo / ".redo-000000000005.rec.part").write_bytes(b"cut short")
    eng = LocalCheckpoint(ck)
    assert (await eng.open()).version == 4  # was: ApplyFailed, IsADirectoryError
    assert not list(redo.iterdir()) and "redo" not in _state(ck)
    assert_holds(eng.load_state_dict(), sds[4])
    await eng.close()


async def test_records_kept_at_open_with_the_log_off_are_merged_before_a_delta(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Records held, the receiver restarted without a redo log and the compaction at open
    failed (a full disk: the records kept): the next delta was patched in place over the
    files, which held an older version than its base (a mismatch, the model shipped again
    from a keyframe). A delta's begin merges records held first whatever the log's N."""
    root, ck = tmp_path / "root", tmp_path / "ck"
    async with Publisher(root, keyframe_interval=0) as pub:
        sds = await _publish(pub, [], 3)
        eng = LocalCheckpoint(ck, redo_log=10, compact_idle=1e9)
        async with ReceiverAgent(root, eng, "e", use_inotify=False, prefetch=False) as agent:
            assert await agent.sync_once() == 3
            eng._store.close()  # a kill: nothing merged at close
            eng._ps = PersistedState()
        real = LocalCheckpoint._compact
        with monkeypatch.context() as m:

            def no_room(self: LocalCheckpoint, why: str) -> None:
                raise ApplyFailed("injected: no space left")

            m.setattr(LocalCheckpoint, "_compact", no_room)
            eng = LocalCheckpoint(ck)  # redo_log=0
            assert (await eng.open()).version == 3 and eng.redo_held == 3
        assert LocalCheckpoint._compact is real
        await _publish(pub, sds, 4)
        with caplog.at_level(logging.WARNING):
            assert await _sync(root, eng) == 4
        assert "does not apply" not in caplog.text  # was: a mismatch, re-seeded
        assert "redo" not in _state(ck) and _state(ck)["version"] == 4
    assert verify_checkpoint(ck, read_manifest(root, 4)) == []
    assert_holds(LocalCheckpoint(ck).load_state_dict(), sds[4])


async def test_an_unopened_checkpoint_does_not_load_files_older_than_its_records(
    tmp_path: Path,
) -> None:
    """``LocalCheckpoint(dir).load_state_dict()`` without ``open()`` (a script reading what a
    receiver left, as ``asyncsync demo`` does) over a checkpoint holding redo records (its
    receiver killed): it returned the files' older version, v0, while the state and the ack
    named v4, without a word. It refuses (EngineStateError naming the records and what to do),
    as it does a version being applied; opened, the records are merged and v4 returned."""
    from asyncsync.errors import EngineStateError

    root, ck = tmp_path / "root", tmp_path / "ck"
    sds = await _four_records(root, ck)
    with pytest.raises(EngineStateError, match="4 redo records"):
        LocalCheckpoint(ck).load_state_dict()
    st = _state(ck)
    (ck / ".asyncsync" / "state.json").write_text(
        json.dumps({**{k: v for k, v in st.items() if k != "redo"}, "format_version": 1,
                    "status": "applying", "target_version": 1, "mode": "delta"})
    )  # fmt: skip
    with pytest.raises(EngineStateError, match="being applied"):
        LocalCheckpoint(ck).load_state_dict()
    (ck / ".asyncsync" / "state.json").write_text(json.dumps(st))
    eng = LocalCheckpoint(ck)
    await eng.open()
    assert_holds(eng.load_state_dict(), sds[4])
    await eng.close()
    assert_holds(LocalCheckpoint(ck).load_state_dict(), sds[4])  # merged: loadable as it lies


async def test_a_load_whose_merge_removed_the_files_raises_not_an_empty_dict(
    tmp_path: Path,
) -> None:
    """An open engine holding records, one damaged on disk since: ``load_state_dict`` merges
    first, which finds it and removes the files (the receiver re-initialises them); the load
    then returned ``{}``, a model of no tensors. It raises EngineStateError saying so."""
    from asyncsync.errors import EngineStateError

    root, ck = tmp_path / "root", tmp_path / "ck"
    async with Publisher(root, keyframe_interval=0) as pub:
        await _publish(pub, [], 2)
    eng = LocalCheckpoint(ck, redo_log=10, compact_idle=1e9)
    async with ReceiverAgent(root, eng, "e", use_inotify=False, prefetch=False) as agent:
        assert await agent.sync_once() == 2 and eng.redo_held == 2
        _damage_record(ck / ".asyncsync" / "redo", "coding")
        with pytest.raises(EngineStateError, match="removed"):
            eng.load_state_dict()  # was: {}
        assert eng.state.version is None
