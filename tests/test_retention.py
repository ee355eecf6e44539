"""Retention: ack-aware, keyframe-preserving deletion of old versions; `asyncsync gc`."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from asyncsync import ConfigError, Publisher
from asyncsync.format import store
from asyncsync.format.acks import write_ack
from asyncsync.format.lease import LeaseRecord, lease_path
from asyncsync.format.liveness import WATCH_LIMIT
from asyncsync.format.store import list_versions, read_root_info
from asyncsync.ops.cli import main
from asyncsync.publish.retention import ManifestKinds, RetentionPolicy, collect
from receiver import ReceiverAgent
from receiver.engines.checkpoint import LocalCheckpoint
from tests.conftest import mixed_state, mutate, same_bytes
from tests.test_lease import heartbeats, renewing


async def chain(
    root: Path, n: int, keyframe_interval: int, **kw: object
) -> list[dict[str, torch.Tensor]]:
    states = [mixed_state(0)]
    async with Publisher(root, keyframe_interval=keyframe_interval, **kw) as pub:  # type: ignore[arg-type]
        await pub.seed(states[0])
        for i in range(1, n + 1):
            states.append(mutate(states[-1], 0.02, seed=i))
            await pub.publish(states[-1])
    return states


def test_policy_validation() -> None:
    for bad in [dict(keep_versions=0), dict(keep_bytes=0), dict(ack_ttl=-1)]:
        with pytest.raises(ConfigError):
            RetentionPolicy(**bad)  # type: ignore[arg-type]


async def test_keeps_newest_keyframe_chain_and_count(tmp_path: Path) -> None:
    await chain(tmp_path, 11, keyframe_interval=4)  # keyframes at 0, 4, 8
    report = collect(tmp_path, RetentionPolicy(keep_versions=2, ack_ttl=None))
    # the newest keyframe (8) and its chain survive even though keep_versions is 2
    assert list_versions(tmp_path) == [8, 9, 10, 11]
    assert report.deleted == tuple(range(8))
    assert "keyframe" in report.reasons[8]
    assert not any(
        p.name.startswith("v0000000000") and not (p / "manifest.json").exists()
        for p in tmp_path.iterdir()
        if p.is_dir()
    )


async def test_live_engine_pins_what_it_needs_dead_one_does_not(tmp_path: Path) -> None:
    await chain(tmp_path, 9, keyframe_interval=4)  # keyframes 0, 4, 8
    run_id = read_root_info(tmp_path).run_id  # type: ignore[union-attr]
    write_ack(tmp_path, "live", 2, "ab" * 16, run_id)
    collect(tmp_path, RetentionPolicy(keep_versions=1, ack_ttl=600))
    assert list_versions(tmp_path) == list(range(3, 10))  # 3.. needed by the engine at 2
    # the same engine, silent for longer than the TTL, no longer pins anything
    import json

    p = tmp_path / "acks" / "live.json"
    d = json.loads(p.read_text())
    d["applied_at"] = time.time() - 10_000
    p.write_text(json.dumps(d))
    old = time.time() - 10_000  # silence is measured by the ack file's mtime (one clock)
    os.utime(p, (old, old))
    collect(tmp_path, RetentionPolicy(keep_versions=1, ack_ttl=600))
    assert list_versions(tmp_path) == [8, 9]


async def test_keep_bytes(tmp_path: Path) -> None:
    await chain(tmp_path, 6, keyframe_interval=0)  # only v0 is a keyframe: nothing deletable
    assert collect(tmp_path, RetentionPolicy(keep_versions=1, keep_bytes=1)).deleted == ()
    await chain(tmp_path / "b", 6, keyframe_interval=3)  # keyframes 0, 3, 6
    r = collect(tmp_path / "b", RetentionPolicy(keep_versions=None, keep_bytes=10**9))
    assert r.deleted == ()  # everything fits
    r = collect(tmp_path / "b", RetentionPolicy(keep_versions=None, keep_bytes=1))
    assert list_versions(tmp_path / "b") == [6] and r.freed_bytes > 0


async def test_engine_that_fell_off_the_chain_catches_up(tmp_path: Path) -> None:
    root = tmp_path / "root"
    states = [mixed_state(0)]
    ckpt = tmp_path / "ckpt"
    async with Publisher(root, keyframe_interval=3) as pub:
        await pub.seed(states[0])
        async with ReceiverAgent(root, LocalCheckpoint(ckpt), "slow", use_inotify=False) as a:
            assert await a.sync_once() == 0
        for i in range(1, 8):
            states.append(mutate(states[-1], 0.02, seed=i))
            await pub.publish(states[-1])
    # the slow engine's ack (v0) is stale: versions 1..5 go, keyframe 6 and v7 stay
    collect(root, RetentionPolicy(keep_versions=1, ack_ttl=1e-9))
    assert list_versions(root) == [6, 7]
    async with ReceiverAgent(root, LocalCheckpoint(ckpt), "slow", use_inotify=False) as a:
        assert await a.sync_once() == 7
        held = a.engine.load_state_dict()  # type: ignore[attr-defined]
    assert all(same_bytes(held[k], v) for k, v in states[7].items())


async def test_publisher_applies_retention_after_each_commit(tmp_path: Path) -> None:
    await chain(tmp_path, 8, keyframe_interval=4, retention=RetentionPolicy(keep_versions=2))
    # keyframes 0, 4, 8: the newest two versions and keyframe 8 survive the last commit
    assert list_versions(tmp_path) == [7, 8]


async def test_a_publishers_retention_parses_each_manifest_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The retention after each commit looks back to the newest keyframe: it parsed every
    manifest on the way at every commit (~100 ms a commit at 183 tensors and a keyframe every
    20 versions). A publisher's parses each once."""
    parsed: list[int] = []
    real = store.read_manifest

    def counted(root: Path, version: int) -> object:
        parsed.append(version)
        return real(root, version)

    monkeypatch.setattr(store, "read_manifest", counted)  # (what ManifestKinds reads with)
    await chain(tmp_path, 12, keyframe_interval=10, retention=RetentionPolicy(keep_versions=3))
    assert sorted(parsed) == list(range(13))  # (v0 once, before any commit deleted it)
    assert list_versions(tmp_path) == [10, 11, 12]


