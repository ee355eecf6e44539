"""A delta or zero diff whose tensor set differs from the engine's is refused before the engine
is touched, nothing is acked, and the engine always reopens (issue 13, failure 3)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from asyncsync import AsyncSyncError, IncompatibleVersion, Publisher
from asyncsync.codec import raw_clone
from asyncsync.format.acks import read_acks
from asyncsync.format.checksum import checksum_bytes
from asyncsync.format.manifest import Manifest, Totals, fingerprint
from asyncsync.format.store import read_manifest
from asyncsync.fsio import atomic_write, make_dir
from receiver import ReceiverAgent
from receiver.engines.base import TensorUpdate
from receiver.engines.checkpoint import LocalCheckpoint, verify_checkpoint
from receiver.engines.torch_module import TorchModule
from receiver.rules import bumped
from receiver.state import PersistedState
from tests.conftest import Holder, assert_holds, mixed_state, mutate


def forge_zero_diff(
    root: Path, base: int, *, drop: str | None = None, reshape: bool = False
) -> int:
    """Commit v{base+1}: a zero diff of v{base} with one tensor dropped or reshaped, its totals
    and fingerprint consistent (it passes validation)."""
    m = read_manifest(root, base)
    tensors = [
        dataclasses.replace(e, changed=0, delta=None, full=None)
        for e in m.tensors
        if e.name != drop
    ]
    if reshape:
        e = next(t for t in tensors if t.name == "model.layers.2.weight")
        tensors[tensors.index(e)] = dataclasses.replace(e, shape=(e.shape[1], e.shape[0]))
    v = base + 1
    forged = dataclasses.replace(
        m,
        version=v,
        base_version=base,
        kind="delta",
        shards=(),
        tensors=tuple(tensors),
        totals=Totals.of(tensors, (), 0),
        fingerprint=fingerprint(tensors, m.checksum_algorithm),
    )
    Manifest.from_json(forged.to_json())  # valid
    vdir = make_dir(root / f"v{v:012d}")
    atomic_write(vdir / "manifest.json", forged.to_json().encode())
    return v


async def _publish(root: Path, n: int) -> list[dict[str, torch.Tensor]]:
    states = [mixed_state(0)]
    async with Publisher(root, bucket_bytes=8192, keyframe_interval=0) as pub:
        await pub.seed(states[0])
        for i in range(1, n + 1):
            states.append(mutate(states[-1], 0.03, seed=i))
            await pub.publish(states[-1])
    return states


@pytest.mark.parametrize("how", ["drop", "reshape"])
async def test_zero_diff_with_another_tensor_set_is_refused_and_the_checkpoint_reopens(
    tmp_path: Path, how: str
) -> None:
    root = tmp_path / "root"
    states = await _publish(root, 1)
    async with ReceiverAgent(root, LocalCheckpoint(tmp_path / "ck"), "e1", use_inotify=False) as a:
        assert await a.sync_once() == 1
        forge_zero_diff(root, 1, drop="model.scalar" if how == "drop" else None,
                        reshape=how == "reshape")  # fmt: skip
        with pytest.raises(IncompatibleVersion):
            await a.sync_once()
        assert a.version == 1 and a.status().bad_versions == (2,)
        assert read_acks(root)["e1"].version == 1  # nothing acked
    # the engine always reopens, holding v1 bit for bit
    ck = LocalCheckpoint(tmp_path / "ck")
    assert (await ck.open()).version == 1
    assert_holds(ck.load_state_dict(), states[1])
    await ck.close()


async def test_delta_with_a_dropped_tensor_is_refused_by_torch_module(tmp_path: Path) -> None:
    root = tmp_path / "root"
    states = await _publish(root, 1)
    mod = Holder(states[0])
    async with ReceiverAgent(root, TorchModule(mod), "m1", use_inotify=False) as a:
        assert await a.sync_once() == 1
        forge_zero_diff(root, 1, drop="model.layers.0.weight")
        with pytest.raises(IncompatibleVersion):
            await a.sync_once()
        assert a.version == 1
    assert_holds(mod.state_dict(), states[1])


async def test_delta_naming_fewer_tensors_is_refused_before_anything_changes(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    await _publish(root, 2)
    ck = LocalCheckpoint(tmp_path / "ck")
    async with ReceiverAgent(root / "none", ck, "x", use_inotify=False):
        pass
    async with ReceiverAgent(root, LocalCheckpoint(tmp_path / "ck"), "e", use_inotify=False) as a:
        m2 = read_manifest(root, 2)
        # hold v1 first
        import shutil

        shutil.move(root / "v000000000002", tmp_path / "v2")
        assert await a.sync_once() == 1
        shutil.move(tmp_path / "v2", root / "v000000000002")
        fewer = dataclasses.replace(m2, tensors=m2.tensors[1:])
        with pytest.raises(IncompatibleVersion, match="lacks 1"):
            await a.engine.begin(fewer, "delta")
        assert a.engine.state.version == 1


def test_bumped_refuses_other_names_and_other_checksums(tmp_path: Path) -> None:
    """Kills the mutation of ``bumped`` that takes a zero diff whose checksums differ."""
    ps = PersistedState(version=1, run_id="r", fingerprint="f", checksum_algorithm="xxh3-128",
                        checksums={"a": "11" * 16, "b": "22" * 16})  # fmt: skip
    root = tmp_path / "root"
    import asyncio

    asyncio.run(_publish(root, 1))
    m = read_manifest(root, 1)
    names = [e.name for e in m.tensors]
    held = {e.name: e.checksum for e in m.tensors}
    ps = dataclasses.replace(ps, checksums=held, checksum_algorithm=m.checksum_algorithm)
    zero = dataclasses.replace(m, version=2, base_version=1, kind="delta")
    assert bumped(ps, zero).version == 2
    other = dict(held)
    other[names[0]] = "00" * 16
    with pytest.raises(Exception, match="zero-diff v2 says tensor"):
        bumped(dataclasses.replace(ps, checksums=other), zero)
    with pytest.raises(IncompatibleVersion):
        bumped(ps, dataclasses.replace(zero, tensors=m.tensors[1:]))


# --------------------------------------------------------------------------- issue 22, finding 6
# A tensor named ``__metadata__`` (the key safetensors reserves for its header metadata): main
# published it; a receiver then swapped the keyframe's files in, removed the good version's,
# failed reading the layout back, never marked the version bad, and did it again at every
# sync: the checkpoint was wiped.

RESERVED = "__metadata__"
STAND_IN = "__metadatx__"  # same length: the bytes can be swapped in place


def forge_reserved_name_keyframe(root: Path, version: int) -> None:
    """Rewrite v{version} (a keyframe holding STAND_IN) as one naming RESERVED: the manifest
    and the full shard's header, with shard checksums, sizes and fingerprint made consistent
    again, as a writer that does not refuse the name would have written it."""
    vdir = root / f"v{version:012d}"
    m = read_manifest(root, version)
    shards = []
    for s in m.shards:
        p = vdir / s.file
        data = p.read_bytes().replace(STAND_IN.encode(), RESERVED.encode())
        p.write_bytes(data)
        shards.append(dataclasses.replace(s, checksum=checksum_bytes(data, m.checksum_algorithm)))
    tensors = [
        dataclasses.replace(
            e,
            name=RESERVED if e.name == STAND_IN else e.name,
            full=None if e.full is None else dataclasses.replace(e.full, key=RESERVED)
            if e.full.key == STAND_IN else e.full,
        )
        for e in m.tensors
    ]  # fmt: skip
    forged = dataclasses.replace(
        m,
        shards=tuple(shards),
        tensors=tuple(tensors),
        fingerprint=fingerprint(tensors, m.checksum_algorithm),
    )
    (vdir / "manifest.json").write_text(forged.to_json())


async def test_a_tensor_named_like_the_safetensors_header_never_wipes_a_checkpoint(
    tmp_path: Path,
) -> None:
    """The version is refused (its manifest names a reserved tensor name), marked bad, and the
    checkpoint keeps v0, sync after sync."""
    root, ckpt = tmp_path / "root", tmp_path / "ckpt"
    s0 = mixed_state(0)
    agent = ReceiverAgent(
        root, LocalCheckpoint(ckpt), "e1", use_inotify=False, prefetch=False, verify_deadline=0
    )
    async with Publisher(root, bucket_bytes=8192, keyframe_interval=0) as pub:
        await pub.seed(s0)
        async with agent:
            assert await agent.sync_once() == 0
            await pub.seed({**mutate(s0, 0.5, seed=1), STAND_IN: torch.arange(6.0)})
            forge_reserved_name_keyframe(root, 1)
            for _ in range(2):
                with pytest.raises(AsyncSyncError):
                    await agent.sync_once()
                assert agent.version == 0 and agent.status().bad_versions == (1,)
                assert verify_checkpoint(ckpt, read_manifest(root, 0)) == []
                assert_holds(agent.engine.load_state_dict(), s0)  # type: ignore[attr-defined]


async def test_a_full_version_the_files_cannot_hold_is_refused_before_the_swap(
    tmp_path: Path,
) -> None:
    """Below the manifest check: LocalCheckpoint reads the layout of the staged files back
    before it replaces a file, and refuses what does not read back (IncompatibleVersion: the
    agent marks the version bad) with the held version's files untouched."""
    root, ckpt = tmp_path / "root", tmp_path / "ckpt"
    s0 = mixed_state(0)
    async with Publisher(root, bucket_bytes=1 << 20, keyframe_interval=0) as pub:
        await pub.seed(s0)
        await pub.seed({**mutate(s0, 0.5, seed=1), STAND_IN: torch.arange(6.0)})
    m0, m1 = read_manifest(root, 0), read_manifest(root, 1)
    engine = LocalCheckpoint(ckpt)
    await engine.open()
    try:
        await engine.begin(m0, "full")
        await engine.apply([TensorUpdate(e, full=raw_clone(s0[e.name])) for e in m0.tensors])
        await engine.commit()
        # v1 as a writer that does not refuse the name made it (validation skipped: the
        # engine's own check is under test)
        tensors = tuple(
            dataclasses.replace(e, name=RESERVED) if e.name == STAND_IN else e for e in m1.tensors
        )
        forged = dataclasses.replace(m1, tensors=tensors)
        s1 = {**mutate(s0, 0.5, seed=1), RESERVED: torch.arange(6.0)}
        await engine.begin(forged, "full")
        await engine.apply([TensorUpdate(e, full=raw_clone(s1[e.name])) for e in tensors])
        with pytest.raises(IncompatibleVersion, match="does not read back"):
            await engine.commit()
        assert engine.state.version == 0
        assert verify_checkpoint(ckpt, m0) == []
    finally:
        await engine.close()
