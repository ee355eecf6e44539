"""The progressive undo journal of a LocalCheckpoint that acks before its data is durable.

The patch kernel (``journal_patch_hash``) saves each chunk's old values into the record's file
just before it patches the chunk, and then the count saved; undo writes back exactly those. Met
here: the C kernel against a reference (every width, sparse and dense, ranges, a failing
write), the record read back at any count, a real child process killed with SIGKILL at several
moments inside the kernel (the undo is exact from whatever the page cache holds), and the
machine-crash cases (a record torn or gone, pages lost): the engine checks every tensor and
re-initialises from a keyframe when one differs. ``tests/test_durability.py`` runs every crash
state of the same apply through the weak POSIX model.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash

from asyncsync.codec import (
    Patch,
    can_journal_in_pass,
    int_view,
    journal_patch,
    native,
    patch_and_checksum,
)
from asyncsync.errors import ConfigError, EngineStateError
from receiver.engines.checkpoint import LocalCheckpoint, journal
from receiver.state import PersistedState
from tests.test_engines import (
    REPO,
    apply_version,
    assert_same,
    build_manifest,
    delta_batches,
    init_checkpoint,
    xef_batches,
)

K: Any = native.kernels
needs_kernel = pytest.mark.skipif(
    K is None or not hasattr(K, "journal_patch_hash"), reason="the C kernels are not built"
)
DT = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


# ------------------------------------------------------------------------------ the C kernel


@needs_kernel
@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("is_xor", [True, False])
def test_kernel_saves_then_patches_and_hashes(
    tmp_path: Path, width: int, dense: bool, is_xor: bool
) -> None:
    rng = np.random.default_rng(width * 4 + dense * 2 + is_xor)
    n = 700_001  # several journal chunks, a tail that is not a whole block
    flat = rng.integers(0, 256, n * width, dtype=np.uint8).view(DT[width])
    orig = flat.copy()
    lo, hi, done = 13, n - 9, 5
    if dense:
        pos = None
        vals = rng.integers(0, 256, (hi - lo) * width, dtype=np.uint8).view(DT[width])
        saved = orig[lo:hi]
    else:
        pos = np.sort(rng.choice(np.arange(lo, hi), 20_000, replace=False)).astype(np.int64)
        vals = rng.integers(1, 256, pos.size * width, dtype=np.uint8).view(DT[width])
        saved = orig[pos]
    want = orig.copy()
    target = slice(lo, hi) if pos is None else pos
    want[target] = (want[target] ^ vals) if is_xor else vals
    fd = os.open(tmp_path / "j", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        h = native.hasher("xxh3-128")
        K.journal_patch_hash(flat, width, pos, vals, is_xor, lo, hi, h, fd, 64, 8, done)
    finally:
        os.close(fd)
    assert np.array_equal(flat, want)
    assert h.hexdigest() == xxhash.xxh3_128(want[lo:hi].tobytes()).hexdigest()
    data = (tmp_path / "j").read_bytes()
    count = saved.size  # positions, or the elements of [lo, hi): index j saved at done + j
    assert int.from_bytes(data[8:16], "little") == done + count
    start = 64 + done * width
    assert data[start : start + count * width] == saved.tobytes()


@needs_kernel
@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("op", ["xor", "set"])
@pytest.mark.parametrize("layout", [None, [(0, 300_000), (300_000, 400_001)]])
def test_journal_patch_is_the_hashed_pass_without_its_hash(
    tmp_path: Path, dense: bool, op: str, layout: list[tuple[int, int]] | None
) -> None:
    """``journal_patch`` (a compaction's pass over a tensor a later record patches again)
    leaves the tensor and the journal file byte for byte as ``patch_and_checksum`` with the
    same journal does, and refuses what that pass cannot take before it writes anything."""
    rng = np.random.default_rng(dense * 2 + (op == "xor"))
    n = 700_001
    orig = torch.from_numpy(rng.integers(-(2**15), 2**15, n, dtype=np.int16))
    pos = None if dense else torch.from_numpy(np.sort(rng.choice(n, 30_000, replace=False)))
    vals = torch.from_numpy(rng.integers(-(2**15), 2**15, n if dense else 30_000, dtype=np.int16))
    patch = Patch(op, pos, vals)  # type: ignore[arg-type]
    out = {}
    for how in ("hashed", "not hashed"):
        flat = orig.clone()
        fd = os.open(tmp_path / how, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if how == "hashed":
                assert can_journal_in_pass(flat, patch, "xxh3-128", layout)
                patch_and_checksum(flat, patch, "xxh3-128", layout, journal=(fd, 64, 8))
            else:
                assert can_journal_in_pass(flat, patch, None)
                journal_patch(flat, patch, (fd, 64, 8))
        finally:
            os.close(fd)
        out[how] = (flat, (tmp_path / how).read_bytes())
    assert torch.equal(out["hashed"][0], out["not hashed"][0])
    assert out["hashed"][1] == out["not hashed"][1]
    assert not torch.equal(out["hashed"][0], orig)
    wide = torch.stack([orig, orig], 1).reshape(-1)[::2]  # orig's values, not contiguous
    fd = os.open(tmp_path / "refused", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with pytest.raises(ConfigError, match="cannot save its old values"):
            journal_patch(wide, patch, (fd, 64, 8))
    finally:
        os.close(fd)
    assert torch.equal(wide, orig) and (tmp_path / "refused").stat().st_size == 0


@needs_kernel
def test_kernel_write_failure_patches_nothing_more(tmp_path: Path) -> None:
    """The first chunk's old values cannot be saved (a read-only fd): OSError, flat unchanged;
    bad positions in the first chunk are refused before anything is written."""
    flat = np.arange(300_000, dtype=np.int16)
    pos = np.arange(0, 300_000, 7, dtype=np.int64)
    vals = np.ones(pos.size, np.int16)
    (tmp_path / "ro").write_bytes(b"")
    fd = os.open(tmp_path / "ro", os.O_RDONLY)
    try:
        with pytest.raises(OSError):
            K.journal_patch_hash(flat, 2, pos, vals, True, 0, flat.size, None, fd, 0, 0, 0)
    finally:
        os.close(fd)
    assert np.array_equal(flat, np.arange(300_000, dtype=np.int16))
    fd = os.open(tmp_path / "rw", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        bad = pos.copy()
        bad[2] = bad[1]  # not strictly increasing, in the first chunk
        with pytest.raises(ValueError, match="strictly increasing"):
            K.journal_patch_hash(flat, 2, bad, vals, True, 0, flat.size, None, fd, 0, 0, 0)
        with pytest.raises(ValueError, match=">= 0"):
            K.journal_patch_hash(flat, 2, pos, vals, True, 0, flat.size, None, fd, -1, 0, 0)
        with pytest.raises(ValueError, match="values is"):
            K.journal_patch_hash(flat, 2, pos, vals[:-1], True, 0, flat.size, None, fd, 0, 0, 0)
    finally:
        os.close(fd)
    assert np.array_equal(flat, np.arange(300_000, dtype=np.int16))
    assert (tmp_path / "rw").stat().st_size == 0


@needs_kernel
@pytest.mark.parametrize("fault", ["repeated", "descending", "past_hi", "negative"])
def test_kernel_bad_position_midway_stops_with_what_it_wrote_saved(
    tmp_path: Path, fault: str
) -> None:
    """Positions are checked as each chunk saves its old values (no pass of their own): one
    that is bad in a later chunk stops the kernel (ValueError) before that chunk writes; every
    chunk before it is patched, and its old values and their count are in the file, so
    writing the saved values back restores the tensor exactly. Nothing after is touched."""
    n, lo, hi = 3_000_000, 0, 2_900_000  # int16: ~22 chunks of 256 KiB
    rng = np.random.default_rng(7)
    flat = rng.integers(-(2**15), 2**15, n, dtype=np.int16)
    orig = flat.copy()
    pos = np.arange(3, hi, 5, dtype=np.int64)
    vals = np.full(pos.size, 0x55, np.int16)
    j = int(np.searchsorted(pos, 2_000_000))  # in a later chunk
    if fault == "repeated":
        pos[j] = pos[j - 1]
    elif fault == "descending":
        pos[j] = pos[j - 1] - 3
    elif fault == "negative":
        pos[j] = -5
    else:
        j = pos.size - 1
        pos[j] = hi  # the last position, one past the range
    fd = os.open(tmp_path / "j", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with pytest.raises(ValueError, match=rf"positions\[{j}\] = .*strictly increasing"):
            K.journal_patch_hash(flat, 2, pos, vals, True, lo, hi, None, fd, 16, 8, 0)
    finally:
        os.close(fd)
    data = (tmp_path / "j").read_bytes()
    count = int.from_bytes(data[8:16], "little")
    assert 0 < count <= j
    changed = np.flatnonzero(flat != orig)
    assert changed.size == count and np.array_equal(changed, pos[:count])
    saved = np.frombuffer(data[16 : 16 + count * 2], np.int16)
    flat[pos[:count]] = saved
    assert np.array_equal(flat, orig)


@needs_kernel
@pytest.mark.parametrize("width", [2, 4])
def test_kernel_stops_at_the_start_of_the_chunk_with_the_bad_position(
    tmp_path: Path, width: int
) -> None:
    """The chunks are the tensor's JOURNAL_CHUNK_BYTES at a time, aligned to multiples of it:
    a bad position leaves exactly the positions of the chunks before its own saved, counted
    and patched (the count is not a chunk behind, nor a chunk ahead), whatever chunk it is in,
    the range starting mid-chunk or not."""
    chunk = K.JOURNAL_CHUNK_BYTES // width
    n = 9 * chunk + 77
    rng = np.random.default_rng(width)
    orig = rng.integers(-(2**15), 2**15, n, dtype=DT[width])
    for lo, at in ((0, 0), (0, 1), (chunk // 3, 3), (5, 8)):
        flat = orig.copy()
        pos = np.sort(rng.choice(np.arange(lo, n), n // 40, replace=False)).astype(np.int64)
        j = int(np.searchsorted(pos, at * chunk + chunk // 2))  # mid-chunk `at`
        pos[j] = pos[j - 1] if j else -1
        vals = np.full(pos.size, 0x55, DT[width])
        path = tmp_path / f"j{lo}-{at}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            with pytest.raises(ValueError, match=rf"positions\[{j}\] = "):
                K.journal_patch_hash(flat, width, pos, vals, True, lo, n, None, fd, 16, 8, 0)
        finally:
            os.close(fd)
        data = path.read_bytes() if path.stat().st_size else bytes(16)
        count = int.from_bytes(data[8:16], "little")
        want = int(np.searchsorted(pos[:j], max(lo, at * chunk)))  # those below its chunk
        assert count == want, (lo, at)
        assert np.array_equal(np.flatnonzero(flat != orig), pos[:count])
        saved = np.frombuffer(data[16 : 16 + count * width], DT[width])
        assert np.array_equal(saved, orig[pos[:count]])


# ------------------------------------------------------------------------------ the record


@needs_kernel
def test_record_reads_back_what_was_saved_at_any_count(tmp_path: Path) -> None:
    """A record read back holds each tensor's first ``count`` old values (positions sliced to
    match, a dense patch as its first elements); a count past the values, or past the file,
    makes it unreadable."""
    sd0 = {"a": torch.randn(50_000), "b": torch.randn(3000).to(torch.bfloat16)}
    sd1 = {k: v.clone() for k, v in sd0.items()}
    sd1["a"][::5] += 1
    sd1["b"] += 1  # every element: a dense xef patch
    m1 = build_manifest(sd1, 1, base=sd0)
    (batch,) = xef_batches(m1, sd0, sd1, n=1)
    work = []
    for u in batch:
        flat = int_view(sd0[u.entry.name].clone())
        work.append((u.entry.name, None, flat, u.patch))
    path = tmp_path / f"undo-000000{journal.PROGRESSIVE_SUFFIX}"
    rec = journal.create_progressive(path, work, 1)  # type: ignore[arg-type]
    try:
        for (name, _loc, flat, patch), v_at, p_at in zip(
            work, rec.values_at, rec.progress_at, strict=True
        ):
            old = flat.clone()
            n = flat.numel() if patch.positions is None else patch.positions.numel()
            for done in (0, n // 3, n):  # as a crash after any chunk leaves it
                os.pwrite(rec.fd, int(done).to_bytes(8, "little"), p_at)
                src = old if patch.positions is None else old[patch.positions]
                os.pwrite(rec.fd, src[:done].numpy().tobytes(), v_at)
                got = {r[0]: r for r in journal.read(path)}[name]
                assert got[2].numel() == done * flat.element_size()
                assert torch.equal(got[2].view(flat.dtype), src[:done])
                if patch.positions is None:
                    assert got[1] is None if done == n else torch.equal(got[1], torch.arange(done))
                else:
                    assert torch.equal(got[1], patch.positions[:done])
        os.pwrite(rec.fd, (10**9).to_bytes(8, "little"), rec.progress_at[0])
        with pytest.raises(ValueError, match="values saved"):
            journal.read(path)
        os.pwrite(rec.fd, (1).to_bytes(8, "little"), rec.progress_at[0])
        os.truncate(path, rec.values_at[0])
        with pytest.raises(ValueError, match="past the end"):
            journal.read(path)
    finally:
        os.close(rec.fd)


# ------------------------------------------------------------------- a real SIGKILL mid-kernel

_CHILD = r"""
import asyncio, os, sys, torch
import receiver.engines.checkpoint as ck
from tests.test_engines import load_batches
data = load_batches(sys.argv[2])
async def main():
    e = ck.LocalCheckpoint(sys.argv[1])
    await e.open()
    await e.begin(data["manifest"], "delta")
    sys.stdout.write("go\n")  # the parent starts its clock: the patches begin now
    sys.stdout.flush()
    for batch in data["batches"]:
        await e.apply(batch)
    await e.commit()
    print("committed", flush=True)
