"""Engines: LocalCheckpoint and TorchModule take full and delta versions bit-exactly, refuse
what does not fit, roll back on checksum mismatch or abort, and recover after a crash."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Literal

import pytest
import safetensors.torch
import torch

import receiver.engines.checkpoint.inplace as ckpt_mod
from asyncsync.codec import Patch, int_view, raw_clone
from asyncsync.errors import (
    ApplyFailed,
    AsyncSyncError,
    ChecksumMismatch,
    EngineStateError,
    LockHeld,
    OutOfOrder,
)
from asyncsync.format import (
    DeltaRef,
    FullRef,
    Manifest,
    ShardInfo,
    TensorEntry,
    Totals,
    fingerprint,
)
from asyncsync.format.checksum import checksum_tensor
from receiver.engines import TensorUpdate
from receiver.engines.checkpoint import LocalCheckpoint, journal, verify_checkpoint
from receiver.engines.st_layout import FileMaps, TensorLocation, read_layout
from receiver.engines.torch_module import TorchModule
from receiver.state import PersistedState
from tests.conftest import mixed_state, mutate, same_bytes

ALGO = "xxh3-128"
REPO = Path(__file__).resolve().parents[1]
Op = Literal["set", "xor"]


# --------------------------------------------------------------------------- helpers


def changed_count(old: torch.Tensor, new: torch.Tensor) -> int:
    return int((int_view(old) != int_view(new)).sum()) if old.numel() else 0


def build_manifest(
    sd: dict[str, torch.Tensor],
    version: int,
    *,
    base: dict[str, torch.Tensor] | None = None,
    run_id: str = "run-a",
    bad_checksum: str | None = None,
) -> Manifest:
    """A valid manifest for ``sd``: full (keyframe) without ``base``, else a delta on it."""
    kind: Literal["full", "delta"] = "full" if base is None else "delta"
    entries = []
    for i, (name, t) in enumerate(sd.items()):
        changed = t.numel() if base is None else changed_count(base[name], t)
        checksum = checksum_tensor(t, ALGO)
        if name == bad_checksum:
            checksum = "0" * 32
        entries.append(
            TensorEntry(
                name=name,
                dtype=str(t.dtype).removeprefix("torch."),
                shape=tuple(t.shape),
                checksum=checksum,
                changed=changed,
                delta=DeltaRef(0, "sparse", f"t{i}.pos", f"t{i}.val")
                if base is not None and changed
                else None,
                full=FullRef(0, name) if base is None else None,
            )
        )
    elements = sum(e.numel for e in entries)
    changed_total = sum(e.changed for e in entries)
    m = Manifest(
        version=version,
        base_version=None if base is None else version - 1,
        kind=kind,
        encoding="raw",
        checksum_algorithm=ALGO,
        run_id=run_id,
        shards=(ShardInfo(f"{kind}-00000.safetensors", kind, 0, "0" * 32),),
        tensors=tuple(entries),
        totals=Totals(
            tensors=len(entries),
            elements=elements,
            changed=changed_total,
            density=changed_total / elements if elements else 0.0,
            model_bytes=sum(e.nbytes for e in entries),
            wire_bytes=0,
            delta_bytes=0,
            raw_bytes=0,
        ),
        fingerprint=fingerprint(entries, ALGO),
        created_at=1.0,
        committed_at=2.0,
    )
    m.validate()
    return m


def make_patch(old: torch.Tensor, new: torch.Tensor, op: Op, dense: bool) -> Patch:
    o, n = int_view(old), int_view(new)
    if dense:
        return Patch(op, None, n.clone() if op == "set" else o ^ n)
    pos = torch.nonzero(o != n).reshape(-1)
    return Patch(op, pos, n[pos].clone() if op == "set" else o[pos] ^ n[pos])


def full_batches(m: Manifest, sd: dict[str, torch.Tensor], n: int = 2) -> list[list[TensorUpdate]]:
    ups = [TensorUpdate(e, full=sd[e.name]) for e in m.tensors]
    return [ups[i::n] for i in range(n) if ups[i::n]]


def delta_batches(
    m: Manifest,
    old: dict[str, torch.Tensor],
    new: dict[str, torch.Tensor],
    op: Op = "set",
    dense: bool = False,
    n: int = 2,
) -> list[list[TensorUpdate]]:
    ups = [
        TensorUpdate(e, patch=make_patch(old[e.name], new[e.name], op, dense))
        for e in m.tensors
        if e.changed
    ]
    return [ups[i::n] for i in range(n) if ups[i::n]]


async def apply_version(
    engine: LocalCheckpoint | TorchModule,
    m: Manifest,
    batches: list[list[TensorUpdate]],
    mode: Literal["delta", "full"],
) -> str:
    await engine.begin(m, mode)
    for b in batches:
        await engine.apply(b)
    return await engine.commit()


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(sorted(got)) == list(sorted(want))
    for k in want:
        assert same_bytes(got[k], want[k]), k


async def init_checkpoint(path: Path, sd: dict[str, torch.Tensor]) -> LocalCheckpoint:
    ck = LocalCheckpoint(path)
    assert (await ck.open()).version is None
    m0 = build_manifest(sd, 0)
    assert await apply_version(ck, m0, full_batches(m0, sd), "full") == m0.fingerprint
    return ck


# --------------------------------------------------------------------------- LocalCheckpoint


async def test_full_init_is_a_plain_hf_checkpoint(tmp_path: Path) -> None:
    sd = mixed_state(0)
    ck = await init_checkpoint(tmp_path / "ck", sd)
    assert ck.state.version == 0 and ck.state.run_id == "run-a"
    index = json.loads((tmp_path / "ck" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["asyncsync_version"] == 0
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in sd.values())
    files = sorted(set(index["weight_map"].values()))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    loaded: dict[str, torch.Tensor] = {}
    for f in files:
        loaded.update(safetensors.torch.load_file(tmp_path / "ck" / f))
    assert_same(loaded, sd)
    assert_same(ck.load_state_dict(), sd)
    assert sorted(ck.tensor_names()) == sorted(sd)
    assert verify_checkpoint(tmp_path / "ck", build_manifest(sd, 0)) == []
    await ck.close()
    # reopen: state persisted, clean
    ck2 = LocalCheckpoint(tmp_path / "ck")
    assert (await ck2.open()).version == 0
    state = json.loads((tmp_path / "ck" / ".asyncsync" / "state.json").read_text())
    assert state["status"] == "clean" and set(state["checksums"]) == set(sd)
    await ck2.close()


async def test_a_full_version_stages_a_non_contiguous_bool_with_its_bytes(tmp_path: Path) -> None:
    """A full version's tensors were staged with ``.cpu().contiguous()``, which copies a
    non-contiguous bool as bools and writes 0/1: a transposed mask viewed from uint8 was staged
    with other bytes than its checksum's, and the commit refused it. Copied as ints now."""
    mask = torch.arange(24, dtype=torch.uint8).view(torch.bool).reshape(4, 6).t()
    sd = {"mask": mask, "w": torch.ones(3)}
    ck = await init_checkpoint(tmp_path / "ck", sd)
    assert_same(ck.load_state_dict(), sd)
    await ck.close()
    # (same_bytes compares the bytes: it copied a non-contiguous bool as bools, hiding this)
    assert not same_bytes(mask, mask.contiguous()) and same_bytes(mask, raw_clone(mask))