async def test_a_manifest_changed_since_its_kind_was_read_is_read_again(tmp_path: Path) -> None:
    """The kinds are kept by the manifest file's size, mtime and inode: a manifest damaged or
    replaced after a collect read it is read again, not taken for what it was."""
    await chain(tmp_path, 7, keyframe_interval=3)  # keyframes 0, 3, 6
    kinds = ManifestKinds()
    policy = RetentionPolicy(keep_versions=1, ack_ttl=None)
    assert collect(tmp_path, policy, kinds=kinds).deleted == (0, 1, 2, 3, 4, 5)
    (tmp_path / f"v{6:012d}" / "manifest.json").write_text("{")  # the keyframe, damaged
    r = collect(tmp_path, policy, kinds=kinds)
    assert r.deleted == () and r.reasons[6] == "unreadable manifest"
    assert r.reasons[7] == "no keyframe: the whole chain is needed"


async def test_gc_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    await chain(tmp_path, 7, keyframe_interval=3)  # keyframes 0, 3, 6
    assert main(["gc", str(tmp_path), "--keep-versions", "1", "--dry-run"]) == 0
    assert "would delete 6 versions" in capsys.readouterr().out
    assert list_versions(tmp_path) == list(range(8))
    assert main(["gc", str(tmp_path), "--keep-versions", "1", "-v"]) == 0
    out = capsys.readouterr().out
    assert "deleted 6 versions" in out and "keep v6: newest keyframe" in out
    assert list_versions(tmp_path) == [6, 7]
    assert main(["gc", str(tmp_path / "nope")]) == 1
    assert main(["gc", str(tmp_path), "--keep-versions", "0"]) == 2


def test_policy_validation_messages() -> None:
    """Each bound, at its edge: 0 is refused for every field, with the field named."""
    for bad, field in [
        (dict(keep_versions=0), "keep_versions"),
        (dict(keep_bytes=0), "keep_bytes"),
        (dict(ack_ttl=0), "ack_ttl"),
        (dict(ack_ttl=-1), "ack_ttl"),
        # the wrong type or NaN (accepted before: seed() then failed after committing v0)
        (dict(keep_versions=float("nan")), "keep_versions"),
        (dict(keep_versions=1.5), "keep_versions"),
        (dict(keep_bytes=float("inf")), "keep_bytes"),
        (dict(ack_ttl=float("nan")), "ack_ttl"),
        (dict(ack_ttl=True), "ack_ttl"),
    ]:
        with pytest.raises(ConfigError, match=f"{field} must be"):
            RetentionPolicy(**bad)  # type: ignore[arg-type]
    RetentionPolicy(keep_versions=1, keep_bytes=1, ack_ttl=1e-9)  # the smallest allowed


def _files_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


