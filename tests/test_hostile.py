"""A hostile or damaged shared directory: path escapes, symlinks and special files are refused.

Every case starts from an engine that holds version 1 of a good chain; version 2 is then made
hostile. The agent must refuse it with an AsyncSyncError (never another exception, never a
hang), keep the engine at version 1 with its bytes unchanged, and not acknowledge version 2.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import torch

from asyncsync import AsyncSyncError, FormatError, ManifestError, Publisher
from asyncsync.format import MANIFEST_NAME, version_dir
from asyncsync.format.acks import read_acks
from asyncsync.format.checksum import checksum_bytes
from asyncsync.format.store import list_versions, read_manifest
from receiver import ReceiverAgent
from receiver.engines.checkpoint import LocalCheckpoint, verify_checkpoint
from tests.conftest import mixed_state, mutate


class Chain:
    """A root with v0..v2 and an engine (LocalCheckpoint) that holds v1."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.root = tmp / "root"
        self.outside = tmp / "outside"
        self.outside.mkdir()
        self.ckpt = tmp / "ckpt"
        self.states = [mixed_state(0)]
        self.states += [mutate(self.states[0], 0.05, seed=1)]
        self.states += [mutate(self.states[1], 0.05, seed=2)]

    async def build(self) -> None:
        async with Publisher(self.root, bucket_bytes=4096, keyframe_interval=0) as pub:
            await pub.seed(self.states[0])
            await pub.publish(self.states[1])
            self.agent = ReceiverAgent(
                self.root,
                LocalCheckpoint(self.ckpt),
                "e1",
                use_inotify=False,
                prefetch=False,
                verify_deadline=0.05,
            )
            await self.agent.open()
            assert await self.agent.sync_once() == 1
            await pub.publish(self.states[2])
        self.m1 = read_manifest(self.root, 1)
        self.v2 = version_dir(self.root, 2)

    def shard(self, version: int = 2) -> Path:
        m = read_manifest(self.root, version)
        return version_dir(self.root, version) / m.shards[0].file

    def rewrite_manifest(self, edit: dict[str, object]) -> None:
        path = self.v2 / MANIFEST_NAME
        d = json.loads(path.read_text())
        d.update(edit)
        path.write_text(json.dumps(d))

    async def assert_refused(self) -> AsyncSyncError:
        """sync_once refuses (in bounded time) and the engine is untouched at v1."""
        with pytest.raises(AsyncSyncError) as ei:
            await asyncio.wait_for(self.agent.sync_once(), 30)
        self.assert_at_v1()
        return ei.value

    def assert_at_v1(self) -> None:
        assert self.agent.version == 1
        assert verify_checkpoint(self.ckpt, self.m1) == []
        ack = read_acks(self.root).get("e1")
        assert ack is not None and ack.version == 1


@pytest.fixture
async def chain(tmp_path: Path) -> Iterator[Chain]:  # type: ignore[misc]
    c = Chain(tmp_path)
    await c.build()
    yield c
    await c.agent.close()


async def test_version_dir_symlink_leaving_the_root_is_refused(chain: Chain) -> None:
    # A complete, valid v2 of the same run, but reached through a symlink to outside the root.
    target = chain.outside / "v2"
    shutil.move(chain.v2, target)
    chain.v2.symlink_to(target, target_is_directory=True)
    err = await chain.assert_refused()
    assert isinstance(err, ManifestError) and "symlink" in str(err)


async def test_version_dir_symlink_inside_the_root_is_refused(chain: Chain) -> None:
    shutil.move(chain.v2, chain.root / "elsewhere")
    chain.v2.symlink_to(chain.root / "elsewhere", target_is_directory=True)
    await chain.assert_refused()


async def test_manifest_symlink_is_refused(chain: Chain) -> None:
    target = chain.outside / MANIFEST_NAME
    shutil.move(chain.v2 / MANIFEST_NAME, target)
    (chain.v2 / MANIFEST_NAME).symlink_to(target)
    err = await chain.assert_refused()
    assert isinstance(err, ManifestError) and "symlink" in str(err)