asyncio.run(main())
"""


def _big_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w0": torch.randn(24_000_000, generator=g).to(torch.bfloat16),
        "w1": torch.randn(8_000_000, generator=g),
        "w2": torch.randn(12_000_000, generator=g).to(torch.float16),
    }


@needs_kernel
@pytest.mark.slow
@pytest.mark.heavy
async def test_sigkill_inside_the_kernel_then_reopen(tmp_path: Path) -> None:
    """A child process applying a delta (progressive records) is killed with SIGKILL at several
    moments while its kernels patch; each time the reopened engine holds the old bytes exactly.
    At least one kill must land inside a kernel (a record with 0 < count < positions). The
    checkpoint holds the spare records of the delta before (journal.recycled_name): the
    killed apply writes its records over them, their stale old values past each count."""
    base = _big_state(0)
    sd0, sd1 = _moved(base, 2), _moved(_moved(base, 2), 1)
    m1 = build_manifest(sd1, 2, base=sd0)
    payload = tmp_path / "payload.pt"
    torch.save({"manifest": m1, "batches": xef_batches(m1, sd0, sd1, n=1)}, payload)
    ck = await init_checkpoint(tmp_path / "c", base)
    ck.sync_before_ack = False
    m0 = build_manifest(sd0, 1, base=base)
    await apply_version(ck, m0, xef_batches(m0, base, sd0, n=1), "delta")
    await ck.acknowledged()
    await ck.close()
    assert [p.name for p in (tmp_path / "c" / ".asyncsync" / "journal").iterdir()] == [
        "spare-000000"
    ]

    def start(ckdir: Path) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(ckdir), str(payload)],
            env={**os.environ, "PYTHONPATH": str(REPO)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"go\n", proc.stderr.read() if proc.stderr else ""
        return proc

    shutil.copytree(tmp_path / "c", tmp_path / "dry")
    dry = start(tmp_path / "dry")  # how long the patches and the commit take on this machine
    t0 = time.monotonic()
    assert dry.stdout is not None and dry.stdout.readline() == b"committed\n"
    took = time.monotonic() - t0
    dry.communicate(timeout=120)
    # Each trial kills a fresh copy of v0 at a moment spread over that time. On a loaded
    # machine a kill may come after the commit (the trial is then not counted) or before the
    # first kernel; trials go on until 4 kills came before the commit and one of them inside a
    # kernel (a record with 0 < count < positions), or 24 trials.
    kills = midway = 0
    for trial in range(24):
        if kills >= 4 and midway:
            break
        ckdir = tmp_path / f"trial{trial}"
        shutil.copytree(tmp_path / "c", ckdir)
        proc = start(ckdir)
        time.sleep((0.05, 0.15, 0.3, 0.45, 0.6, 0.0)[trial % 6] * took)
        proc.send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
        if b"committed" in out:
            shutil.rmtree(ckdir)
            continue
        assert proc.returncode == -signal.SIGKILL, err.decode()
        kills += 1
        for p in (ckdir / ".asyncsync" / "journal").glob("undo-*"):
            counts = _counts_of(p)
            for name, pos, _old in journal.read(p):
                done = counts[name] if pos is None else pos.numel()
                midway += 0 < done < counts[name]
        state = json.loads((ckdir / ".asyncsync" / "state.json").read_text())
        assert state["format_version"] == 2 and state["progressive"] is True
        ck = LocalCheckpoint(ckdir)
        assert (await ck.open()).version == 1
        assert_same(ck.load_state_dict(), sd0)
        await ck.close()
        shutil.rmtree(ckdir)
    assert kills >= 4 and midway, f"{kills} kills before the commit, {midway} inside a kernel"
    ck = LocalCheckpoint(tmp_path / "c")
    await ck.open()
    await apply_version(ck, m1, delta_batches(m1, sd0, sd1), "delta")
    assert_same(ck.load_state_dict(), sd1)
    await ck.close()


def _moved(sd: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """A copy of ``sd`` with a fifth of each tensor's elements (drawn from ``seed``) moved."""
    out = {k: v.clone() for k, v in sd.items()}
    g = torch.Generator().manual_seed(seed)
    for t in out.values():
        flat = t.view(-1)
        idx = torch.randint(0, flat.numel(), (flat.numel() // 5,), generator=g)
        flat[idx] = (flat[idx].float() + 1).to(t.dtype)
    return out


def _counts_of(path: Path) -> dict[str, int]:
    """Each tensor's count of positions (or elements) in a progressive record's header."""
    data = path.read_bytes()
    meta = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    return dict(zip(meta["names"], meta["counts"], strict=True))


# ------------------------------------------------------------------- a crash of the machine


async def _crashed_mid_delta(tmp_path: Path) -> tuple[dict[str, torch.Tensor], Path]:
    """A checkpoint at v0 whose delta to v1 was interrupted after its first group (a real
    child process, os._exit at the second patch call): state 'applying', progressive records."""
    from tests.test_engines import mixed_state, mutate, run_crashing_child

    sd0 = mixed_state(0)
    ck = await init_checkpoint(tmp_path / "c", sd0)
    await ck.close()
    sd1 = mutate(sd0, 0.2, seed=1)
    m1 = build_manifest(sd1, 1, base=sd0)
    run_crashing_child(tmp_path, tmp_path / "c", m1, xef_batches(m1, sd0, sd1), "delta")
    records = list((tmp_path / "c" / ".asyncsync" / "journal").glob("undo-*.progressive"))
    assert records
    return sd0, records[0]


@needs_kernel
async def test_a_torn_progressive_record_wipes_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The machine went down before the record reached the disk (here: cut short): it cannot
    be undone, so the engine removes the files and holds nothing (the agent re-initialises
    from a keyframe)."""
    _sd0, record = await _crashed_mid_delta(tmp_path)
    os.truncate(record, 20)
    ck = LocalCheckpoint(tmp_path / "c")
    assert (await ck.open()).version is None
    assert "unreadable" in caplog.text and "keyframe" in caplog.text
    assert list((tmp_path / "c" / ".asyncsync" / "journal").iterdir()) == []
    await ck.close()


@needs_kernel
async def test_lost_pages_after_a_progressive_undo_wipe(tmp_path: Path) -> None:
    """The record reads back but a patched page did not (the machine lost it): the bytes after
    the undo differ from v0's checksums, so the engine wipes instead of serving them; with
    every record gone, too (the state's ``progressive`` mark makes it check)."""
    sd0, _record = await _crashed_mid_delta(tmp_path)
    shutil_copy = (tmp_path / "c").with_name("c2")
    shutil.copytree(tmp_path / "c", shutil_copy)
    data = next((tmp_path / "c").glob("*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF  # a byte no record restores
    data.write_bytes(bytes(raw))
    ck = LocalCheckpoint(tmp_path / "c")
    assert (await ck.open()).version is None
    await ck.close()
    # the records gone entirely: nothing to undo, and the half-patched bytes are not trusted
    for p in (shutil_copy / ".asyncsync" / "journal").iterdir():
        p.unlink()
    ck = LocalCheckpoint(shutil_copy)
    assert (await ck.open()).version is None
    await ck.close()
    assert sd0  # (v0 itself is what test_crash_during_delta_recovers_old_bytes reaches)


def test_state_progressive_is_format_version_2_only() -> None:
    """A state marked progressive is written as format_version 2 (a reader of version 1
    refuses it rather than trust half-journalled bytes); the mark and the version agree."""
    ps = PersistedState(version=3).begin(4, "delta", progressive=True)
    doc = json.loads(ps.to_json())
    assert (doc["format_version"], doc["progressive"]) == (2, True)
    assert PersistedState.from_json(ps.to_json(), where="s").progressive
    assert json.loads(ps.clean().to_json())["format_version"] == 1
    assert "progressive" not in json.loads(ps.clean().to_json())
    for fv, mark in ((1, True), (2, False), (2, "yes")):
        bad = {**doc, "format_version": fv, "progressive": mark}
        with pytest.raises(EngineStateError, match="progressive"):
            PersistedState.from_json(json.dumps(bad), where="s")


def test_record_header_of_many_tensors(tmp_path: Path) -> None:
    """The header holds offsets whose digits depend on its own size: with hundreds of tensors
    (a stress run found the first sizing too small) it still fits and reads back."""
    from asyncsync.codec import Patch

    work = []
    for i in range(700):
        flat = torch.arange(1000 + i, dtype=torch.int16)
        pos = torch.arange(0, flat.numel(), 3, dtype=torch.int64)
        work.append(
            (
                f"layer.{i}.weight",
                None,
                flat,
                Patch("xor", pos, torch.ones_like(pos).to(torch.int16)),
            )
        )
    path = tmp_path / f"undo-000000{journal.PROGRESSIVE_SUFFIX}"
    rec = journal.create_progressive(path, work, 1)  # type: ignore[arg-type]
    try:
        os.pwrite(rec.fd, (2).to_bytes(8, "little"), rec.progress_at[-1])
        os.pwrite(rec.fd, b"\x07\x00\x09\x00", rec.values_at[-1])
    finally:
        os.close(rec.fd)
    got = journal.read(path)
    assert [g[0] for g in got] == [w[0] for w in work]
    assert all(g[2].numel() == 0 for g in got[:-1])
    assert got[-1][1].tolist() == [0, 3] and got[-1][2].view(torch.int16).tolist() == [7, 9]


@needs_kernel
async def test_undo_at_open_is_not_trusted_before_the_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed between the undo of a progressive delta (records cleared) and the check of every
    tensor: the state the undo left says ``synced: false``, so the next open still checks."""
    sd0, _record = await _crashed_mid_delta(tmp_path)

    def killed(self: LocalCheckpoint, rewrite: bool = False) -> None:
        raise KeyboardInterrupt("killed before the check")

    monkeypatch.setattr(LocalCheckpoint, "_check_unsynced", killed)
    with pytest.raises(KeyboardInterrupt):
        await LocalCheckpoint(tmp_path / "c").open()
    state = json.loads((tmp_path / "c" / ".asyncsync" / "state.json").read_text())
    assert (state["status"], state["version"], state.get("synced")) == ("clean", 0, False)
    assert list((tmp_path / "c" / ".asyncsync" / "journal").iterdir()) == []
    monkeypatch.undo()
    data = next((tmp_path / "c").glob("*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF  # a page the machine lost: the check must see it
    data.write_bytes(bytes(raw))
    ck = LocalCheckpoint(tmp_path / "c")
    assert (await ck.open()).version is None
    await ck.close()
    assert sd0


_FULL_DISK_CHILD = r"""
import asyncio, resource, signal, sys, torch
import receiver.engines.checkpoint as ck
from tests.test_engines import load_batches
data = load_batches(sys.argv[2])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
async def main():
    e = ck.LocalCheckpoint(sys.argv[1])
    await e.open()
    await e.begin(data["manifest"], "delta")
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[3]), resource.RLIM_INFINITY))
    try:
        for batch in data["batches"]:
            await e.apply(batch)
        print("applied", flush=True)
    except Exception as exc:
        while exc.__cause__ is not None and not isinstance(exc, OSError):
            exc = exc.__cause__
        print("failed", type(exc).__name__, getattr(exc, "errno", None), flush=True)
    for rec in (e.directory / ".asyncsync" / "journal").glob("undo-*.progressive"):
        from receiver.engines.checkpoint import journal
        ((_, pos, _),) = journal.read(rec)
        print("saved", pos.numel(), flush=True)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    await e.abort()
    await e.close()
asyncio.run(main())
"""


@needs_kernel
@pytest.mark.slow
async def test_a_journal_write_that_fails_midway_rolls_back_exactly(tmp_path: Path) -> None:
    """A real write failure inside the kernel (RLIMIT_FSIZE: the record's header and positions
    fit, its old values do not, as on a disk that fills up): the apply fails with the OS's
    error, the abort undoes exactly the chunks that were saved and patched, and the engine
    holds v0 bit for bit."""
    g = torch.Generator().manual_seed(5)
    sd0 = {"w": torch.randn(12_000_000, generator=g).to(torch.bfloat16)}
    sd1 = {"w": sd0["w"].clone()}
    idx = torch.randint(0, 12_000_000, (2_400_000,), generator=g)
    sd1["w"][idx] = (sd1["w"][idx].float() + 1).to(torch.bfloat16)
    m1 = build_manifest(sd1, 1, base=sd0)
    payload = tmp_path / "payload.pt"
    torch.save({"manifest": m1, "batches": xef_batches(m1, sd0, sd1, n=1)}, payload)
    ck = await init_checkpoint(tmp_path / "c", sd0)
    await ck.close()
    limit = 3 << 20  # the positions blob is ~1.4 MB, the old values ~4.3 MB
    proc = subprocess.run(
        [sys.executable, "-c", _FULL_DISK_CHILD, str(tmp_path / "c"), str(payload), str(limit)],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.split()
    assert out[:3] == ["failed", "OSError", "27"], proc.stdout + proc.stderr
    assert out[3] == "saved" and 0 < int(out[4]) < m1.tensors[0].changed, out  # midway
    ck = LocalCheckpoint(tmp_path / "c")
    assert (await ck.open()).version == 0
    assert_same(ck.load_state_dict(), sd0)
    await apply_version(ck, m1, delta_batches(m1, sd0, sd1), "delta")
    assert_same(ck.load_state_dict(), sd1)
    await ck.close()


@pytest.mark.parametrize("engine", ["checkpoint", "module"])
@pytest.mark.parametrize("blob", [True, False])
@pytest.mark.parametrize("fault", ["repeated", "outside", "unsorted-repeat"])
async def test_a_made_up_patch_leaves_the_held_version_whole(
    tmp_path: Path, engine: str, blob: bool, fault: str
) -> None:
    """A Patch made up by hand (not decoded), with or without an xef blob that is not its
    positions': a repeated position (in order or not) or one outside the tensor, in a later
    chunk. Both engines refuse it (ApplyFailed) and hold v0 bit for bit after the abort; the
    next good delta applies. A repeated position used to pass the in-memory engine's checks
    and be undone to the value between its two writes (it then served that as v0)."""
    from dataclasses import replace

    from asyncsync.errors import ApplyFailed
    from receiver.engines import TensorUpdate, TorchModule

    g = torch.Generator().manual_seed(11)
    sd0 = {"w": torch.randn(4_000_000, generator=g).to(torch.bfloat16)}  # ~8 journal chunks
    sd1 = {"w": sd0["w"].clone()}
    idx = torch.randint(0, 4_000_000, (400_000,), generator=g)
    sd1["w"][idx] = (sd1["w"][idx].float() + 1).to(torch.bfloat16)
    m1 = build_manifest(sd1, 1, base=sd0)
    (u,) = xef_batches(m1, sd0, sd1, n=1)[0]
    assert u.patch is not None and u.patch.positions is not None
    pos = u.patch.positions.clone()
    j = int(torch.searchsorted(pos, 3_000_000))
    if fault == "repeated":
        pos[j] = pos[j - 1]
    elif fault == "outside":
        pos[j] = 4_000_000 + 17
    else:
        pos[j], pos[j + 1] = pos[j + 1], pos[j - 5]  # out of order, one repeated
    made = replace(u.patch, positions=pos, positions_xef=u.patch.positions_xef if blob else None)
    if engine == "checkpoint":
        eng: Any = await init_checkpoint(tmp_path / "c", sd0)
        held = eng.load_state_dict
    else:
        from tests.test_engines import full_batches

        mod = torch.nn.Module()
        mod.register_parameter("w", torch.nn.Parameter(sd0["w"].clone(), requires_grad=False))
        eng = TorchModule(mod)
        await eng.open()
        m0 = build_manifest(sd0, 0)
        await apply_version(eng, m0, full_batches(m0, sd0), "full")

        def held() -> dict[str, torch.Tensor]:
            return {"w": mod.w.detach().clone()}

    await eng.begin(m1, "delta")
    with pytest.raises(ApplyFailed, match=r"positions|repeat|outside"):
        await eng.apply([TensorUpdate(u.entry, patch=made)])
    await eng.abort()
    assert eng.state.version == 0
    assert_same(held(), sd0)
    await apply_version(eng, m1, xef_batches(m1, sd0, sd1), "delta")
    assert_same(held(), sd1)
    if engine == "checkpoint":
        await eng.close()
        eng = LocalCheckpoint(tmp_path / "c")
        assert (await eng.open()).version == 1
        assert_same(eng.load_state_dict(), sd1)
        await eng.close()


@pytest.mark.parametrize("kernels", ["native", "numpy"])
def test_check_patch_refuses_positions_outside_the_tensor(
    kernels: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """check_patch: positions strictly increasing within the tensor pass in one C pass; any
    other order still passes if every position is inside (aminmax), and one outside, at
    either end or in the middle of an unsorted list, is an ApplyFailed naming the tensor."""
    from asyncsync.codec import Patch
    from asyncsync.errors import ApplyFailed
    from receiver.rules import check_patch

    if kernels == "numpy":
        monkeypatch.setattr(native, "kernels", None)
    flat = torch.zeros(100, dtype=torch.int16)
    ok = [[0, 5, 99], [7], [99, 3, 50]]
    bad = [[-1, 5], [5, 100], [3, 200, 50], [10, 10**12]]
    for p in ([5, 3, 5], [7, 7], [0, 1, 1, 2]):  # a repeated position would undo wrongly
        patch = Patch(
            "xor", torch.tensor(p, dtype=torch.int64), torch.ones(len(p), dtype=torch.int16)
        )
        with pytest.raises(ApplyFailed, match=r"'w'.*repeat"):
            check_patch(patch, flat, "w")
    for p in ok:
        pos = torch.tensor(p, dtype=torch.int64)
        got = check_patch(Patch("xor", pos, torch.ones(len(p), dtype=torch.int16)), flat, "w")
        assert torch.equal(got.positions, pos)
    for p in bad:
        patch = Patch(
            "xor", torch.tensor(p, dtype=torch.int64), torch.ones(len(p), dtype=torch.int16)
        )
        with pytest.raises(ApplyFailed, match=r"'w'.*outside 0\.\.99"):
            check_patch(patch, flat, "w")


@needs_kernel
async def test_a_rollback_in_the_process_keeps_the_version_durable(tmp_path: Path) -> None:
    """A progressive delta rolled back in the process (a checksum that does not match): the
    page cache is whole, the undo syncs it, so the held version stays ``synced`` (no needless
    check of every tensor at the next open)."""
    from asyncsync.errors import ChecksumMismatch
    from tests.test_engines import mixed_state, mutate

    sd0 = mixed_state(0)
    ck = await init_checkpoint(tmp_path / "c", sd0)
    await ck.flushed()
    sd1 = mutate(sd0, 0.2, seed=1)
    name = next(iter(sd1))
    m1 = build_manifest(sd1, 1, base=sd0, bad_checksum=name)
    with pytest.raises(ChecksumMismatch):
        await apply_version(ck, m1, xef_batches(m1, sd0, sd1), "delta")
    state = json.loads((tmp_path / "c" / ".asyncsync" / "state.json").read_text())
    assert (state["status"], state["version"], state.get("synced", True)) == ("clean", 0, True)
    assert_same(ck.load_state_dict(), sd0)
    await ck.close()


# ------------------------------------------------------------- found by attacking it (helper)


def _edit_header(record: Path, edit: Any) -> None:
    """Rewrite a progressive record's JSON header in place (same length, space-padded)."""
    b = record.read_bytes()
    h = int.from_bytes(b[:8], "little")
    meta = json.loads(b[8 : 8 + h])
    edit(meta)
    t = json.dumps(meta, separators=(",", ":")).encode()
    assert len(t) <= h
    record.write_bytes(b[:8] + t + b" " * (h - len(t)) + b[8 + h :])


@needs_kernel
async def test_a_record_that_does_not_fit_its_tensor_wipes(tmp_path: Path) -> None:
    """A progressive record that reads back but whose widths do not match the tensors (the
    undo's index_copy_ refuses it): a wipe, not a bare IndexError out of open()."""
    _sd0, record = await _crashed_mid_delta(tmp_path)
    _edit_header(record, lambda m: m.update(widths=[1 for _ in m["widths"]]))
    ck = LocalCheckpoint(tmp_path / "c")
    assert (await ck.open()).version is None
    await ck.close()


@needs_kernel
async def test_a_wipe_cut_short_still_opens_empty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed while a wipe removes the files: the state saying "no version" is written first,
    so the next open holds nothing (and says the leftover files are there) instead of
    failing on the removed ones forever; a full version then re-initialises it."""
    from receiver.engines.checkpoint.files import CheckpointFiles

    sd0, record = await _crashed_mid_delta(tmp_path)
    os.truncate(record, 20)  # unreadable: open wipes
    real = CheckpointFiles.remove_data

    def killed(self: CheckpointFiles) -> None:
        next(iter(self.data_files())).unlink()  # one file gone, then the process dies
        raise KeyboardInterrupt("killed mid-wipe")

    monkeypatch.setattr(CheckpointFiles, "remove_data", killed)
    with pytest.raises(KeyboardInterrupt):
        await LocalCheckpoint(tmp_path / "c").open()
    monkeypatch.setattr(CheckpointFiles, "remove_data", real)
    ck = LocalCheckpoint(tmp_path / "c")
    assert (await ck.open()).version is None
    m0 = build_manifest(sd0, 0)
    from tests.test_engines import full_batches

    await apply_version(ck, m0, full_batches(m0, sd0), "full")
    assert_same(ck.load_state_dict(), sd0)
    await ck.close()


async def test_a_symlinked_journal_dir_is_refused_not_followed(tmp_path: Path) -> None:
    """``.asyncsync/journal`` replaced by a symlink to another directory: open refuses it with
    a clear error and removes nothing there (it emptied the link's target before)."""
    from tests.test_engines import mixed_state

    ck = await init_checkpoint(tmp_path / "c", mixed_state(0))
    await ck.close()
    decoy = tmp_path / "decoy"
    (decoy / "sub").mkdir(parents=True)
    (decoy / "precious.txt").write_text("keep")
    jdir = tmp_path / "c" / ".asyncsync" / "journal"
    shutil.rmtree(jdir)
    jdir.symlink_to(decoy)
    with pytest.raises(EngineStateError, match="symlink"):
        await LocalCheckpoint(tmp_path / "c").open()
    assert sorted(p.name for p in decoy.iterdir()) == ["precious.txt", "sub"]


@pytest.mark.parametrize("name", ["journal", "staging", "redo", "state.json"])
async def test_a_dangling_symlink_in_the_state_directory_is_named_as_one(
    tmp_path: Path, name: str
) -> None:
    """A symlink to nothing at ``journal``, ``staging``, ``redo`` or ``state.json`` (found by
    attack with a real receiver): the open's writability check followed it into a bare
    ``FileNotFoundError: ... journal``, and a dangling ``state.json`` was called "no
    state.json: point the receiver at an empty directory". Each is refused as the symlink it
    is, as a live one is."""
    from tests.test_engines import mixed_state

    ck = await init_checkpoint(tmp_path / "c", mixed_state(0))
    await ck.close()
    p = tmp_path / "c" / ".asyncsync" / name
    if p.is_dir():
        shutil.rmtree(p)
    elif p.exists():
        p.unlink()
    p.symlink_to(tmp_path / "nowhere")
    with pytest.raises(EngineStateError, match=f"{name} is a symlink"):
        await LocalCheckpoint(tmp_path / "c").open()
    assert p.is_symlink() and not (tmp_path / "nowhere").exists()


def test_state_progressive_only_while_a_delta_is_applied() -> None:
    """A state marked progressive but clean (the engine never writes one; a hand edit would
    make open skip the journal and trust half-patched bytes) is refused."""
    ps = PersistedState(version=3).begin(4, "delta", progressive=True)
    doc = json.loads(ps.to_json())
    for edit in ({"status": "clean", "target_version": None, "mode": None}, {"mode": "full"}):
        with pytest.raises(EngineStateError, match="only for a delta being applied"):
            PersistedState.from_json(json.dumps({**doc, **edit}), where="s")