async def test_freed_bytes_are_the_deleted_files_and_a_dry_run_deletes_nothing(
    tmp_path: Path,
) -> None:
    await chain(tmp_path, 7, keyframe_interval=3)  # keyframes 0, 3, 6
    sizes = {v: _files_bytes(tmp_path / f"v{v:012d}") for v in list_versions(tmp_path)}
    log = (tmp_path / "log.jsonl").read_bytes()
    policy = RetentionPolicy(keep_versions=1, ack_ttl=None)
    dry = collect(tmp_path, policy, dry_run=True)
    assert dry.deleted == tuple(range(6))
    assert dry.freed_bytes == sum(sizes[v] for v in range(6))
    assert list_versions(tmp_path) == list(range(8))
    assert (tmp_path / "log.jsonl").read_bytes() == log  # not trimmed either
    real = collect(tmp_path, policy)
    assert (real.deleted, real.freed_bytes) == (dry.deleted, dry.freed_bytes)
    assert list_versions(tmp_path) == [6, 7]
    assert (tmp_path / "log.jsonl").read_bytes() != log
    assert real.reasons == {6: "newest keyframe and its chain", 7: "newest keyframe and its chain"}
    assert collect(tmp_path, policy).deleted == ()


async def test_keep_bytes_keeps_what_fits_exactly(tmp_path: Path) -> None:
    await chain(tmp_path, 6, keyframe_interval=3)  # keyframes 0, 3, 6
    sizes = {v: _files_bytes(tmp_path / f"v{v:012d}") for v in list_versions(tmp_path)}
    fits = sizes[6] + sizes[5]
    r = collect(
        tmp_path, RetentionPolicy(keep_versions=None, keep_bytes=fits, ack_ttl=None), dry_run=True
    )
    assert r.kept == (5, 6) and r.reasons[5] == f"within {fits} bytes"
    r = collect(tmp_path, RetentionPolicy(keep_versions=None, keep_bytes=fits - 1, ack_ttl=None))
    assert r.kept == (6,) and list_versions(tmp_path) == [6]


async def test_a_silent_engine_does_not_hide_a_live_one(tmp_path: Path) -> None:
    """Every ack is weighed: a dead engine's ack, whichever order the acks are read in, never
    stops the others from pinning what they need."""
    await chain(tmp_path, 9, keyframe_interval=4)  # keyframes 0, 4, 8
    run_id = read_root_info(tmp_path).run_id  # type: ignore[union-attr]
    old = time.time() - 10_000
    for dead in ("a-dead", "m-dead", "z-dead"):
        write_ack(tmp_path, dead, 0, "ab" * 16, run_id)
        os.utime(tmp_path / "acks" / f"{dead}.json", (old, old))
    write_ack(tmp_path, "live", 2, "ab" * 16, run_id)
    r = collect(tmp_path, RetentionPolicy(keep_versions=1, ack_ttl=600))
    assert list_versions(tmp_path) == list(range(3, 10))
    assert all(r.reasons[v] == "engine live at 2 needs it" for v in range(3, 8))


async def test_an_unreadable_manifest_is_kept_and_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    await chain(tmp_path, 7, keyframe_interval=3)  # keyframes 0, 3, 6
    (tmp_path / f"v{7:012d}" / "manifest.json").write_text("{")
    with caplog.at_level("WARNING"):
        r = collect(tmp_path, RetentionPolicy(keep_versions=1, ack_ttl=None))
    assert r.reasons[7] == "unreadable manifest" and list_versions(tmp_path) == [6, 7]
    assert "gc: cannot read version 7" in caplog.text and "keeping it" in caplog.text


def test_gc_of_an_empty_root(tmp_path: Path) -> None:
    r = collect(tmp_path, RetentionPolicy())
    assert (r.deleted, r.kept, r.freed_bytes, r.reasons) == ((), (), 0, {})


async def test_without_a_readable_keyframe_gc_keeps_the_whole_chain(tmp_path: Path) -> None:
    await chain(tmp_path, 5, keyframe_interval=0)  # only v0 is a keyframe
    (tmp_path / f"v{0:012d}" / "manifest.json").write_text("{")
    r = collect(tmp_path, RetentionPolicy(keep_versions=1, ack_ttl=None))
    assert r.deleted == () and list_versions(tmp_path) == list(range(6))
    assert r.reasons[0] == "unreadable manifest"
    assert all(r.reasons[v] == "no keyframe: the whole chain is needed" for v in range(1, 6))


async def test_an_unreadable_ack_dated_long_ago_pins_every_version_while_its_lease_renews(
    tmp_path: Path,
) -> None:
    """The receiver of e1 runs on a host whose clock is two hours behind (its files keep that
    clock's mtimes, as on an object-store mount) and its ack cannot be read: dated two hours
    back (ack_ttl 600 s), it pinned nothing, and gc deleted what e1 may need. Its lease, seen
    renewed, keeps every version now; a lease seen unchanged for its ttl pins nothing."""
    await chain(tmp_path, 9, keyframe_interval=4)  # keyframes 0, 4, 8
    ack = tmp_path / "acks" / "e1.json"
    ack.parent.mkdir(exist_ok=True)
    ack.write_bytes(b"\x00\xff not json")
    t = time.time() - 2 * 3600
    os.utime(ack, (t, t))
    rec = LeaseRecord("e1", "f" * 16, "other-host", 4242, 0.5, 0.0, 0.0)
    policy = RetentionPolicy(keep_versions=1, ack_ttl=600)
    with renewing(lease_path(tmp_path, "e1"), heartbeats(rec), every=0.1, behind=2 * 3600):
        while not lease_path(tmp_path, "e1").exists():  # its first heartbeat
            time.sleep(0.01)
        report = collect(tmp_path, policy, watch=WATCH_LIMIT)
    assert list_versions(tmp_path) == list(range(10)) and not report.deleted
    assert "cannot be read" in report.reasons[0], report.reasons[0]
    collect(tmp_path, policy)  # the receiver stopped: its last heartbeat may be news here
    time.sleep(1.0)  # then its lease stays unchanged for longer than its ttl
    collect(tmp_path, policy)
    assert list_versions(tmp_path) == [8, 9]


