"""The stage read and verified ahead of its apply (receiver.plugins.prefetch): used only while
its record on disk is the one it was read from; anything else is read again in the call.

The toy model with SGLang's loader conventions at TP=2 (tests/sglang_toy.py), versions from a
real Publisher and ReceiverAgent; each rank's loader gets a StagePrefetch, polled by the test
(deterministic) or left to its own thread.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from asyncsync.errors import ConfigError, shown
from receiver.plugins.audit import Auditor
from receiver.plugins.prefetch import ENV_PREFETCH, StagePrefetch, start_prefetch
from receiver.plugins.stage import DATA_NAME, STAGE_NAME
from tests.sglang_toy import Rig, hf_state, step

AHEAD = "stage read and verified before the pause"


def _damage(data: Path) -> None:
    """Flip one byte in the middle of a stage's data file."""
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))


def _names(rig: Rig) -> list[str]:
    return [n for n in rig.sd if n != "lm_head.weight"]


async def test_a_stage_read_ahead_is_applied_without_reading_it_again(tmp_path: Path) -> None:
    async with Rig(tmp_path, tp=2) as rig:
        await rig.publish(hf_state(0))
        rig.load_all()
        ahead = [StagePrefetch(loader) for loader in rig.loaders]
        for seed in (1, 2):
            v = await rig.publish(step(rig.sd, _names(rig), seed))
            assert all(p.poll() for p in ahead)
            assert not any(p.poll() for p in ahead)  # read once
            for msg in rig.apply_all(v):
                assert f"-> v{v}:" in msg and AHEAD in msg, msg
            rig.check()
        assert [p.prefetched for p in ahead] == [2, 2]
        assert rig.full_reloads == 2


async def test_a_record_changed_after_the_read_ahead_is_read_again(tmp_path: Path) -> None:
    """The receiver re-staged the version (another record): the copy is not used."""
    async with Rig(tmp_path, tp=1) as rig:
        await rig.publish(hf_state(1))
        rig.load_all()
        ahead = StagePrefetch(rig.loaders[0])
        v = await rig.publish(step(rig.sd, _names(rig), 3))
        assert ahead.poll()
        record = rig.engine.stages[v] / STAGE_NAME
        doc = json.loads(record.read_text())
        doc["created_at"] += 1
        record.write_text(json.dumps(doc))
        msg = rig.apply_all(v)[0]
        assert "XORed in place" in msg and AHEAD not in msg and "verified in" in msg, msg
        rig.check()


async def test_data_damaged_after_the_read_ahead_is_never_applied(tmp_path: Path) -> None:
    """The copy verified ahead is what is applied (the damaged file is not read again); with
    no copy, the damaged data fails its checksum and the checkpoint path is taken."""
    async with Rig(tmp_path, tp=1) as rig:
        await rig.publish(hf_state(2))
        rig.load_all()
        ahead = StagePrefetch(rig.loaders[0])
        v = await rig.publish(step(rig.sd, _names(rig), 4))
        assert ahead.poll()
        _damage(rig.engine.stages[v] / DATA_NAME)
        assert AHEAD in rig.apply_all(v)[0]
        rig.check()
        v = await rig.publish(step(rig.sd, _names(rig), 5))  # not read ahead, then damaged
        _damage(rig.engine.stages[v] / DATA_NAME)
        msg = rig.apply_all(v)[0]
        assert "the stage does not verify" in msg and "partial reload" in msg, msg
        rig.check()


async def test_a_stage_that_does_not_verify_ahead_is_left_to_the_apply(tmp_path: Path) -> None:
    async with Rig(tmp_path, tp=1) as rig:
        await rig.publish(hf_state(3))
        rig.load_all()
        ahead = StagePrefetch(rig.loaders[0])
        assert not ahead.poll()  # no stage yet
        v = await rig.publish(step(rig.sd, _names(rig), 6))
        data = rig.engine.stages[v] / DATA_NAME
        data.write_bytes(data.read_bytes()[:-1])
        assert not ahead.poll() and ahead.failed == 1
        assert "the stage does not verify" in rig.apply_all(v)[0]
        rig.check()


async def test_the_thread_reads_each_new_stage_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_PREFETCH, "0")
    async with Rig(tmp_path, tp=1) as rig:
        assert start_prefetch(rig.loaders[0]) is None  # turned off
        monkeypatch.delenv(ENV_PREFETCH)
        ahead = start_prefetch(rig.loaders[0])
        assert ahead is not None
        try:
            await rig.publish(hf_state(4))
            rig.load_all()
            v = await rig.publish(step(rig.sd, _names(rig), 7))
            deadline = time.monotonic() + 30
            while ahead.prefetched < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert AHEAD in rig.apply_all(v)[0]
            rig.check()
        finally:
            ahead.stop()


async def test_an_apply_waits_for_the_read_ahead_in_progress(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The apply comes while the stage is being read ahead: it waits for that read and takes
    its copy (one read per stage); a stage its apply already read is not read ahead after."""
    from receiver.plugins import prefetch

    async with Rig(tmp_path, tp=1) as rig:
        await rig.publish(hf_state(5))
        rig.load_all()
        ahead = StagePrefetch(rig.loaders[0])
        v = await rig.publish(step(rig.sd, _names(rig), 8))
        started, go = threading.Event(), threading.Event()
        real = prefetch.read_stage

        def slow(path: Path) -> Any:
            started.set()
            assert go.wait(30)
            return real(path)

        monkeypatch.setattr(prefetch, "read_stage", slow)
        t = threading.Thread(target=ahead.poll)
        t.start()
        assert started.wait(30)
        threading.Timer(0.3, go.set).start()
        msg = rig.apply_all(v)[0]
        t.join(30)
        assert AHEAD in msg, msg
        rig.check()
        monkeypatch.setattr(prefetch, "read_stage", real)
        v = await rig.publish(step(rig.sd, _names(rig), 9))
        assert "verified in" in rig.apply_all(v)[0]  # no read ahead: read by the apply
        assert not ahead.poll() and ahead.prefetched == 1  # and not read again after
        rig.check()


@pytest.mark.parametrize("value", [float("nan"), -1, True, 10**400, 1e300, "5"], ids=shown)
def test_the_plugins_durations_are_checked_at_the_call(value: Any) -> None:
    """``stop(timeout)`` of the plugins' threads (StagePrefetch, the in-engine Auditor) went
    to ``Thread.join`` unchecked (10**400, 1e300 and inf raised OverflowError there, nan
    waited for ever, True a second), and so did StagePrefetch's ``interval`` to
    ``Event.wait``. inf stops without a limit; the interval must be > 0 and finite."""
    loader = SimpleNamespace(on_change=None)  # the checks come before any use of it
    ahead, auditor = StagePrefetch(loader), Auditor(loader, enabled=False)  # type: ignore[arg-type]
    calls = {
        "StagePrefetch: interval": lambda v: StagePrefetch(loader, interval=v),  # type: ignore[arg-type]
        "StagePrefetch.stop: timeout": lambda v: ahead.stop(v),
        "Auditor.stop: timeout": lambda v: auditor.stop(v),
    }
    for what, call in calls.items():
        with pytest.raises(ConfigError, match=what):
            call(value)
    with pytest.raises(ConfigError, match="StagePrefetch: interval"):
        StagePrefetch(loader, interval=float("inf"))  # type: ignore[arg-type]
    ahead.stop(float("inf"))  # no thread started: returns at once
    auditor.stop(float("inf"))