async def test_shard_symlink_is_refused(chain: Chain) -> None:
    shard = chain.shard()
    target = chain.outside / shard.name
    shutil.move(shard, target)
    shard.symlink_to(target)
    err = await chain.assert_refused()
    assert isinstance(err, ManifestError) and "symlink" in str(err)


@pytest.mark.parametrize("name", ["../x.safetensors", "/tmp/x.safetensors", "a/b", "..", ".x"])
async def test_shard_name_that_leaves_the_version_dir_is_refused(chain: Chain, name: str) -> None:
    shard = chain.shard()
    data = shard.read_bytes()
    (chain.root / "x.safetensors").write_bytes(data)  # where "../x.safetensors" would point
    d = json.loads((chain.v2 / MANIFEST_NAME).read_text())
    d["shards"][0]["file"] = name
    chain.rewrite_manifest({"shards": d["shards"]})
    err = await chain.assert_refused()
    assert isinstance(err, ManifestError)


async def test_shard_that_is_a_directory_is_refused(chain: Chain) -> None:
    shard = chain.shard()
    shard.unlink()
    shard.mkdir()
    await chain.assert_refused()


async def test_shard_that_is_a_fifo_is_refused_without_hanging(chain: Chain) -> None:
    shard = chain.shard()
    shard.unlink()
    os.mkfifo(shard)
    try:
        await chain.assert_refused()
    finally:
        # Should a reader be blocked in open(), let it go so the test cannot hang the run.
        with contextlib.suppress(OSError):
            os.close(os.open(shard, os.O_WRONLY | os.O_NONBLOCK))


@pytest.mark.parametrize("kind", ["directory", "socket", "fifo"])
async def test_a_manifest_that_is_not_a_regular_file_is_a_bad_version(
    chain: Chain, kind: str
) -> None:
    """Issue 22, finding 3: a ``manifest.json`` that is a directory, a socket or a FIFO was a
    bare OSError at every sync (or a read blocked forever), never a bad version, so the
    receiver stayed behind it though a keyframe followed. Now it is a committed version that
    is bad at once: refused, reported, and gone past as soon as a keyframe follows."""
    path = chain.v2 / MANIFEST_NAME
    path.unlink()
    if kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
        sock.close()
    assert 2 in list_versions(chain.root)  # committed: the name exists (FORMAT.md section 1)
    try:
        err = await chain.assert_refused()
    finally:  # should a reader be blocked in open() (today's main), let it go
        if kind == "fifo":
            with contextlib.suppress(OSError):
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    assert isinstance(err, ManifestError) and "not a regular file" in str(err)
    assert 2 in chain.agent.status().bad_versions
    async with Publisher(chain.root) as pub:  # a restarted trainer seeds a keyframe: v3
        await pub.seed(chain.states[2])
    assert await asyncio.wait_for(chain.agent.sync_once(), 30) == 3
    assert verify_checkpoint(chain.ckpt, read_manifest(chain.root, 3)) == []


async def test_manifest_naming_another_version_is_refused(chain: Chain) -> None:
    chain.rewrite_manifest({"version": 1, "base_version": 0})
    await chain.assert_refused()


async def test_shard_checksum_fixed_up_but_header_names_another_run(chain: Chain) -> None:
    shard = chain.shard()
    data = shard.read_bytes()
    run = read_manifest(chain.root, 2).run_id
    forged = data.replace(run.encode(), b"0" * len(run))  # same length: the header still parses
    assert forged != data
    shard.write_bytes(forged)
    d = json.loads((chain.v2 / MANIFEST_NAME).read_text())
    d["shards"][0]["checksum"] = checksum_bytes(forged)
    chain.rewrite_manifest({"shards": d["shards"]})
    err = await chain.assert_refused()
    assert "another version" in str(err)