@pytest.mark.parametrize("damage", ["acks a symlink", "acks a file", "ack a fifo", "ack garbage"])
async def test_acks_it_cannot_read_pin_every_version(tmp_path: Path, damage: str) -> None:
    """(attack-60) ``acks/`` a symlink or a file, or a live engine's ack a FIFO or bytes that
    are no record: gc went on as if no engine had acked and deleted the versions that engine
    needed (one warning, exit 0). Whose version such an ack pins is unknown: gc deletes
    nothing while it cannot be read (an unreadable ack file older than ack_ttl pins nothing)."""
    await chain(tmp_path, 9, keyframe_interval=4)  # keyframes 0, 4, 8
    run_id = read_root_info(tmp_path).run_id  # type: ignore[union-attr]
    write_ack(tmp_path, "live", 2, "ab" * 16, run_id)
    acks, ack = tmp_path / "acks", tmp_path / "acks" / "live.json"
    if damage == "acks a symlink":
        acks.rename(tmp_path.parent / f"{tmp_path.name}-acks")
        acks.symlink_to(tmp_path.parent / f"{tmp_path.name}-acks")
    elif damage == "acks a file":
        ack.unlink()
        acks.rmdir()
        acks.write_text("not a directory\n")
    elif damage == "ack a fifo":
        ack.unlink()
        os.mkfifo(ack)
    else:
        ack.write_bytes(b"\x00\xff not json")
    policy = RetentionPolicy(keep_versions=1, ack_ttl=600)
    report = collect(tmp_path, policy)
    assert list_versions(tmp_path) == list(range(10)) and not report.deleted
    assert "cannot be read" in report.reasons[0], report.reasons[0]
    if damage.startswith("ack "):  # silent for longer than the TTL: it pins nothing
        old = time.time() - 10_000
        os.utime(ack, (old, old))
        collect(tmp_path, policy)
        assert list_versions(tmp_path) == [8, 9]


@pytest.mark.parametrize("readable", [True, False])
async def test_a_dead_engines_ack_dated_ahead_pins_only_while_its_lease_renews(
    tmp_path: Path, readable: bool
) -> None:
    """(attack-85) A receiver whose clock ran two hours ahead (its files keep that clock's
    mtimes, as on an object-store mount) acked v2 and is gone: its ack, dated in the future,
    read as 0 s old (an unreadable one as written just now) and pinned 3.. (everything) until
    the file server's clock caught up, whatever ack_ttl said. Dated more than ack_ttl ahead,
    its lease decides, as for one dated more than ack_ttl back: renewed, it keeps them; none,
    they go."""
    await chain(tmp_path, 9, keyframe_interval=4)  # keyframes 0, 4, 8
    run_id = read_root_info(tmp_path).run_id  # type: ignore[union-attr]
    ack = tmp_path / "acks" / "e1.json"
    if readable:
        write_ack(tmp_path, "e1", 2, "ab" * 16, run_id)
    else:
        ack.parent.mkdir(exist_ok=True)
        ack.write_bytes(b"\x00\xff not json")
    t = time.time() + 2 * 3600
    os.utime(ack, (t, t))
    policy = RetentionPolicy(keep_versions=1, ack_ttl=600)
    rec = LeaseRecord("e1", "f" * 16, "other-host", 4242, 0.5, 0.0, 0.0)
    with renewing(lease_path(tmp_path, "e1"), heartbeats(rec), every=0.1, behind=-2 * 3600):
        while not lease_path(tmp_path, "e1").exists():  # its first heartbeat
            time.sleep(0.01)
        report = collect(tmp_path, policy, watch=WATCH_LIMIT)  # live: kept
    assert list_versions(tmp_path) == list(range(3 if readable else 0, 10)), report.reasons
    lease_path(tmp_path, "e1").unlink()  # its receiver is gone, and its lease with it
    collect(tmp_path, policy)
    assert list_versions(tmp_path) == [8, 9]
