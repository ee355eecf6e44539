"""A live module's tensor replaced or resized behind the receiver (a loader that rebinds a
parameter, ``module.weight = ...``, ``resize_``) between two versions: the next version is never
acknowledged over bytes that are not the held version's (attack-89)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from asyncsync import ApplyFailed, Publisher
from asyncsync.format.acks import read_acks
from receiver import ReceiverAgent
from receiver.engines.torch_module import TorchModule
from tests.conftest import Holder, assert_holds, mixed_state, mutate

CHANGED = "model.layers.0.weight"  # the one tensor the deltas change
REBOUND = "model.layers.1.weight"  # in no delta: its bytes are taken as the held version's
V0 = mixed_state(0)
BUFFER = f"b{list(V0).index(REBOUND)}"  # its name in the Holder


@contextlib.asynccontextmanager
async def _at_v0(root: Path) -> AsyncIterator[tuple[Publisher, ReceiverAgent, Holder]]:
    mod = Holder(V0)
    async with Publisher(root, keyframe_interval=0) as pub:
        await pub.seed(V0)
        async with ReceiverAgent(root, TorchModule(mod), "m1", use_inotify=False) as a:
            assert await a.sync_once() == 0
            yield pub, a, mod


@pytest.mark.parametrize("zero_diff", [False, True])
async def test_a_tensor_replaced_in_the_module_is_checked_before_the_next_delta(
    tmp_path: Path, zero_diff: bool
) -> None:
    """Before: v1 (which does not touch ``REBOUND``; with ``zero_diff`` no tensor) was
    committed and acked over the new tensor's bytes, the module serving what no version ever
    was."""
    async with _at_v0(tmp_path) as (pub, a, mod):
        setattr(mod, BUFFER, torch.ones_like(getattr(mod, BUFFER)))  # a new tensor, other bytes
        v1 = V0 if zero_diff else mutate(V0, 0.05, seed=1, names=[CHANGED])
        await pub.publish(v1)
        assert await a.sync_once() == 1  # from the keyframe again, then v1
        assert_holds(mod.state_dict(), v1)
        assert read_acks(tmp_path)["m1"].version == 1
        assert a.status().applied == 3  # v0, v0 again, v1
        # a copy of the same bytes (``module.to()``-like) is taken: v2 as a plain delta
        setattr(mod, BUFFER, getattr(mod, BUFFER).clone())
        v2 = mutate(v1, 0.05, seed=2, names=[CHANGED])
        await pub.publish(v2)
        assert await a.sync_once() == 2
        assert_holds(mod.state_dict(), v2)
        assert a.status().applied == 4  # v2 alone: no keyframe again


@pytest.mark.parametrize(
    ("name", "shape"), [(REBOUND, (7,)), ("model.empty", (0, 7))], ids=["elements", "empty"]
)
async def test_a_tensor_resized_in_place_leaves_no_ack_of_a_version_it_lost(
    tmp_path: Path, name: str, shape: tuple[int, ...]
) -> None:
    """Before: v1 was refused as a bad version ("the engine holds float16[7]") while the ack
    still named v0, which the module no longer held; an empty tensor (no bytes to compare, but
    a shape: [0, 5] -> [0, 7]) so until attack-90."""
    async with _at_v0(tmp_path) as (pub, a, mod):
        getattr(mod, f"b{list(V0).index(name)}").resize_(*shape)
        await pub.publish(mutate(V0, 0.05, seed=1, names=[CHANGED]))
        with pytest.raises(ApplyFailed, match=name.replace(".", r"\.")):
            await a.sync_once()  # the keyframe cannot go in either: the module's shape is named
        assert a.version is None and a.status().bad_versions == ()
        ack = read_acks(tmp_path).get("m1")
        assert ack is None or ack.version is None
