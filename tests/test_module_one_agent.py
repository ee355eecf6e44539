"""One receiver agent per live module, as per checkpoint (its lock): a second ``TorchModule``
over a module another open one applies versions to is refused (attack-89). Before, two agents
(two engine ids) over one module applied every version twice, each XOR delta undoing the
other's, re-seeding from the keyframe every other version while the module served a mix."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from asyncsync import LockHeld, Publisher
from receiver import ReceiverAgent
from receiver.engines.torch_module import TorchModule
from receiver.state import StateStore
from tests.conftest import Holder, assert_holds, mixed_state, mutate


async def test_a_second_agent_over_the_same_module_is_refused(tmp_path: Path) -> None:
    v0 = mixed_state(0)
    mod = Holder(v0)
    async with Publisher(tmp_path, keyframe_interval=0) as pub:
        await pub.seed(v0)
        async with ReceiverAgent(tmp_path, TorchModule(mod), "m1", use_inotify=False) as a:
            with pytest.raises(LockHeld, match="one agent per engine"):
                async with ReceiverAgent(tmp_path, TorchModule(mod), "m2", use_inotify=False):
                    pass
            assert await a.sync_once() == 0
            other = Holder(v0)  # another module: its own agent
            async with ReceiverAgent(tmp_path, TorchModule(other), "m3", use_inotify=False) as b:
                assert await b.sync_once() == 0
            v1 = mutate(v0, 0.05, seed=1)
            await pub.publish(v1)
            assert await a.sync_once() == 1
            assert a.status().applied == 2  # v0, v1: never undone by another agent
        assert_holds(mod.state_dict(), v1)
        # once the first agent closed, the module may be driven by another
        async with ReceiverAgent(tmp_path, TorchModule(mod), "m2", use_inotify=False) as c:
            assert await c.sync_once() == 1
    assert_holds(mod.state_dict(), v1)


async def test_an_engine_dropped_unclosed_holds_the_module_until_it_is_collected() -> None:
    mod = Holder(mixed_state(0))
    first = TorchModule(mod)
    await first.open()
    with pytest.raises(LockHeld):
        await TorchModule(mod).open()
    del first
    gc.collect()
    second = TorchModule(mod)
    await second.open()
    await second.close()


async def test_an_engine_whose_open_failed_does_not_hold_the_module(tmp_path: Path) -> None:
    """An open refused by the state directory's lock (another receiver holds it) leaves the
    module free: a new engine over it opens while the failed one is still referenced (here by
    the error's traceback, as a retry inside ``except`` has it). Before, the failed one kept
    the module, and the new one was refused as if another agent applied to it."""
    mod = Holder(mixed_state(0))
    held = StateStore(tmp_path / "state")
    held.open()
    first = TorchModule(mod, state_dir=tmp_path / "state")
    try:
        with pytest.raises(LockHeld) as refused:
            await first.open()
        assert "one agent per engine" not in str(refused.value)  # the directory's lock
    finally:
        held.close()
    second = TorchModule(mod, state_dir=tmp_path / "other")
    await second.open()
    await second.close()
    assert refused.value.__traceback__ is not None  # the failed engine was alive throughout
