"""Spare undo records: a committed version's progressive records are kept as ``spare-NNNNNN``
and rewritten in place by the next version's apply group of the same number (their page cache
reused: no page to allocate, zero and free per version), never read as records; what a spare
held before is never taken for saved values, after a kill of the process either."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from asyncsync import fsio
from asyncsync.codec import int_view
from asyncsync.errors import ChecksumMismatch
from receiver.engines.checkpoint import LocalCheckpoint, journal
from tests import test_engines as te
from tests.conftest import mixed_state, mutate
from tests.test_progressive_journal import needs_kernel


def _journal(ckdir: Path) -> Path:
    return ckdir / ".asyncsync" / "journal"


async def _acked_delta(
    ckdir: Path, density: float = 0.05
) -> tuple[LocalCheckpoint, dict[str, torch.Tensor]]:
    """A progressive checkpoint at v1 (a delta of two apply groups from v0, acked: its
    records kept as spares) and v1's state."""
    sd0 = mixed_state(0)
    ck = await te.init_checkpoint(ckdir, sd0)
    ck.sync_before_ack = False
    sd1 = mutate(sd0, density, seed=1)
    m1 = te.build_manifest(sd1, 1, base=sd0)
    await te.apply_version(ck, m1, te.xef_batches(m1, sd0, sd1, n=2), "delta")
    await ck.acknowledged()
    return ck, sd1


def _work(seed: int, n: int) -> list[tuple[str, None, torch.Tensor, object]]:
    """A progressive record's work: one bf16 tensor of ``n`` elements, a tenth changed."""
    g = torch.Generator().manual_seed(seed)
    old = {"w": torch.randn(n, generator=g).to(torch.bfloat16)}
    new = {"w": old["w"].clone()}
    new["w"][::10] += 1
    m = te.build_manifest(new, 1, base=old)
    ((u,),) = te.xef_batches(m, old, new, n=1)
    return [(u.entry.name, None, int_view(old["w"].clone()), u.patch)]


