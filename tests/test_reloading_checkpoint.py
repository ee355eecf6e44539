"""A reloading engine (SGLang against a fake server on 127.0.0.1 that verifies the checkpoint's
files at each load: ``VerifyingSGLang``) and its host-local checkpoint: the server must never
be told to load files that do not hold the version it labels them.

A redo log under it is refused by the engine itself. The server reloads from the checkpoint's
files, which must hold every version acknowledged; a redo log keeps the deltas beside them
(receiver/engines/checkpoint/redolog.py), so the server was told to load files one or more
versions older than the label it was given, and the receiver acknowledged them. Only
``asyncsync-receiver`` refused the combination (``--checkpoint-redo-log`` with
``--sglang-url``); a library user got the wrong weights.

Data files changed behind the receiver's back: the checkpoint's stamps
(receiver/engines/checkpoint/stamps.py) see the edit at open, before a delta and at each sync
with nothing newer, and wipe the files (the receiver re-initialises them from a keyframe). The
engine reloaded the server from them on paths that did not ask the checkpoint first: a server
found restarted (``reconcile``), a version the checkpoint already held (the server alone
behind), an audit's repair. Between two runs the open already caught it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from asyncsync import ApplyFailed, ConfigError
from asyncsync.format.acks import read_acks
from asyncsync.format.store import read_manifest
from receiver import ReceiverAgent
from receiver.engines import EngineHTTPError, SGLang, verify_checkpoint
from receiver.engines.checkpoint import LocalCheckpoint
from tests.conftest import flip_tensor_byte
from tests.fake_engines import Chain, VerifyingSGLang
from tests.test_sglang import agent_for, make_engine


@pytest.fixture
async def chain(tmp_path: Path) -> AsyncIterator[Chain]:
    c = Chain(tmp_path / "root")
    async with c.pub:
        for _ in range(3):  # v0 (the only keyframe), v1, v2
            await c.next()
        yield c


@contextlib.asynccontextmanager
async def _synced_to_v2(
    chain: Chain, ckpt: Path
) -> AsyncIterator[tuple[VerifyingSGLang, SGLang, ReceiverAgent]]:
    """A verifying server, an engine on the checkpoint ``ckpt`` and its agent, at v2."""
    async with VerifyingSGLang(chain.root) as srv:
        engine = make_engine(srv, ckpt)
        async with agent_for(chain, engine) as agent:
            assert await agent.sync_once() == 2
            yield srv, engine, agent


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
    async with _synced_to_v2(chain, ckpt) as (srv, engine, agent):
        engine.checkpoint.redo_log = 2
        await chain.next()  # v3
        with pytest.raises(ConfigError, match="redo_log=2"):
            await agent.sync_once()
        assert engine.state.version == 2 and engine.checkpoint.state.version == 2
    assert not srv.served_wrong(), srv.loads_checked
    assert read_acks(chain.root)["e1"].version == 2


# --------------------------------------------------------------------------- files edited

EDITED = "model.layers.2.weight"


async def test_an_edit_between_two_runs_is_wiped_and_reseeded_never_loaded(
    chain: Chain, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    async with VerifyingSGLang(chain.root) as srv:
        async with agent_for(chain, make_engine(srv, ckpt)) as agent:
            assert await agent.sync_once() == 2
        flip_tensor_byte(ckpt, EDITED)
        await srv.restart()  # a restarted server too: it reports its launch label
        engine = make_engine(srv, ckpt)
        async with agent_for(chain, engine) as agent:
            assert engine.state.version is None  # the checkpoint wiped at open
            assert await agent.sync_once() == 2  # re-initialised from the keyframe
    assert srv.loads_checked and not srv.served_wrong(), srv.loads_checked
    assert verify_checkpoint(ckpt, read_manifest(chain.root, 2)) == []


async def test_a_server_restarted_after_an_edit_is_not_reloaded_from_the_edited_files(
    chain: Chain, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    async with _synced_to_v2(chain, ckpt) as (srv, engine, agent):
        flip_tensor_byte(ckpt, EDITED)
        await srv.restart()
        assert await engine.serving_version() is None  # /readyz finds it lost
        assert await agent.sync_once() == 2  # reconciled: re-initialised, then reloaded
        assert await engine.serving_version() == 2
    assert not srv.served_wrong(), srv.loads_checked
    assert srv.loads_checked[-1] == ("2", [])


async def test_a_version_the_checkpoint_holds_is_not_reloaded_from_edited_files(
    chain: Chain, tmp_path: Path
) -> None:
    """The server failed after the checkpoint committed v2: the next try only reloads the
    server, from files edited meanwhile."""
    ckpt = tmp_path / "ckpt"
    async with _synced_to_v2(chain, ckpt) as (srv, engine, agent):
        await chain.next()  # v3
        srv.inject("/update_weights_from_disk", status=400, message="injected")
        with pytest.raises(EngineHTTPError, match="injected"):
            await agent.sync_once()
        assert engine.checkpoint.state.version == 3 and engine.state.version == 2
        flip_tensor_byte(ckpt, EDITED)
        assert await agent.sync_once() == 3
    assert not srv.served_wrong(), srv.loads_checked
    assert srv.loads_checked[-1] == ("3", [])


async def test_a_repair_does_not_reload_edited_files(chain: Chain, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    async with _synced_to_v2(chain, ckpt) as (srv, engine, agent):
        flip_tensor_byte(ckpt, EDITED)
        with pytest.raises(ApplyFailed, match="cannot repair v2: the checkpoint's files were"):
            await engine.repair()
        assert engine.state.version is None and "e1" not in read_acks(chain.root)
        assert await agent.sync_once() == 2
    assert not srv.served_wrong(), srv.loads_checked
