"""A reloading engine (SGLang against a fake server on 127.0.0.1 that verifies the checkpoint's
files at each load: ``VerifyingSGLang``) and its host-local checkpoint: the server must never
be told to load files that do not hold the version it labels them.

A redo log under it is refused by the engine itself. The server reloads from the checkpoint's
files, which must hold every version acknowledged; a redo log keeps the deltas beside them
(receiver/engines/checkpoint/redolog.py), so the server was told to load files one or more
versions older than the label it was given, and the receiver acknowledged them. Only
``asyncsync-receiver`` refused the combination (``--checkpoint-redo-log`` with
``--sglang-url``); a library user got the wrong weights."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from asyncsync import ConfigError
from asyncsync.format.acks import read_acks
from receiver.engines import SGLang
from receiver.engines.checkpoint import LocalCheckpoint
from tests.fake_engines import Chain, VerifyingSGLang
from tests.test_sglang import agent_for, make_engine


@pytest.fixture
async def chain(tmp_path: Path) -> AsyncIterator[Chain]:
    c = Chain(tmp_path / "root")
    async with c.pub:
        for _ in range(3):  # v0 (the only keyframe), v1, v2
            await c.next()
        yield c


# --------------------------------------------------------------------------- a redo log


def _set_redo_attribute(engine: SGLang, ckpt: Path) -> None:
    engine.checkpoint.redo_log = 2  # as the CLI sets sync_before_ack on it


def _replace_checkpoint(engine: SGLang, ckpt: Path) -> None:
    engine.checkpoint = LocalCheckpoint(ckpt, redo_log=2)


@pytest.mark.parametrize("how", [_set_redo_attribute, _replace_checkpoint])
async def test_a_redo_log_under_a_reloading_engine_is_a_config_error(
    chain: Chain, tmp_path: Path, how: object
) -> None:
    ckpt = tmp_path / "ckpt"
    async with VerifyingSGLang(chain.root) as srv:
        engine = make_engine(srv, ckpt)
        how(engine, ckpt)  # type: ignore[operator]
        with pytest.raises(ConfigError, match="redo_log=2") as info:
            async with agent_for(chain, engine) as agent:
                await agent.sync_once()
    assert "reloads from the checkpoint's files" in str(info.value)
    assert not srv.loads_checked  # refused before anything was loaded
    assert "e1" not in read_acks(chain.root)


async def test_a_redo_log_set_after_open_is_refused_at_the_next_version(
    chain: Chain, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    async with VerifyingSGLang(chain.root) as srv:
        engine = make_engine(srv, ckpt)
        async with agent_for(chain, engine) as agent:
            assert await agent.sync_once() == 2
            engine.checkpoint.redo_log = 2
            await chain.next()  # v3
            with pytest.raises(ConfigError, match="redo_log=2"):
                await agent.sync_once()
            assert engine.state.version == 2 and engine.checkpoint.state.version == 2
    assert not srv.served_wrong(), srv.loads_checked
    assert read_acks(chain.root)["e1"].version == 2
