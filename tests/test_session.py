"""SyncSession: blocking publishes on a private loop, versions on a reused root, interruption."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
import torch

from asyncsync import ConfigError, LockHeld, PublishError
from asyncsync.format.store import list_versions
from asyncsync.training.config import SyncConfig
from asyncsync.training.session import SyncSession, collect_state_dict
from tests.conftest import mixed_state, mutate


def test_seed_then_publish_and_weight_versions(tmp_path: Path) -> None:
    cfg = SyncConfig(root=tmp_path, start_version=100, keyframe_interval=0)
    sd = mixed_state(0)
    with SyncSession(cfg) as sync:
        first = sync.publish(sd)
        assert first.seeded and first.result.kind == "full" and first.weight_version == 100
        second = sync.publish(iter(mutate(sd, 0.02, seed=1).items()))  # (name, tensor) pairs
        assert not second.seeded and second.result.kind == "delta"
        assert (second.result.version, second.weight_version) == (1, 101)
        assert second.ack.target is None  # the policy waits for nobody
        assert sync.wait_acked().target is None
        assert "open" in repr(sync) and sync.last_step is second
        with pytest.raises(LockHeld):
            SyncSession(cfg).open()  # one publisher per root
    assert "closed" in repr(sync)
    with pytest.raises(PublishError, match="closed"):
        sync.publish(sd)
    with pytest.raises(PublishError, match="closed"):
        sync.open()
    # a restarted trainer on the same root: root versions continue, weight versions restart
    with SyncSession(cfg.replace(start_version=200)) as sync:
        step = sync.publish(sd)
        assert (step.result.version, step.weight_version, sync.seed_version) == (2, 200, 2)
        assert sync.publish(sd).weight_version == 201
    assert list_versions(tmp_path) == [0, 1, 2, 3]


def test_not_open_and_bad_weights(tmp_path: Path) -> None:
    sync = SyncSession(SyncConfig(root=tmp_path))
    with pytest.raises(PublishError, match="not open"):
        sync.publish({"a": torch.zeros(2)})
    with pytest.raises(ConfigError, match="twice"):
        collect_state_dict([("a", torch.zeros(1)), ("a", torch.zeros(1))])
    sync.close()
    sync.close()  # idempotent


def test_interrupt_cancels_the_publish_and_cleans_up(tmp_path: Path) -> None:
    """Ctrl-C while a version is being written: nothing is committed, the session still works."""
    entered, release = threading.Event(), threading.Event()

    def slow_hook(version_dir: Path) -> None:  # a cancelled publish waits for it to return
        entered.set()
        release.wait(2)

    sd = mixed_state(0)
    cfg = SyncConfig(root=tmp_path, pre_commit_hook=slow_hook)
    with SyncSession(cfg, cancel_grace=10) as sync:

        def interrupt() -> None:
            if entered.wait(30):
                os.kill(os.getpid(), signal.SIGINT)

        killer = threading.Thread(target=interrupt)
        killer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                sync.publish(sd)
        finally:
            release.set()
            killer.join()
        assert sync.version is None and list_versions(tmp_path) == []
        assert not (tmp_path / "v000000000000").exists()
        release.set()
        assert sync.publish(sd).result.version == 0


def test_hostile_wait_acked_policy_and_weights_are_config_errors(tmp_path: Path) -> None:
    """A version that is not an int (a TypeError, or True waited for as 1), one not published
    yet (waited for until the timeout, for ever without one), a policy that is not an AckPolicy
    (taken, then the next publish failed after its commit) and weights that are no state dict
    (a TypeError) are ConfigErrors at the call, the session still working."""
    from asyncsync.training.staleness import AckPolicy

    with SyncSession(SyncConfig(root=tmp_path, ack_timeout="none")) as sync:
        sync.publish({"w": torch.ones(4)})
        sync.ack_policy = AckPolicy(engines=("e0",), timeout=None)
        for bad in ("x", 2.5, True):
            with pytest.raises(ConfigError, match="version must be an int"):
                sync.wait_acked(bad)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="version 5 is not published yet"):
            sync.wait_acked(5)
        with pytest.raises(ConfigError, match="must be an AckPolicy"):
            sync.ack_policy = "quorum=2"  # type: ignore[assignment]
        with pytest.raises(ConfigError, match="got int"):
            sync.publish(5)  # type: ignore[arg-type]
        sync.ack_policy = AckPolicy()
        assert sync.publish({"w": torch.ones(4) * 2}).result.version == 1
    assert list_versions(tmp_path) == [0, 1]
    # a mapping of the fields, as create_publisher takes (an AttributeError on 'ack_policy')
    with SyncSession({"root": str(tmp_path), "max_staleness": "1"}) as sync:
        assert sync.config.max_staleness == 1 and sync.publish({"w": torch.ones(4)}).seeded
    with pytest.raises(ConfigError, match="got str"):
        SyncSession(str(tmp_path))  # type: ignore[arg-type]