@pytest.mark.parametrize(
    ("op", "dense"), [("set", False), ("xor", False), ("set", True), ("xor", True)]
)
async def test_delta_bit_exact(tmp_path: Path, op: Op, dense: bool) -> None:
    sd0 = mixed_state(0)
    ck = await init_checkpoint(tmp_path, sd0)
    sd1 = mutate(sd0, 0.05, seed=1)
    m1 = build_manifest(sd1, 1, base=sd0)
    await apply_version(ck, m1, delta_batches(m1, sd0, sd1, op, dense), "delta")
    assert ck.state.version == 1
    assert_same(ck.load_state_dict(), sd1)
    assert verify_checkpoint(tmp_path, m1) == []
    assert verify_checkpoint(tmp_path, build_manifest(sd0, 0)) != []
    await ck.acknowledged()  # the undo records go after the ack (kept as spares, never read)
    assert undo_records(tmp_path) == []
    # a second delta on top, then reopen
    sd2 = mutate(sd1, 0.01, seed=2)
    m2 = build_manifest(sd2, 2, base=sd1)
    await apply_version(ck, m2, delta_batches(m2, sd1, sd2, op, dense), "delta")
    await ck.close()
    ck = LocalCheckpoint(tmp_path)
    assert (await ck.open()).version == 2
    assert_same(ck.load_state_dict(), sd2)
    assert (
        json.loads((tmp_path / "model.safetensors.index.json").read_text())["metadata"][
            "asyncsync_version"
        ]
        == 2
    )
    await ck.close()


async def test_checksum_mismatch_rolls_back(tmp_path: Path) -> None:
    sd0 = mixed_state(0)
    ck = await init_checkpoint(tmp_path, sd0)
    sd1 = mutate(sd0, 0.05, seed=1)
    name = "model.layers.2.weight"
    bad = build_manifest(sd1, 1, base=sd0, bad_checksum=name)
    with pytest.raises(ChecksumMismatch) as ei:
        await apply_version(ck, bad, delta_batches(bad, sd0, sd1), "delta")
    assert ei.value.tensor == name and ei.value.path and ei.value.path.endswith(".safetensors")
    assert ck.state.version == 0
    assert_same(ck.load_state_dict(), sd0)
    state = json.loads((tmp_path / ".asyncsync" / "state.json").read_text())
    assert (state["status"], state["version"]) == ("clean", 0)
    # the engine is usable afterwards
    good = build_manifest(sd1, 1, base=sd0)
    await apply_version(ck, good, delta_batches(good, sd0, sd1), "delta")
    assert_same(ck.load_state_dict(), sd1)
    await ck.close()


@pytest.mark.parametrize("op", ["set", "xor"])
async def test_patched_tensors_are_verified_by_the_checksum_of_the_patch_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, op: Op
) -> None:
    """The commit checks each patched tensor by the checksum taken as it was patched: a patch
    made against other bytes is caught and rolled back, and a good version is not hashed from
    the files again; with tensors that share bytes in the files, it is (the digests could be
    stale)."""
    from receiver.engines.checkpoint import inplace

    sd0 = mixed_state(0)
    ck = await init_checkpoint(tmp_path, sd0)
    sd1 = mutate(sd0, 0.05, seed=1)
    m1 = build_manifest(sd1, 1, base=sd0)
    other = mutate(sd0, 0.05, seed=2)  # patches from other bytes: wrong results on sd0
    with pytest.raises(ChecksumMismatch):
        await apply_version(ck, m1, delta_batches(m1, other, sd1, op), "delta")
    assert ck.state.version == 0
    assert_same(ck.load_state_dict(), sd0)
    hashed: list[str] = []
    real = FileMaps.checksum

    def counting(self: FileMaps, loc: TensorLocation, *args: Any) -> str:
        hashed.append(loc.name)
        return real(self, loc, *args)

    monkeypatch.setattr(FileMaps, "checksum", counting)
    await apply_version(ck, m1, delta_batches(m1, sd0, sd1, op), "delta")
    assert_same(ck.load_state_dict(), sd1)
    assert hashed == []
    sd2 = mutate(sd1, 0.05, seed=3)
    m2 = build_manifest(sd2, 2, base=sd1)
    monkeypatch.setattr(inplace, "disjoint", lambda layout: False)
    await apply_version(ck, m2, delta_batches(m2, sd1, sd2, op), "delta")
    assert_same(ck.load_state_dict(), sd2)
    assert sorted(hashed) == sorted(e.name for e in m2.tensors if e.changed)
    await ck.close()


def test_disjoint_tensor_locations() -> None:
    from receiver.engines.checkpoint.inplace import disjoint

    def loc(name: str, file: str, begin: int, end: int) -> TensorLocation:
        return TensorLocation(name, file, torch.uint8, (end - begin,), begin, end)

    apart = {"a": loc("a", "f", 8, 16), "b": loc("b", "f", 16, 20), "c": loc("c", "g", 8, 30)}
    assert disjoint(apart)
    assert disjoint({**apart, "e": loc("e", "f", 12, 12)})  # empty: shares no byte
    assert not disjoint({**apart, "d": loc("d", "f", 15, 17)})


async def test_unchanged_tensor_with_other_checksum_is_caught(tmp_path: Path) -> None:
    sd0 = mixed_state(0)
    ck = await init_checkpoint(tmp_path, sd0)
    sd1 = mutate(sd0, 0.05, seed=1, names=["model.layers.0.weight"])
    bad = build_manifest(sd1, 1, base=sd0, bad_checksum="model.layers.5.weight")
    assert bad.tensor_map()["model.layers.5.weight"].changed == 0
    with pytest.raises(ChecksumMismatch) as ei:
        await apply_version(ck, bad, delta_batches(bad, sd0, sd1), "delta")
    assert ei.value.tensor == "model.layers.5.weight" and ck.state.version == 0
    assert_same(ck.load_state_dict(), sd0)
    await ck.close()