def _header_edits() -> dict[str, object]:
    """Ways to rewrite a delta shard's header that safetensors refuses (helper-21's attack on
    the delta shard reader, which now parses the header itself)."""

    def nested(text: bytes) -> bytes:
        return text[:-1] + b', "zz": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"

    def float_shape(text: bytes) -> bytes:
        h = json.loads(text)
        key = next(k for k in h if k != "__metadata__")
        h[key]["shape"] = [float(h[key]["shape"][0])]
        return json.dumps(h).encode()

    def utf16(text: bytes) -> bytes:
        return text.decode().encode("utf-16")

    def nan_metadata(text: bytes) -> bytes:
        return text.replace(b'"__metadata__":{', b'"__metadata__":{"x":NaN,', 1)

    return {"nested": nested, "float-shape": float_shape, "utf16": utf16, "NaN": nan_metadata}


@pytest.mark.parametrize("edit", sorted(_header_edits()))
async def test_a_delta_shard_header_safetensors_refuses_is_refused(chain: Chain, edit: str) -> None:
    """A shard whose header is rewritten (its checksums fixed up in the manifest) so that
    safetensors would refuse the file: a FormatError, never a RecursionError or an accepted
    version (a float shape was applied and acked; a header nested 100,000 deep raised
    RecursionError, which the agent's loop retried at every poll with a traceback)."""
    shard = chain.shard()
    data = shard.read_bytes()
    n = int.from_bytes(data[:8], "little")
    text = _header_edits()[edit](data[8 : 8 + n].rstrip())  # type: ignore[operator]
    forged = len(text).to_bytes(8, "little") + text + data[8 + n :]
    shard.write_bytes(forged)
    d = json.loads((chain.v2 / MANIFEST_NAME).read_text())
    d["shards"][0].update(bytes=len(forged), checksum=checksum_bytes(forged))
    totals = d["totals"]
    totals["wire_bytes"] = sum(s["bytes"] for s in d["shards"])
    totals["delta_bytes"] = sum(s["bytes"] for s in d["shards"] if s["role"] == "delta")
    chain.rewrite_manifest({"shards": d["shards"], "totals": totals})
    err = await chain.assert_refused()
    assert isinstance(err, FormatError) and not isinstance(err, ManifestError), err
    assert "safetensors header" in str(err) or "delta blob" in str(err), err


def test_symlinked_manifest_is_refused_by_read_manifest(tmp_path: Path) -> None:
    """The store's own check, below the agent (asyncsync inspect/verify read through it)."""
    root = tmp_path / "r"

    async def publish() -> None:
        async with Publisher(root) as pub:
            await pub.seed({"w": torch.zeros(4)})

    asyncio.run(publish())
    v0 = version_dir(root, 0)
    shutil.move(v0, tmp_path / "v0")
    v0.symlink_to(tmp_path / "v0", target_is_directory=True)
    with pytest.raises(ManifestError, match="symlink"):
        read_manifest(root, 0)


async def test_the_inotify_watch_never_walks_a_symlink_in_the_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 22: a recursive watch follows symlinks (watchfiles walks them and watches their
    targets: one to ``/`` planted in the root made it walk the whole filesystem, in the event
    loop). The receiver watches the root alone; commits wake it by the log line they append.
    This is the watchfiles fallback (no inotify of our own); receiver/inotify.py's watch of
    the root alone: tests/test_inotify.py::test_a_symlink_in_the_root_is_not_followed."""
    import watchfiles

    from receiver import inotify
    from receiver.watch import wakeups

    monkeypatch.setattr(inotify, "available", lambda: False)

    seen: dict[str, object] = {}

    async def spy(*paths: object, **kw: object) -> AsyncIterator[set[object]]:
        seen.update(kw, paths=paths)
        return
        yield set()

    monkeypatch.setattr(watchfiles, "awatch", spy)
    (tmp_path / "link").symlink_to("/", target_is_directory=True)
    async for reason in wakeups(tmp_path, poll_interval=0.01, use_inotify=True):
        if reason == "poll":
            break
    assert seen["recursive"] is False and seen["paths"] == (tmp_path,)
