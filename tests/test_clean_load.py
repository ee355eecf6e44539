"""receiver.plugins.clean_load: an engine's start-up load reads only whole versions of a real
checkpoint kept by a real receiver (the servers themselves: tests/test_real_midapply.py)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from receiver.plugins.clean_load import WAIT_LINE, load_whole_version
from tests.sglang_toy import Rig, hf_state

log = logging.getLogger("test.clean_load")


def state_path(ckpt: Path) -> Path:
    return ckpt / ".asyncsync" / "state.json"


def rewrite_state(ckpt: Path, **changes: object) -> None:
    """``state.json`` replaced by a rename, as the receiver writes it."""
    state = json.loads(state_path(ckpt).read_text())
    state.update(changes)
    tmp = state_path(ckpt).with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, state_path(ckpt))


async def test_a_plain_directory_is_loaded_as_it_is(tmp_path: Path) -> None:
    calls: list[int] = []
    assert load_whole_version(tmp_path, lambda: calls.append(1) or "ok", log, wait=0) == "ok"
    assert calls == [1]


async def test_a_checkpoint_mid_apply_is_never_loaded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with Rig(tmp_path, tp=1) as rig:
        await rig.publish(hf_state(3))
    rewrite_state(rig.ckpt, status="applying", target_version=1, mode="delta")
    calls: list[int] = []
    with pytest.raises(RuntimeError, match="still being patched"):
        load_whole_version(rig.ckpt, lambda: calls.append(1), log, wait=0)
    assert calls == [] and WAIT_LINE in caplog.text


async def test_a_checkpoint_that_changes_while_it_is_read_is_read_again(tmp_path: Path) -> None:
    """The receiver began the next version while the engine read the files (and may have
    finished or undone it since: same content, but ``state.json`` was replaced)."""
    async with Rig(tmp_path, tp=1) as rig:
        await rig.publish(hf_state(3))
    calls: list[int] = []

    def load() -> int:
        calls.append(1)
        if len(calls) == 1:
            rewrite_state(rig.ckpt)
        return len(calls)

    assert load_whole_version(rig.ckpt, load, log, wait=0) == 2