async def test_abort_restores_and_refusals(tmp_path: Path) -> None:
    sd0 = mixed_state(0)
    ck = await init_checkpoint(tmp_path, sd0)
    sd1 = mutate(sd0, 0.3, seed=1)
    m1 = build_manifest(sd1, 1, base=sd0)
    await ck.begin(m1, "delta")
    for b in delta_batches(m1, sd0, sd1, "xor"):
        await ck.apply(b)
    with pytest.raises(ApplyFailed, match="updated twice"):
        await ck.apply(delta_batches(m1, sd0, sd1, "xor", n=1)[0][:1])
    await ck.abort()
    assert ck.state.version == 0
    assert_same(ck.load_state_dict(), sd0)
    # full abort leaves the old files and an empty staging dir
    await ck.begin(build_manifest(sd1, 1), "full")
    await ck.apply(full_batches(build_manifest(sd1, 1), sd1)[0])
    await ck.abort()
    assert list((tmp_path / ".asyncsync" / "staging").iterdir()) == []
    assert_same(ck.load_state_dict(), sd0)
    # out of order, other run, unknown tensor, other shape: refused before anything changes
    with pytest.raises(OutOfOrder):
        await ck.begin(build_manifest(mutate(sd1, 0.1, 3), 2, base=sd1), "delta")
    with pytest.raises(OutOfOrder, match="run"):
        await ck.begin(build_manifest(sd1, 1, base=sd0, run_id="run-b"), "delta")
    with pytest.raises(ApplyFailed, match=r"adds 1 \(e\.g\. 'extra'\)"):
        await ck.begin(
            build_manifest(
                {**sd1, "extra": torch.zeros(2)}, 1, base={**sd0, "extra": torch.zeros(2)}
            ),
            "delta",
        )
    reshaped = {**sd0, "model.scalar": torch.zeros(2)}
    with pytest.raises(ApplyFailed, match=r"model\.scalar"):
        await ck.begin(build_manifest(reshaped, 1, base=reshaped), "delta")
    assert ck.state.version == 0
    assert_same(ck.load_state_dict(), sd0)
    await ck.close()


async def test_bump_and_empty_engine(tmp_path: Path) -> None:
    sd0 = mixed_state(0)
    empty = LocalCheckpoint(tmp_path / "e")
    await empty.open()
    with pytest.raises(OutOfOrder):
        await empty.bump(build_manifest(sd0, 1, base=sd0))
    await empty.close()
    ck = await init_checkpoint(tmp_path / "c", sd0)
    m1 = build_manifest(sd0, 1, base=sd0)
    await ck.bump(m1)
    assert ck.state == type(ck.state)(1, "run-a", m1.fingerprint)
    with pytest.raises(OutOfOrder):
        await ck.bump(m1)
    await ck.close()
    ck = LocalCheckpoint(tmp_path / "c")
    assert (await ck.open()).version == 1
    assert_same(ck.load_state_dict(), sd0)
    await ck.close()


async def test_full_replaces_and_checks(tmp_path: Path) -> None:
    sd0 = mixed_state(0)
    ck = await init_checkpoint(tmp_path, sd0)
    sd1 = {k: v for k, v in mutate(sd0, 0.5, seed=1).items() if k != "model.scalar"}
    sd1["new.tensor"] = torch.arange(6, dtype=torch.int32)
    bad = build_manifest(sd1, 1, bad_checksum="new.tensor")
    with pytest.raises(ChecksumMismatch) as ei:
        await apply_version(ck, bad, full_batches(bad, sd1), "full")
    assert ei.value.tensor == "new.tensor"
    assert_same(ck.load_state_dict(), sd0)
    m1 = build_manifest(sd1, 1)
    await ck.begin(m1, "full")
    await ck.apply(full_batches(m1, sd1)[0])
    with pytest.raises(ApplyFailed, match="never arrived"):
        await ck.commit()
    assert ck.state.version == 0
    await apply_version(ck, m1, full_batches(m1, sd1, n=3), "full")
    assert_same(ck.load_state_dict(), sd1)
    names = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert names == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    await ck.close()


async def test_lock_and_foreign_dirs(tmp_path: Path) -> None:
    ck = await init_checkpoint(tmp_path / "c", {"w": torch.ones(3)})
    other = LocalCheckpoint(tmp_path / "c")
    with pytest.raises(LockHeld, match=str(os.getpid())):
        await other.open()
    await ck.close()
    assert (await other.open()).version == 0
    await other.close()
    foreign = tmp_path / "f"
    foreign.mkdir()
    safetensors.torch.save_file({"w": torch.ones(2)}, foreign / "model.safetensors")
    with pytest.raises(EngineStateError, match="empty directory"):
        await LocalCheckpoint(foreign).open()
    assert not (foreign / ".asyncsync").exists()
    (tmp_path / "c" / ".asyncsync" / "state.json").write_text("{not json")
    with pytest.raises(EngineStateError, match="remove"):
        await LocalCheckpoint(tmp_path / "c").open()


_CHILD = r"""
import asyncio, os, sys, torch
import receiver.engines.checkpoint as ck
import receiver.engines.checkpoint.inplace as ckip
from tests.test_engines import load_batches
data = load_batches(sys.argv[2])
mode = sys.argv[3]
n = [0]
if mode == "delta":
    def dying(real):  # the patch alone, the one that also takes the checksum, or a journal pass
        def patch(*args, **kw):
            n[0] += 1
            if n[0] > 3:
                os._exit(17)
            return real(*args, **kw)
        return patch
    ckip.apply_patch = dying(ckip.apply_patch)
    ckip.patch_and_checksum = dying(ckip.patch_and_checksum)
    ckip.JournalPass.run = dying(ckip.JournalPass.run)
else:
    real_replace = os.replace
    def dying_replace(a, b, **kw):
        if "staging" in str(a):
            n[0] += 1
            if n[0] == 2:
                os._exit(17)
        real_replace(a, b, **kw)
    os.replace = dying_replace
async def main():
    e = ck.LocalCheckpoint(sys.argv[1], sync_before_ack=sys.argv[4:] == ["durable"])
    await e.open()
    await e.begin(data["manifest"], mode)
    for batch in data["batches"]:
        await e.apply(batch)
    await e.commit()
asyncio.run(main())
"""


def undo_records(ckdir: str | Path) -> list[str]:
    """The names in a checkpoint's journal directory but its spare records (never read)."""
    jdir = Path(ckdir) / ".asyncsync" / "journal"
    return sorted(p.name for p in jdir.iterdir() if not p.name.startswith(journal.SPARE_PREFIX))


def run_crashing_child(
    tmp_path: Path, ckdir: Path, m: Manifest, batches: object, mode: str, *, durable: bool = False
) -> None:
    payload = tmp_path / "payload.pt"
    torch.save({"manifest": m, "batches": batches}, payload)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(ckdir), str(payload), mode]
        + (["durable"] if durable else []),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 17, proc.stderr


