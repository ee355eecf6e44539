"""A real receiver process keeping its checkpoint with a redo log (``--checkpoint-redo-log``),
SIGKILLed at each step of a record's commit and of a compaction (tests/redo_killer.py), then
started again: the files end bit-exact at the newest published version, no record left; and
a byte flipped in a data file between versions is found at the compaction, which removes the
files so the receiver re-initialises from a keyframe and ends bit-exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncsync import Publisher
from asyncsync.format.acks import read_acks
from asyncsync.format.store import read_manifest
from receiver.engines.checkpoint import LocalCheckpoint, verify_checkpoint

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"l.{i}.w": torch.randn(32 << 10, generator=g).to(torch.bfloat16) for i in range(6)}


def _step(sd: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, t in sd.items():
        t = t.clone()
        m = torch.rand(t.numel(), generator=g) < 0.03
        t[m] = (t[m].float() * 1.01 + 0.01).to(torch.bfloat16)
        out[k] = t
    return out


async def _publish(pub: Publisher, sds: list[dict[str, torch.Tensor]], upto: int) -> None:
    if not sds:
        sds.append(_model(0))
        await pub.seed(sds[0])
    while len(sds) <= upto:
        sds.append(_step(sds[-1], len(sds)))
        await pub.publish(sds[-1])


def _args(root: Path, ck: Path, *extra: str) -> list[str]:
    return ["--root", str(root), "--engine-id", "e", "--checkpoint", str(ck), "--force-polling",
            "--poll-interval", "0.1", "--checkpoint-redo-log", "2", *extra]  # fmt: skip


def _state(ck: Path) -> dict[str, Any]:
    st: dict[str, Any] = json.loads((ck / ".asyncsync" / "state.json").read_text())
    return st


async def _exact(root: Path, ck: Path, sd: dict[str, torch.Tensor], version: int) -> None:
    st = _state(ck)
    assert st["version"] == version and "redo" not in st, st
    assert not [p for p in (ck / ".asyncsync" / "redo").iterdir()]
    assert verify_checkpoint(ck, read_manifest(root, version)) == []
    eng = LocalCheckpoint(ck)
    await eng.open()
    try:
        got = eng.load_state_dict()
    finally:
        await eng.close()
    assert got.keys() == sd.keys()
    for k in sd:
        assert torch.equal(got[k].view(torch.int16), sd[k].view(torch.int16)), k


def _killed(root: Path, ck: Path, log: Path, point: str) -> None:
    """A receiver run (``--once``) by tests/redo_killer.py until it kills itself at ``point``."""
    with open(log, "wb") as out:
        killed = subprocess.run(
            [sys.executable, str(REPO / "tests" / "redo_killer.py"), point,
             *_args(root, ck, "--once")],
            stdout=out, stderr=out, cwd=REPO, env=ENV, timeout=300,
        )  # fmt: skip
    assert killed.returncode == -9, log.read_text()[-3000:]  # the point was reached


def _restarted(root: Path, ck: Path, log: Path) -> str:
    """A plain receiver run (``--once``) after it; the log so far."""
    with open(log, "ab") as out:
        again = subprocess.run(
            [sys.executable, "-m", "receiver.cli", *_args(root, ck, "--once")],
            stdout=out, stderr=out, cwd=REPO, env=ENV, timeout=300,
        )  # fmt: skip
    text = log.read_text()
    assert again.returncode == 0, text[-3000:]
    return text


@pytest.mark.slow
@pytest.mark.parametrize("point", ["record", "mid-compaction", "before-state", "after-state"])
async def test_killed_in_the_redo_log_then_restarted_is_bit_exact(
    tmp_path: Path, point: str
) -> None:
    root, ck, log = tmp_path / "root", tmp_path / "ck", tmp_path / "log"
    sds: list[dict[str, torch.Tensor]] = []
    async with Publisher(root, keyframe_interval=0) as pub:
        await _publish(pub, sds, 3)
        await _kill_and_restart(root, ck, log, pub, sds, point)
    await _exact(root, ck, sds[4], 4)


async def _kill_and_restart(
    root: Path, ck: Path, log: Path, pub: Publisher, sds: list[dict[str, torch.Tensor]], point: str
) -> None:
    _killed(root, ck, log, point)
    st = _state(ck)
    records = sorted(p.name for p in (ck / ".asyncsync" / "redo").iterdir())
    if point == "record":  # v1's record written, not named: never acknowledged
        assert st["version"] == 0 and "redo" not in st
        assert records == ["redo-000000000001.rec"]
        assert read_acks(root)["e"].version == 0
    elif point == "after-state":
        assert st["version"] == 2 and "redo" not in st and len(records) == 2
    else:  # v1, v2 named, the files at v0 (partly patched: mid-compaction)
        assert st["version"] == 0 and [r["version"] for r in st["redo"]] == [1, 2]
        assert st["status"] == "applying" and len(records) == 2
        assert read_acks(root)["e"].version == 2
    await _publish(pub, sds, 4)
    text = _restarted(root, ck, log)
    if point in ("record", "after-state"):
        assert "no state names it" in text
    else:
        assert "interrupted delta to v2; undoing" in text
        assert "compacted 2 redo records into v2 (open)" in text
    assert "re-initialises" not in text  # repaired, not wiped
    assert read_acks(root)["e"].version == 4


@pytest.mark.slow
async def test_killed_beside_an_earlier_compactions_undo_records_is_not_wiped(
    tmp_path: Path,
) -> None:
    """The first compaction's undo records kept (their removal failed), the receiver killed
    with SIGKILL once the next compaction's state says ``applying`` and before it clears the
    journal: the restart undoes that compaction without writing the earlier records' old bytes
    back (they were: the files mixed, found by the re-check, the checkpoint wiped)."""
    root, ck, log = tmp_path / "root", tmp_path / "ck", tmp_path / "log"
    sds: list[dict[str, torch.Tensor]] = []
    async with Publisher(root, keyframe_interval=0) as pub:
        await _publish(pub, sds, 3)
        _killed(root, ck, log, "stale-undo")
        st = _state(ck)
        assert (st["status"], st["version"], st["target_version"]) == ("applying", 2, 3), st
        assert [p for p in (ck / ".asyncsync" / "journal").iterdir()], "no record kept"
        await _publish(pub, sds, 4)
    text = _restarted(root, ck, log)
    assert "interrupted delta to v3; undoing" in text
    assert "re-initialises" not in text  # repaired, not wiped
    assert "is of v2, not of v3 being undone" in text
    assert read_acks(root)["e"].version == 4
    await _exact(root, ck, sds[4], 4)


@pytest.mark.slow
@pytest.mark.heavy  # a running receiver, idle compactions waited for: ~40 s on a loaded host
async def test_a_byte_flipped_between_versions_is_found_at_compaction(tmp_path: Path) -> None:
    root, ck, log = tmp_path / "root", tmp_path / "ck", tmp_path / "log"
    sds: list[dict[str, torch.Tensor]] = []
    async with Publisher(root, keyframe_interval=0) as pub:
        await _publish(pub, sds, 1)
        await _flip_between_versions(root, ck, log, pub, sds)
    await _exact(root, ck, sds[2], 2)


async def _flip_between_versions(
    root: Path, ck: Path, log: Path, pub: Publisher, sds: list[dict[str, torch.Tensor]]
) -> None:
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "receiver.cli",
             *_args(root, ck, "--checkpoint-compact-idle", "0.5")],
            stdout=out, stderr=out, cwd=REPO, env=ENV,
        )  # fmt: skip
    try:

        def wait(cond: Any, what: str) -> None:
            end = time.monotonic() + 120
            while not cond():
                assert proc.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < end, f"no {what}: {log.read_text()[-3000:]}"
                time.sleep(0.05)

        def at(version: int) -> bool:
            try:
                st = _state(ck)
            except (OSError, ValueError):
                return False
            a = read_acks(root).get("e")
            return (
                st["version"] == version
                and "redo" not in st
                and a is not None
                and (a.version == version)
            )

        wait(lambda: at(1), "v1 merged when idle")
        data = sorted(ck.glob("model*.safetensors"))[0]
        st = data.stat()
        with open(data, "r+b") as f:  # a byte of the last tensor's bytes, flipped on disk
            f.seek(-5, os.SEEK_END)
            b = f.read(1)
            f.seek(-5, os.SEEK_END)
            f.write(bytes([b[0] ^ 0x40]))
        # its mtime put back, so the data files' stamps (checkpoint/stamps.py, which would see
        # the edit at the next begin) do not: the compaction's checksums must
        os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
        await _publish(pub, sds, 2)
        wait(lambda: b"not the base the records apply on" in log.read_bytes(), "mismatch found")
        wait(lambda: at(2), "v2 again from the keyframe")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert proc.returncode == 0, log.read_text()[-3000:]


@pytest.mark.slow
async def test_a_record_damaged_while_the_receiver_was_down_is_wiped_at_restart(
    tmp_path: Path,
) -> None:
    """A receiver killed with two records held (mid-compaction), one of which then has a byte
    of its Elias-Fano positions flipped on disk: every restart failed ("rolled back, the
    records are kept and merged again later", exit 1), for good. The restart removes the
    files and re-initialises them from the keyframe, and ends bit-exact at the newest."""
    from tests.test_redolog import _damage_record

    root, ck, log = tmp_path / "root", tmp_path / "ck", tmp_path / "log"
    sds: list[dict[str, torch.Tensor]] = []
    async with Publisher(root, keyframe_interval=0) as pub:
        await _publish(pub, sds, 3)
        _killed(root, ck, log, "mid-compaction")
        assert [r["version"] for r in _state(ck)["redo"]] == [1, 2]
        _damage_record(ck / ".asyncsync" / "redo", "positions")
        await _publish(pub, sds, 4)
    for _ in range(2):  # the first run re-initialises; the second finds nothing to do
        _restarted(root, ck, log)  # was: exit 1, at every restart
    assert "a redo record cannot be read" in log.read_text()
    assert read_acks(root)["e"].version == 4
    await _exact(root, ck, sds[4], 4)