@pytest.mark.parametrize("spare_size", ["larger", "smaller"])
def test_a_spare_is_written_over_and_reads_back_only_what_was_saved(
    tmp_path: Path, spare_size: str
) -> None:
    """A spare full of stale bytes (0xAB) becomes the record: the same inode, its size the
    whole record's, and read back at any count it gives exactly the values saved, none of the
    stale ones (a count of 0: nothing)."""
    spare = journal.spare_path(tmp_path, 0)
    spare.write_bytes(b"\xab" * (3_000_000 if spare_size == "larger" else 1000))
    inode = spare.stat().st_ino
    work = _work(0, 200_000)
    path = tmp_path / f"undo-000000{journal.PROGRESSIVE_SUFFIX}"
    rec = journal.create_progressive(path, work, 1, spare=spare)  # type: ignore[arg-type]
    try:
        assert not spare.exists() and path.stat().st_ino == inode
        (_name, _loc, flat, patch) = work[0]
        n = patch.positions.numel()  # type: ignore[attr-defined]
        assert path.stat().st_size == rec.values_at[0] + journal.align8(2 * n)
        ((_, pos, old),) = journal.read(path)
        assert old.numel() == 0 and pos is not None and pos.numel() == 0
        src = flat[patch.positions]  # type: ignore[attr-defined]
        for done in (1, n // 3, n):
            os.pwrite(rec.fd, src[:done].numpy().tobytes(), rec.values_at[0])
            os.pwrite(rec.fd, done.to_bytes(8, "little"), rec.progress_at[0])
            ((_, pos, old),) = journal.read(path)
            assert torch.equal(old.view(flat.dtype), src[:done])
            assert torch.equal(pos, patch.positions[:done])  # type: ignore[index]
    finally:
        os.close(rec.fd)


@pytest.mark.parametrize("kind", ["symlink", "fifo", "hardlink", "directory", "read-only"])
def test_a_spare_that_is_not_a_plain_file_is_never_written_through(
    tmp_path: Path, kind: str
) -> None:
    """A symlink, a FIFO, a hard-linked file, a directory or a file this uid cannot write,
    named like a spare: the record is made as a new file; the file the link names keeps its
    bytes; the entry is removed (a directory is left to the next clear), and nothing blocks."""
    outside = tmp_path / "outside"
    outside.write_bytes(b"precious" * 1000)
    jdir = tmp_path / "journal"
    jdir.mkdir()
    spare = journal.spare_path(jdir, 0)
    if kind == "symlink":
        spare.symlink_to(outside)
    elif kind == "fifo":
        os.mkfifo(spare)
    elif kind == "hardlink":
        os.link(outside, spare)
    elif kind == "read-only":  # (root writes it anyway: then it is simply reused)
        spare.write_bytes(b"stale" * 1000)
        spare.chmod(0o444)
    else:
        spare.mkdir()
    work = _work(1, 50_000)
    path = jdir / f"undo-000000{journal.PROGRESSIVE_SUFFIX}"
    rec = journal.create_progressive(path, work, 1, spare=spare)  # type: ignore[arg-type]
    os.close(rec.fd)
    assert outside.read_bytes() == b"precious" * 1000
    assert os.lstat(path).st_nlink == 1 and path.is_file() and not path.is_symlink()
    assert spare.is_dir() if kind == "directory" else not os.path.lexists(spare)
    assert journal.read(path)[0][2].numel() == 0


def test_rewrite_as_refuses_a_size_below_the_bytes_and_keeps_the_target(tmp_path: Path) -> None:
    """A size below what was written is an error: the spare is removed, the target untouched."""
    (tmp_path / "spare").write_bytes(b"x" * 100)
    (tmp_path / "target").write_bytes(b"keep")
    with pytest.raises(ValueError, match="below"):
        fsio.rewrite_as(tmp_path / "spare", tmp_path / "target", [b"abc", b"def"], size=5)
    assert not (tmp_path / "spare").exists()
    assert (tmp_path / "target").read_bytes() == b"keep"
    assert not fsio.rewrite_as(tmp_path / "spare", tmp_path / "target", [b"abc"], size=3)
    (tmp_path / "spare").write_bytes(b"y" * 10)
    views = [memoryview(bytes(range(200)) * 40)] * 600 + [b""]  # more than one pwritev takes
    assert fsio.rewrite_as(tmp_path / "spare", tmp_path / "target", views, size=8000 * 600 + 2)
    assert (tmp_path / "target").read_bytes() == bytes(range(200)) * 40 * 600 + b"\0\0"


def test_recycled_names(tmp_path: Path) -> None:
    """Progressive records become spares, spares stay, anything else goes: a record over
    SPARE_BYTES (a dense delta's), a symlink, a name not of six ASCII digits."""
    small, big = tmp_path / "small", tmp_path / "big"
    small.write_bytes(b"x" * 100)
    with open(big, "wb") as f:
        f.truncate(journal.SPARE_BYTES + 1)
    for name in ("undo-000003.progressive", "spare-000003"):
        os.replace(small, tmp_path / name)
        small = tmp_path / name
        assert journal.recycled_name(small) == "spare-000003"
    os.replace(big, tmp_path / "undo-000004.progressive")
    assert journal.recycled_name(tmp_path / "undo-000004.progressive") is None
    (tmp_path / "spare-000005").symlink_to(small)
    assert journal.recycled_name(tmp_path / "spare-000005") is None
    assert journal.recycled_name(tmp_path / "undo-000006.progressive") is None  # gone
    for name in (
        "undo-000003.safetensors", "undo-3.progressive", "undo-00000x.progressive",
        "spare-12", "spare-0000001", "spare-" + "\u0660" * 5 + "\u0661",
        ".tmp.undo-000003.progressive.ab12", "undo-000003.progressive.tmp", "other",
    ):  # fmt: skip
        (tmp_path / name).write_bytes(b"x")
        assert journal.recycled_name(tmp_path / name) is None, name


@needs_kernel
async def test_the_next_version_rewrites_the_last_ones_records(tmp_path: Path) -> None:
    """v1's records become spares at its ack; v2's apply groups rewrite them (the same inodes)
    and v2 is exact; a begin that finds v1's records (no ack came) keeps them as spares too;
    an abort undoes v3 from records made over spares, exactly."""
    ck, sd1 = await _acked_delta(tmp_path)
    spares = sorted(_journal(tmp_path).iterdir())
    assert [p.name for p in spares] == ["spare-000000", "spare-000001"]
    inodes = [p.stat().st_ino for p in spares]
    sd2 = mutate(sd1, 0.05, seed=2)
    m2 = te.build_manifest(sd2, 2, base=sd1)
    await te.apply_version(ck, m2, te.xef_batches(m2, sd1, sd2, n=2), "delta")
    records = sorted(_journal(tmp_path).iterdir())
    assert [p.name for p in records] == [f"undo-00000{i}.progressive" for i in (0, 1)]
    assert [p.stat().st_ino for p in records] == inodes
    te.assert_same(ck.load_state_dict(), sd2)
    sd3 = mutate(sd2, 0.05, seed=3)
    m3 = te.build_manifest(sd3, 3, base=sd2)
    await ck.begin(m3, "delta")  # no ack of v2: its records become spares here
    assert sorted(p.stat().st_ino for p in _journal(tmp_path).iterdir()) == sorted(inodes)
    for batch in te.xef_batches(m3, sd2, sd3, n=2):
        await ck.apply(batch)
    await ck.abort()
    te.assert_same(ck.load_state_dict(), sd2)
    await ck.close()
    ck = LocalCheckpoint(tmp_path)
    assert (await ck.open()).version == 2
    te.assert_same(ck.load_state_dict(), sd2)
    await ck.close()


@needs_kernel
async def test_a_crash_mid_delta_over_spares_reopens_at_the_version(tmp_path: Path) -> None:
    """A real child process applying v2 over v1's spares exits (``os._exit``) at its fourth
    tensor: the records it made over the spares (stale v1 old values past each count) undo to
    v1 exactly at the reopen."""
    ckdir = tmp_path / "c"
    ck, sd1 = await _acked_delta(ckdir, 0.2)
    await ck.close()
    inodes = {p.stat().st_ino for p in _journal(ckdir).iterdir()}
    assert inodes and all(p.name.startswith("spare-") for p in _journal(ckdir).iterdir())
    sd2 = mutate(sd1, 0.2, seed=2)
    m2 = te.build_manifest(sd2, 2, base=sd1)
    te.run_crashing_child(tmp_path, ckdir, m2, te.xef_batches(m2, sd1, sd2), "delta")
    records = list(_journal(ckdir).glob("undo-*.progressive"))
    assert records and {p.stat().st_ino for p in records} <= inodes
    ck = LocalCheckpoint(ckdir)
    assert (await ck.open()).version == 1
    te.assert_same(ck.load_state_dict(), sd1)
    await ck.close()


@needs_kernel
async def test_a_full_version_and_a_rollback_give_the_spares_room_back(tmp_path: Path) -> None:
    """A full version removes the spares before it stages a file (it may need their room on
    a full disk); so does a rollback (its state may need it): a version that fails its
    checksum at commit leaves no spare behind, and the held version exact."""
    ck, sd1 = await _acked_delta(tmp_path)
    assert len(list(_journal(tmp_path).iterdir())) == 2
    sd2 = mutate(sd1, 0.05, seed=2)
    m2 = te.build_manifest(sd2, 2, base=sd1)
    await te.apply_version(ck, m2, te.full_batches(m2, sd2), "full")
    assert list(_journal(tmp_path).iterdir()) == []
    te.assert_same(ck.load_state_dict(), sd2)
    sd3 = mutate(sd2, 0.05, seed=3)
    m3 = te.build_manifest(sd3, 3, base=sd2)
    await te.apply_version(ck, m3, te.xef_batches(m3, sd2, sd3, n=2), "delta")
    await ck.acknowledged()
    assert len(list(_journal(tmp_path).iterdir())) == 2  # spares again
    sd4 = mutate(sd3, 0.05, seed=4)
    m4 = te.build_manifest(sd4, 4, base=sd3)
    wrong = mutate(sd3, 0.05, seed=5)  # patches that do not give v4's bytes
    await ck.begin(m4, "delta")
    for batch in te.xef_batches(m4, sd3, wrong, n=2):
        await ck.apply(batch)
    with pytest.raises(ChecksumMismatch):
        await ck.commit()
    assert list(_journal(tmp_path).iterdir()) == []
    te.assert_same(ck.load_state_dict(), sd3)
    await ck.close()


@needs_kernel
async def test_a_zero_diff_bump_keeps_the_spares_for_the_delta_after_it(tmp_path: Path) -> None:
    """A zero-diff version between two deltas keeps v1's spares (the same inodes) rather than
    removing them, so v3's apply groups rewrite them again; v3 is exact."""
    ck, sd1 = await _acked_delta(tmp_path)
    inodes = sorted(p.stat().st_ino for p in _journal(tmp_path).iterdir())
    await ck.bump(te.build_manifest(sd1, 2, base=sd1))
    await ck.acknowledged()
    assert sorted(p.stat().st_ino for p in _journal(tmp_path).iterdir()) == inodes
    assert all(p.name.startswith("spare-") for p in _journal(tmp_path).iterdir())
    sd3 = mutate(sd1, 0.05, seed=3)
    m3 = te.build_manifest(sd3, 3, base=sd1)
    await ck.begin(m3, "delta")
    for batch in te.xef_batches(m3, sd1, sd3, n=2):
        await ck.apply(batch)
    records = sorted(_journal(tmp_path).iterdir())
    assert [p.name for p in records] == [f"undo-00000{i}.progressive" for i in (0, 1)]
    assert sorted(p.stat().st_ino for p in records) == inodes
    await ck.commit()
    te.assert_same(ck.load_state_dict(), sd3)
    await ck.close()


async def test_clearing_a_journal_of_spares_renames_and_syncs_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A begin or an ack that finds only spares leaves them as they are: no rename onto
    themselves and no fsync of the directory (each begin finds the last version's spares)."""
    ck, _ = await _acked_delta(tmp_path)
    synced: list[Path] = []
    real = fsio.fsync_dir
    monkeypatch.setattr(fsio, "fsync_dir", lambda p, *a, **k: (synced.append(p), real(p, *a, **k)))
    before = {p.name: p.stat().st_ino for p in _journal(tmp_path).iterdir()}
    ck._store.clear_dir(_journal(tmp_path), keep=journal.recycled_name)
    assert synced == []
    assert {p.name: p.stat().st_ino for p in _journal(tmp_path).iterdir()} == before
    (_journal(tmp_path) / "undo-000007.progressive").write_bytes(b"x" * 64)
    ck._store.clear_dir(_journal(tmp_path), keep=journal.recycled_name)
    assert synced == [_journal(tmp_path)]
    assert sorted(p.name for p in _journal(tmp_path).iterdir()) == sorted([*before, "spare-000007"])
    await ck.close()