def xef_batches(
    m: Manifest, old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], n: int = 2
) -> list[list[TensorUpdate]]:
    """Delta batches as the agent decodes them from xef shards (patches carry positions_xef)."""
    from asyncsync import codec

    ups = []
    for e in m.tensors:
        if not e.changed:
            continue
        o, w = int_view(old[e.name]), int_view(new[e.name])
        pos = torch.nonzero(o != w).reshape(-1)
        enc = codec.encode_delta(o.reshape(-1), w.reshape(-1), pos, "xef")
        patch = codec.decode_delta(
            "xef", enc.mode, enc.positions, enc.values,
            changed=enc.changed, numel=o.numel(), dtype=o.dtype,
        )  # fmt: skip
        ups.append(TensorUpdate(e, patch=patch))
    return [ups[i::n] for i in range(n) if ups[i::n]]


def load_batches(path: str) -> dict[str, Any]:
    """A ``torch.save``d ``{"manifest", "batches"}`` payload, read back in a child process with
    its xef patches vouched for again, as the agent's own decoder makes them (a Patch's blob is
    honoured only for the very positions it was decoded with: :meth:`Patch.decoded_xef`)."""
    from dataclasses import replace

    from asyncsync.codec import Patch

    data: dict[str, Any] = torch.load(path, weights_only=False)

    def vouched(u: TensorUpdate) -> TensorUpdate:
        p = u.patch
        if p is None or p.positions is None or p.positions_xef is None:
            return u
        return replace(u, patch=Patch.of_xef(p.op, p.positions, p.values, p.positions_xef))

    data["batches"] = [[vouched(u) for u in b] for b in data["batches"]]
    return data


def journal_codings(ckdir: Path) -> tuple[set[str], list[list[str]]]:
    """(the record kinds, each record's positions codings) in a checkpoint's journal."""
    kinds, codings = set(), []
    for p in (ckdir / ".asyncsync" / "journal").glob("undo-*"):
        if p.suffix == ".progressive":
            data = p.read_bytes()
            meta = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
            codings.append(meta["positions"])
        else:
            meta = safetensors.safe_open(str(p), "pt").metadata() or {}
            codings.append(json.loads(meta["positions"]))
        kinds.add(p.suffix)
    return kinds, codings


@pytest.mark.parametrize("durable", [False, True], ids=["progressive", "durable"])
@pytest.mark.parametrize("decoded", [False, True], ids=["made-up", "xef-decoded"])
async def test_crash_during_delta_recovers_old_bytes(
    tmp_path: Path, decoded: bool, durable: bool
) -> None:
    """Killed mid-patch, reopened: the old bytes are back (with xef-decoded patches the undo
    records keep the shards' positions blobs, journal coding ``xef``). An engine that acks
    before its data is durable writes progressive records, one with ``sync_before_ack``
    durable ones."""
    sd0 = mixed_state(0)
    ck = await init_checkpoint(tmp_path / "c", sd0)
    await ck.close()
    sd1 = mutate(sd0, 0.2, seed=1)
    m1 = build_manifest(sd1, 1, base=sd0)
    batches = xef_batches(m1, sd0, sd1) if decoded else delta_batches(m1, sd0, sd1, "xor")
    if decoded:
        assert all(u.patch is not None and u.patch.positions_xef for b in batches for u in b)
    run_crashing_child(tmp_path, tmp_path / "c", m1, batches, "delta", durable=durable)
    kinds, codings = journal_codings(tmp_path / "c")
    assert kinds == ({".safetensors"} if durable else {".progressive"})
    assert codings and ({"xef"} if decoded else {"ef"}) == {c for cs in codings for c in cs}
    state = json.loads((tmp_path / "c" / ".asyncsync" / "state.json").read_text())
    assert (state["status"], state["target_version"]) == ("applying", 1)
    assert verify_checkpoint(tmp_path / "c", build_manifest(sd0, 0)) != []  # half-patched
    ck = LocalCheckpoint(tmp_path / "c")
    assert (await ck.open()).version == 0
    assert_same(ck.load_state_dict(), sd0)
    assert list((tmp_path / "c" / ".asyncsync" / "journal").iterdir()) == []
    await apply_version(ck, m1, delta_batches(m1, sd0, sd1), "delta")
    assert_same(ck.load_state_dict(), sd1)
    await ck.close()


async def test_crash_during_full_leaves_empty_engine(tmp_path: Path) -> None:
    sd0 = mixed_state(0)
    ck = await init_checkpoint(tmp_path / "c", sd0)
    await ck.close()
    sd1 = mutate(sd0, 0.5, seed=1)
    m1 = build_manifest(sd1, 1)
    run_crashing_child(tmp_path, tmp_path / "c", m1, full_batches(m1, sd1, 3), "full")
    ck = LocalCheckpoint(tmp_path / "c")
    assert (await ck.open()).version is None
    assert list((tmp_path / "c").glob("*.safetensors*")) == []
    assert list((tmp_path / "c" / ".asyncsync" / "staging").iterdir()) == []
    await apply_version(ck, m1, full_batches(m1, sd1), "full")
    assert_same(ck.load_state_dict(), sd1)
    await ck.close()


async def test_in_process_crash_then_reopen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sd0 = mixed_state(0)
    ck = await init_checkpoint(tmp_path, sd0)
    sd1 = mutate(sd0, 0.1, seed=1)
    m1 = build_manifest(sd1, 1, base=sd0)
    calls = [0]

    def flaky(real: Any) -> Any:  # the patch alone, with the checksum, or a journal pass
        def patch(*args: Any, **kw: Any) -> Any:
            calls[0] += 1
            if calls[0] == 4:
                raise RuntimeError("injected")
            return real(*args, **kw)

        return patch

    monkeypatch.setattr(ckpt_mod, "apply_patch", flaky(ckpt_mod.apply_patch))
    monkeypatch.setattr(ckpt_mod, "patch_and_checksum", flaky(ckpt_mod.patch_and_checksum))
    monkeypatch.setattr(ckpt_mod.JournalPass, "run", flaky(ckpt_mod.JournalPass.run))
    await ck.begin(m1, "delta")
    with pytest.raises(ApplyFailed, match="injected"):
        for b in delta_batches(m1, sd0, sd1, dense=True):
            await ck.apply(b)
    # "die": drop the object without abort, releasing what the kernel would release
    assert ck._txn is not None and ck._txn.maps is not None
    ck._txn.maps.close()
    ck._store.close()
    del ck
    ck = LocalCheckpoint(tmp_path)
    assert (await ck.open()).version == 0
    assert_same(ck.load_state_dict(), sd0)
    await ck.close()


