"""A delta or zero diff whose tensor set differs from the engine's is refused before the engine
is touched, nothing is acked, and the engine always reopens (issue 13, failure 3)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from asyncsync import IncompatibleVersion, Publisher
from asyncsync.format.acks import read_acks
from asyncsync.format.manifest import Manifest, Totals, fingerprint
from asyncsync.format.store import read_manifest
from asyncsync.fsio import atomic_write, make_dir
from receiver import ReceiverAgent
from receiver.engines.checkpoint import LocalCheckpoint
from receiver.engines.torch_module import TorchModule
from receiver.state import PersistedState, bumped
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