# --------------------------------------------------------------------------- TorchModule


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.proj = torch.nn.Linear(8, 8).to(torch.bfloat16)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.t = torch.nn.Parameter(torch.randn(6, 5).t())  # not contiguous
        self.register_buffer("steps", torch.tensor(3, dtype=torch.int64))
        self.register_buffer("mask", torch.ones(7, dtype=torch.bool))


def module_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in Tiny().state_dict().items():
        raw = torch.randint(0, 256, (v.numel() * v.element_size(),), dtype=torch.uint8, generator=g)
        out[k] = (raw & 1 if v.dtype == torch.bool else raw).view(v.dtype).reshape(v.shape)
    out["head.weight"] = out["emb.weight"]
    return out


def module_tensors(mod: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in mod.state_dict().items()}


@pytest.mark.parametrize(("op", "dense"), [("set", False), ("xor", True)])
async def test_torch_module_full_and_delta(tmp_path: Path, op: Op, dense: bool) -> None:
    mod = Tiny()
    eng = TorchModule(mod)
    await eng.open()
    sd0 = module_state(0)
    m0 = build_manifest(sd0, 0)
    await apply_version(eng, m0, full_batches(m0, sd0), "full")
    assert_same(module_tensors(mod), sd0)
    assert mod.head.weight is mod.emb.weight and not mod.t.is_contiguous()
    sd1 = mutate(sd0, 0.2, seed=1)
    sd1["head.weight"] = sd1["emb.weight"]
    m1 = build_manifest(sd1, 1, base=sd0)
    await apply_version(eng, m1, delta_batches(m1, sd0, sd1, op, dense), "delta")
    assert eng.state.version == 1
    assert_same(module_tensors(mod), sd1)
    # checksum mismatch: rollback, named tensor
    sd2 = mutate(sd1, 0.2, seed=2)
    sd2["head.weight"] = sd2["emb.weight"]
    bad = build_manifest(sd2, 2, base=sd1, bad_checksum="t")
    with pytest.raises(ChecksumMismatch) as ei:
        await apply_version(eng, bad, delta_batches(bad, sd1, sd2, op, dense), "delta")
    assert ei.value.tensor == "t" and eng.state.version == 1
    assert_same(module_tensors(mod), sd1)
    # abort of a full version restores too
    await eng.begin(build_manifest(sd2, 2), "full")
    await eng.apply(full_batches(build_manifest(sd2, 2), sd2, 1)[0])
    await eng.abort()
    assert_same(module_tensors(mod), sd1)
    await eng.bump(build_manifest(sd1, 2, base=sd1))
    assert eng.state.version == 2
    await eng.close()


async def test_torch_module_refusals_and_persisted_state(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mod = Tiny()
    eng = TorchModule(mod, state_dir=tmp_path / "st")
    assert (await eng.open()).version is None
    with pytest.raises(LockHeld):
        await TorchModule(mod, state_dir=tmp_path / "st").open()
    sd0 = module_state(0)
    with pytest.raises(ApplyFailed, match="not in the module"):
        await eng.begin(build_manifest({**sd0, "ghost": torch.zeros(1)}, 0), "full")
    with pytest.raises(ApplyFailed, match="module has"):
        await eng.begin(build_manifest({**sd0, "steps": torch.zeros(2)}, 0), "full")
    partial = {k: v for k, v in sd0.items() if k != "mask"}
    m0 = build_manifest(partial, 0)
    with caplog.at_level(logging.WARNING):
        await apply_version(eng, m0, full_batches(m0, partial), "full")
    assert "mask" in caplog.text
    with pytest.raises(OutOfOrder):
        await eng.begin(build_manifest(partial, 5, base=partial), "delta")
    await eng.close()
    # a new engine over the same module finds the version; a changed module loses it
    eng = TorchModule(mod, state_dir=tmp_path / "st")
    assert (await eng.open()).version == 0
    await eng.close()
    with torch.no_grad():
        mod.proj.bias.add_(1)
    eng = TorchModule(mod, state_dir=tmp_path / "st")
    assert (await eng.open()).version is None
    await eng.close()


class Flat(torch.nn.Module):
    """24 parameters of their own, and 8 that are views of one flat buffer (a flat-parameter
    layout): the pool patches the first apart and the views one after another."""

    def __init__(self) -> None:
        super().__init__()
        for i in range(24):
            self.register_parameter(f"p{i}", torch.nn.Parameter(torch.zeros(4096)))
        flat = torch.zeros(8 * 512)
        for i in range(8):
            self.register_parameter(f"v{i}", torch.nn.Parameter(flat[i * 512 : (i + 1) * 512]))


async def flat_module_at_v0() -> tuple[Flat, TorchModule, dict[str, torch.Tensor]]:
    """A Flat module under an open TorchModule that took a random full version 0."""
    mod = Flat()
    eng = TorchModule(mod)
    await eng.open()
    g = torch.Generator().manual_seed(0)
    sd0 = {k: torch.randn(v.shape, generator=g) for k, v in mod.state_dict().items()}
    m0 = build_manifest(sd0, 0)
    await apply_version(eng, m0, full_batches(m0, sd0), "full")
    return mod, eng, sd0


@pytest.mark.parametrize("op", ["set", "xor"])
async def test_torch_module_patches_on_the_pool_and_rolls_back_a_failed_batch(op: Op) -> None:
    mod, eng, sd0 = await flat_module_at_v0()
    assert mod.v0.untyped_storage().data_ptr() == mod.v7.untyped_storage().data_ptr()
    sd1 = mutate(sd0, 0.1, seed=1)
    m1 = build_manifest(sd1, 1, base=sd0)
    await apply_version(eng, m1, delta_batches(m1, sd0, sd1, op, n=1), "delta")
    assert_same(module_tensors(mod), sd1)
    # one patch of a batch is out of range: every other one ran, the version rolls back whole
    sd2 = mutate(sd1, 0.1, seed=2)
    m2 = build_manifest(sd2, 2, base=sd1)
    [batch] = delta_batches(m2, sd1, sd2, op, n=1)
    bad = batch[len(batch) // 2].patch
    assert bad is not None and bad.positions is not None
    bad.positions[-1] = 1 << 40
    await eng.begin(m2, "delta")
    with pytest.raises(AsyncSyncError):
        await eng.apply(batch)
    await eng.abort()
    assert eng.state.version == 1
    assert_same(module_tensors(mod), sd1)
    await eng.close()


@pytest.mark.parametrize("op", ["set", "xor"])
async def test_torch_module_verifies_by_the_checksum_of_the_patch_pass(
    monkeypatch: pytest.MonkeyPatch, op: Op
) -> None:
    """TorchModule checks a tensor patched on the CPU by the digest taken in the pass that
    patched it: a patch made against other bytes is caught and rolled back; a good version is
    not read again at commit, the disjoint views of one flat buffer included. Tensors whose
    memory overlaps (two storages over one array: a later patch could make an earlier digest
    stale) are read again, so two patches that disagree on a shared byte are caught (found by
    an attack on a real Publisher and ReceiverAgent)."""
    import numpy as np

    from receiver.engines import torch_module

    mod, eng, sd0 = await flat_module_at_v0()
    sd1 = mutate(sd0, 0.05, seed=1)
    m1 = build_manifest(sd1, 1, base=sd0)
    other = mutate(sd1, 0.05, seed=2)  # patches from other bytes: wrong results on sd0
    with pytest.raises(ChecksumMismatch):
        await apply_version(eng, m1, delta_batches(m1, other, sd1, op), "delta")
    assert eng.state.version == 0
    assert_same(module_tensors(mod), sd0)
    hashed: list[str] = []
    real = torch_module.entry_checksum

    def counting(entry: Any, *args: Any) -> str:
        hashed.append(entry.name)
        return real(entry, *args)

    monkeypatch.setattr(torch_module, "entry_checksum", counting)
    await apply_version(eng, m1, delta_batches(m1, sd0, sd1, op), "delta")
    assert eng.state.version == 1
    assert_same(module_tensors(mod), sd1)
    assert hashed == []
    await eng.close()

    class Overlap(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            arena = np.zeros(150, dtype=np.float32)  # a = arena[0:100], b = arena[50:150]
            self.register_buffer("a", torch.from_numpy(arena[0:100]))
            self.register_buffer("b", torch.from_numpy(arena[50:150]))

    mod2 = Overlap()
    assert mod2.a.untyped_storage().data_ptr() != mod2.b.untyped_storage().data_ptr()
    eng = TorchModule(mod2)
    await eng.open()
    s0 = {"a": torch.arange(100.0), "b": torch.arange(50.0, 150.0)}
    m0 = build_manifest(s0, 0)
    await apply_version(eng, m0, full_batches(m0, s0), "full")
    s1 = {k: t.clone() for k, t in s0.items()}
    s1["a"][55], s1["b"][5] = -1.0, -2.0  # one byte of the arena, two values
    m1 = build_manifest(s1, 1, base=s0)
    hashed.clear()
    with pytest.raises(ChecksumMismatch):
        await apply_version(eng, m1, delta_batches(m1, s0, s1, op), "delta")
    assert sorted(hashed) == ["a", "b"] and eng.state.version == 0
    assert_same(module_tensors(mod2), s0)
    await eng.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_torch_module_on_cuda() -> None:
    mod = Tiny().cuda()
    eng = TorchModule(mod)
    sd0 = module_state(0)
    m0 = build_manifest(sd0, 0)
    await apply_version(eng, m0, full_batches(m0, sd0), "full")
    sd1 = mutate(sd0, 0.2, seed=1)
    sd1["head.weight"] = sd1["emb.weight"]
    m1 = build_manifest(sd1, 1, base=sd0)
    await apply_version(eng, m1, delta_batches(m1, sd0, sd1, "xor"), "delta")
    assert_same({k: v.cpu() for k, v in module_tensors(mod).items()}, sd1)
    sd2 = mutate(sd1, 0.2, seed=2)
    sd2["head.weight"] = sd2["emb.weight"]
    bad = build_manifest(sd2, 2, base=sd1, bad_checksum="emb.weight")
    with pytest.raises(ChecksumMismatch):
        await apply_version(eng, bad, delta_batches(bad, sd1, sd2, "set", True), "delta")
    assert_same({k: v.cpu() for k, v in module_tensors(mod).items()}, sd1)


# --------------------------------------------------------------------------- durability after ack


def _state(path: Path) -> dict[str, Any]:
    return json.loads((path / ".asyncsync" / "state.json").read_text())


@pytest.mark.parametrize("before", [False, True])
async def test_a_delta_is_made_durable_after_or_before_the_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, before: bool
) -> None:
    sd0 = mixed_state(0)
    ck = await init_checkpoint(tmp_path, sd0)
    ck.sync_before_ack = before
    gate = threading.Event()
    synced = FileMaps.sync
    acked = False
    calls: list[bool] = []  # for each flush: had the ack been given when it began?

    def slow_sync(self: FileMaps) -> None:  # hold the flush until the test has looked
        calls.append(acked)
        gate.wait(10)
        synced(self)

    monkeypatch.setattr(FileMaps, "sync", slow_sync)
    sd1 = mutate(sd0, 0.05, seed=1)
    m1 = build_manifest(sd1, 1, base=sd0)
    if before:
        gate.set()
    await apply_version(ck, m1, delta_batches(m1, sd0, sd1), "delta")
    assert ck.state.version == 1 and verify_checkpoint(tmp_path, m1) == []
    st = _state(tmp_path)
    assert (st["status"], st["version"], st.get("synced", True)) == ("clean", 1, before)
    # deferred: no flush before the ack, neither started nor about to start (none submitted
    # to the engine's flush thread)
    assert ck._flusher.pending is None
    assert calls == [False] * int(before)
    acked = True
    await ck.acknowledged()  # the agent calls this once the ack is written
    gate.set()
    await ck.flushed()
    assert calls == [not before]  # the one flush: at the commit, or after the ack
    assert _state(tmp_path).get("synced", True) is True
    # the next delta starts only after the flush, and ends the same way
    sd2 = mutate(sd1, 0.05, seed=2)
    m2 = build_manifest(sd2, 2, base=sd1)
    await apply_version(ck, m2, delta_batches(m2, sd1, sd2), "delta")
    await ck.close()  # waits for the flush
    assert _state(tmp_path).get("synced", True) is True
    assert_same(LocalCheckpoint(tmp_path).load_state_dict(), sd2)


async def test_the_next_delta_applies_while_the_last_one_is_flushed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """v2 begins, journals, patches and commits while v1's flush is held (it does not wait for
    it); a crash in that overlap (a copy of the directory: a killed process keeps the page
    cache) reopens at v1, checked because v1 was not durable yet; v2 is durable once flushed."""
    sd0 = mixed_state(0)
    ck = await init_checkpoint(tmp_path / "ck", sd0)
    sd1 = mutate(sd0, 0.05, seed=1)
    m1 = build_manifest(sd1, 1, base=sd0)
    await apply_version(ck, m1, delta_batches(m1, sd0, sd1), "delta")
    started, gate, held = threading.Event(), threading.Event(), [True]
    synced = FileMaps.sync

    def held_sync(self: FileMaps) -> None:
        started.set()
        held[0] = gate.wait(20)  # released below; the timeout keeps a broken run from hanging
        synced(self)

    monkeypatch.setattr(FileMaps, "sync", held_sync)
    await ck.acknowledged()  # v1's flush starts and is held in its msync
    assert await asyncio.to_thread(started.wait, 10)
    sd2 = mutate(sd1, 0.05, seed=2)
    m2 = build_manifest(sd2, 2, base=sd1)
    batches = delta_batches(m2, sd1, sd2)
    await ck.begin(m2, "delta")  # does not wait for v1's flush
    await ck.apply(batches[0])
    st = _state(tmp_path / "ck")
    assert (st["status"], st["version"], st["target_version"], st["synced"]) == (
        "applying", 1, 2, False,
    )  # fmt: skip
    shutil.copytree(tmp_path / "ck", tmp_path / "crashed")  # the crash: v2 half applied
    for b in batches[1:]:
        await ck.apply(b)
    await ck.commit()
    assert (_state(tmp_path / "ck")["version"], _state(tmp_path / "ck")["synced"]) == (2, False)
    assert held[0] and not gate.is_set()  # v1's flush was held the whole time
    gate.set()
    await ck.acknowledged()
    await ck.flushed()  # v1's flush, then v2's
    st = _state(tmp_path / "ck")
    assert (st["version"], st.get("synced", True)) == (2, True)
    await ck.close()
    assert_same(LocalCheckpoint(tmp_path / "ck").load_state_dict(), sd2)
    crashed = LocalCheckpoint(tmp_path / "crashed")
    assert (await crashed.open()).version == 1  # v2 undone from its journal; v1 checked
    assert _state(tmp_path / "crashed").get("synced", True) is True
    assert_same(crashed.load_state_dict(), sd1)
    await crashed.close()


def test_a_flush_outlives_the_event_loop_that_started_it(tmp_path: Path) -> None:
    """A committed delta's flush was a task of the loop that started it (``acknowledged``):
    ``asyncio.run`` cancels what is pending as it ends, so the engine used under a later
    ``asyncio.run`` (an agent driven by one ``asyncio.run`` per sync) found a cancelled flush:
    v1 never made durable, and ``close`` raised CancelledError. The flushes run on the
    engine's own thread now, whatever loop awaits them."""
    sd0 = mixed_state(0)
    sd1 = mutate(sd0, 0.05, seed=1)

    async def apply_and_ack() -> LocalCheckpoint:
        ck = await init_checkpoint(tmp_path, sd0)
        m1 = build_manifest(sd1, 1, base=sd0)
        await apply_version(ck, m1, delta_batches(m1, sd0, sd1), "delta")
        await ck.acknowledged()  # v1's flush starts; this loop ends before anyone awaits it
        return ck

    ck = asyncio.run(apply_and_ack())
    asyncio.run(ck.close())  # waits for v1's flush
    assert _state(tmp_path).get("synced", True) is True
    assert_same(LocalCheckpoint(tmp_path).load_state_dict(), sd1)


async def test_a_failed_flush_refuses_the_next_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """v1's flush fails while v2 is applied beside it: v2 is not committed (rolled back), the
    engine says it is broken until the next begin checks v1 again (tests/test_flush.py)."""
    sd0 = mixed_state(0)
    ck = await init_checkpoint(tmp_path, sd0)
    sd1 = mutate(sd0, 0.05, seed=1)
    m1 = build_manifest(sd1, 1, base=sd0)
    await apply_version(ck, m1, delta_batches(m1, sd0, sd1), "delta")
    sd2 = mutate(sd1, 0.05, seed=2)
    m2 = build_manifest(sd2, 2, base=sd1)
    working, begun = FileMaps.sync, threading.Event()

    def eio(self: FileMaps) -> None:
        begun.wait(10)  # (the flush thread starts at once: fail once v2 has begun)
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(FileMaps, "sync", eio)
    await ck.begin(m2, "delta")  # starts v1's flush, which fails
    begun.set()
    with pytest.raises(ApplyFailed):
        await asyncio.wrap_future(ck._flusher.pending)  # type: ignore[arg-type]
    monkeypatch.setattr(FileMaps, "sync", working)
    for b in delta_batches(m2, sd1, sd2):
        await ck.apply(b)
    with pytest.raises(EngineStateError, match="durable"):
        await ck.commit()
    assert ck.state.version == 1 and _state(tmp_path)["synced"] is False
    await ck.close()
    ck = LocalCheckpoint(tmp_path)
    assert (await ck.open()).version == 1  # checked at open: the pages are still there
    assert_same(ck.load_state_dict(), sd1)
    await ck.close()


async def _v1_committed_not_synced(tmp_path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A checkpoint at v1 whose state.json says committed, not synced (as if killed between
    the commit and the background flush): (v1's state dict, the state.json written)."""
    sd0 = mixed_state(0)
    ck = await init_checkpoint(tmp_path, sd0)
    sd1 = mutate(sd0, 0.05, seed=1)
    m1 = build_manifest(sd1, 1, base=sd0)
    await apply_version(ck, m1, delta_batches(m1, sd0, sd1), "delta")
    await ck.close()
    st = _state(tmp_path)
    st["synced"] = False
    (tmp_path / ".asyncsync" / "state.json").write_text(json.dumps(st))
    return sd1, st


async def test_reopen_after_a_crash_before_the_flush(tmp_path: Path) -> None:
    """state.json says committed but not synced: a process crash (page cache intact) keeps the
    version; lost pages (the machine went down) wipe it so the receiver re-seeds."""
    sd1, st = await _v1_committed_not_synced(tmp_path)
    ck = LocalCheckpoint(tmp_path)
    assert (await ck.open()).version == 1  # the bytes still match: kept, and now durable
    assert _state(tmp_path).get("synced", True) is True
    assert_same(ck.load_state_dict(), sd1)
    await ck.close()
    # now lose a page of one tensor's new bytes
    st["synced"] = False
    (tmp_path / ".asyncsync" / "state.json").write_text(json.dumps(st))
    loc = read_layout(tmp_path / "model-00001-of-00002.safetensors")
    first = min(loc.values(), key=lambda t: t.begin)
    with open(tmp_path / first.file, "r+b") as f:
        f.seek(first.begin)
        f.write(bytes(b ^ 0xFF for b in f.read(16)))
    ck = LocalCheckpoint(tmp_path)
    assert (await ck.open()).version is None  # the receiver re-initialises from a keyframe
    assert list(tmp_path.glob("*.safetensors*")) == []
    await ck.close()


async def test_reopen_after_a_crash_before_the_flush_refuses_a_fifo_as_a_running_engine_does(
    tmp_path: Path,
) -> None:
    """A FIFO put in place of a data file of a version committed but not durable: the open
    removed it with the files (and re-initialised), where a running engine's check refuses it
    and leaves it (``_refuse_unsafe``). One rule now: refused, named, left, never opened; once
    it is removed the open re-initialises as for a lost file."""
    await _v1_committed_not_synced(tmp_path)
    data = tmp_path / "model-00001-of-00002.safetensors"
    data.unlink()
    os.mkfifo(data)
    ck = LocalCheckpoint(tmp_path)
    with pytest.raises(EngineStateError, match="FIFO"):
        await ck.open()
    await ck.close()
    assert data.is_fifo() and _state(tmp_path)["version"] == 1  # left as it was
    data.unlink()
    ck = LocalCheckpoint(tmp_path)
    assert (await ck.open()).version is None  # a file lost: re-initialised from a keyframe
    await ck.close()


def test_state_synced_field_round_trips_and_is_validated() -> None:
    ps = PersistedState(version=3, run_id="r", synced=False)
    assert '"synced": false' in ps.to_json()
    assert PersistedState.from_json(ps.to_json(), where="x") == ps
    assert "synced" not in PersistedState(version=3).to_json()  # the default stays implicit
    bad = json.loads(ps.to_json())
    bad["synced"] = "no"
    with pytest.raises(EngineStateError, match="synced"):
        PersistedState.from_json(json.dumps(bad), where="x")


def _location(ckdir: Path, name: str) -> TensorLocation:
    """Where ``name`` lies in a two-file checkpoint of ``mixed_state``."""
    return (
        read_layout(ckdir / "model-00001-of-00002.safetensors").get(name)
        or read_layout(ckdir / "model-00002-of-00002.safetensors")[name]
    )


@pytest.mark.parametrize("seqs", [[0], [999_999, 1_000_000]])
async def test_open_undoes_a_journal_in_the_earlier_one_tensor_per_patch_layout(
    tmp_path: Path, seqs: list[int]
) -> None:
    """A receiver upgraded while a delta was interrupted still rolls it back, records newest
    first by their group number: ``undo-1000000`` (a seventh digit) sorts before
    ``undo-999999`` by name, and undoing in that order would leave the middle value (two
    groups patched the same positions)."""
    sd0 = mixed_state(0)
    ck = await init_checkpoint(tmp_path, sd0)
    await ck.close()
    name = "model.layers.2.weight"
    maps = FileMaps(tmp_path)
    flat = maps.flat(_location(tmp_path, name))
    pos = torch.tensor([0, 5, 9], dtype=torch.int64)
    meta = {"format": "asyncsync-journal", "target_version": "1", "names": json.dumps([name])}
    jdir = tmp_path / ".asyncsync" / "journal"
    for seq, mask in zip(seqs, (0x5A5A, 0x0F0F), strict=False):  # a half-applied delta
        safetensors.torch.save_file(
            {"p0": pos, "v0": flat[pos].clone()}, jdir / f"undo-{seq:06d}.safetensors",
            metadata=meta,
        )  # fmt: skip
        flat[pos] = flat[pos] ^ mask
    del flat
    maps.sync()
    maps.close()
    st = _state(tmp_path)
    st.update(status="applying", target_version=1, mode="delta")
    (tmp_path / ".asyncsync" / "state.json").write_text(json.dumps(st))
    ck = LocalCheckpoint(tmp_path)
    assert (await ck.open()).version == 0
    assert_same(ck.load_state_dict(), sd0)
    await ck.close()


def test_undo_journal_keeps_the_xef_positions_blob_as_it_came(tmp_path: Path) -> None:
    """A decoded xef patch carries its positions blob through check_patch; the journal stores
    that blob (no Elias-Fano coding again) and reads back the same positions and old values."""
    from asyncsync import codec
    from receiver.rules import check_patch

    g = torch.Generator().manual_seed(1)
    old = torch.randint(-(2**15), 2**15, (10_000,), dtype=torch.int16, generator=g)
    new = old.clone()
    pos = torch.randperm(10_000, generator=g)[:700].sort().values
    new[pos] ^= 1
    enc = codec.encode_delta(old, new, pos, "xef")
    patch = codec.decode_delta(
        "xef", enc.mode, enc.positions, enc.values, changed=700, numel=10_000, dtype=torch.int16
    )
    checked = check_patch(patch, old, "w")
    assert checked.positions_xef == enc.positions
    loc = TensorLocation("w", "f", torch.int16, (10_000,), 0, 20_000)
    parts = journal.encode_parts([("w", loc, old, checked)], 7)
    path = tmp_path / "undo.safetensors"
    path.write_bytes(b"".join(parts))
    with safetensors.safe_open(str(path), framework="pt") as f:
        assert json.loads((f.metadata() or {})["positions"]) == ["xef"]
    ((name, got_pos, got_old),) = journal.read(path)
    assert name == "w" and got_pos is not None and torch.equal(got_pos, pos)
    assert torch.equal(got_old.view(torch.int16), old[pos])
    assert b"".join(parts) == journal.encode([("w", loc, old, checked)], 7)


def test_undo_journal_round_trips_every_kind_of_patch(tmp_path: Path) -> None:
    """Elias-Fano coded positions, raw ones (not increasing), dense patches, mixed widths."""
    g = torch.Generator().manual_seed(0)
    flats = [
        torch.randint(-(2**15), 2**15, (1000,), dtype=torch.int16, generator=g),
        torch.randint(-(2**31), 2**31 - 1, (77,), dtype=torch.int32, generator=g),
        torch.randint(0, 255, (9,), dtype=torch.uint8, generator=g),
        torch.randint(-(2**15), 2**15, (50,), dtype=torch.int16, generator=g),
    ]
    patches = [
        Patch(
            "xor", torch.tensor([0, 3, 999], dtype=torch.int64), torch.ones(3, dtype=torch.int16)
        ),
        Patch("set", torch.tensor([5, 1, 70], dtype=torch.int64), torch.ones(3, dtype=torch.int32)),
        Patch("xor", None, torch.ones(9, dtype=torch.uint8)),
        Patch("set", torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int16)),
    ]
    loc = TensorLocation("x", "f", torch.int16, (1,), 0, 2)  # unused by the journal itself
    work = [(f"t{i}", loc, f, p) for i, (f, p) in enumerate(zip(flats, patches, strict=True))]
    path = tmp_path / "undo.safetensors"
    path.write_bytes(journal.encode(work, 3))
    got = journal.read(path)
    assert [name for name, _, _ in got] == ["t0", "t1", "t2", "t3"]
    for (_, pos, old), f, p in zip(got, flats, patches, strict=True):
        if p.positions is None:
            assert pos is None and torch.equal(old.view(f.dtype), f)
        else:
            assert pos is not None and torch.equal(pos, p.positions)
            assert torch.equal(old.view(f.dtype), f[p.positions])
