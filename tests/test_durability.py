"""Crash consistency of publish, apply and gc, from the filesystem operations they make.

A killed process keeps the page cache, so ``kill -9`` tests never see a missing ``fsync``. This
test records the operations (create, fsync of a file or directory, rename, unlink, mkdir) of a
real publish, a receiver's apply and a ``gc``, and checks them against the rules POSIX gives a
crash (ALICE's model, reduced to the barriers that matter here): file data is durable only after
an ``fsync`` of the file, a directory entry only after an ``fsync`` of its directory. Each rule
is a crash state that would be unrecoverable or serve a bad version if it were broken:

* R1 a file renamed into place was fsynced after it was written (else a crash after the rename
  can leave an empty or partial file under the final name);
* R2 when ``vN/manifest.json`` is renamed in, every shard entry of ``vN`` and ``vN``'s own
  entry in the root are durable (else a committed version can lack a shard after a crash);
* R3 gc removes a version's manifest, and makes that durable, before any other file of it
  (else a crash can leave a committed manifest naming deleted shards);
* R4 an ack is renamed in only after the engine's ``state.json`` naming that version is
  durable (an ack never names a version the engine does not hold after a crash).
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from asyncsync import Publisher
from asyncsync.publish.retention import RetentionPolicy, collect
from receiver import ReceiverAgent
from receiver.engines.checkpoint import LocalCheckpoint
from tests.conftest import mixed_state, mutate

_VDIR = re.compile(r"v\d{12}$")


class Recorder:
    """Wraps os.open/fsync/replace/rename/unlink/mkdir and records what they did."""

    def __init__(self) -> None:
        self.ops: list[tuple[str, ...]] = []

    @staticmethod
    def _path(path: Any, dir_fd: int | None = None) -> str:
        p = os.fsdecode(path)
        if dir_fd is not None and not os.path.isabs(p):
            p = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), p)
        return os.path.realpath(p) if os.path.exists(os.path.dirname(p) or ".") else p

    def install(self, mp: pytest.MonkeyPatch) -> None:
        names = ("open", "fsync", "replace", "rename", "unlink", "mkdir")
        real = {n: getattr(os, n) for n in names}
        rec = self.ops

        def open_(path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
            fd = real["open"](path, flags, mode, dir_fd=dir_fd)
            if flags & os.O_CREAT:
                rec.append(("create", self._path(path, dir_fd)))
            return fd

        def fsync(fd: int) -> None:
            real["fsync"](fd)
            p = os.readlink(f"/proc/self/fd/{fd}")
            rec.append(("fsync_dir" if os.path.isdir(p) else "fsync", p))

        def move(name: str) -> Any:
            def f(src: Any, dst: Any, **kw: Any) -> None:
                s, d = self._path(src, kw.get("src_dir_fd")), self._path(dst, kw.get("dst_dir_fd"))
                real[name](src, dst, **kw)
                rec.append(("rename", s, d))

            return f

        def unlink(path: Any, *, dir_fd: int | None = None) -> None:
            p = self._path(path, dir_fd)
            real["unlink"](path, dir_fd=dir_fd)
            rec.append(("unlink", p))

        def mkdir(path: Any, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
            real["mkdir"](path, mode, dir_fd=dir_fd)
            rec.append(("mkdir", self._path(path, dir_fd)))

        fns = (open_, fsync, move("replace"), move("rename"), unlink, mkdir)
        for name, fn in zip(names, fns, strict=True):
            mp.setattr(os, name, fn)


def violations(ops: list[tuple[str, ...]]) -> list[str]:
    """The rules of the module docstring broken by ``ops``."""
    out: list[str] = []
    written: set[str] = set()  # created, not fsynced since
    pending: dict[str, set[str]] = defaultdict(set)  # dir -> entries changed, not yet durable
    uncommitting: dict[str, str] = {}  # vdir -> "gone" (unlinked) / "durable" (dir fsynced)
    for op, *args in ops:
        if op == "create":
            (p,) = args
            written.add(p)
            pending[os.path.dirname(p)].add(p)
        elif op == "fsync":
            written.discard(args[0])
        elif op == "fsync_dir":
            (d,) = args
            pending[d].clear()
            if uncommitting.get(d) == "gone":
                uncommitting[d] = "durable"
        elif op == "mkdir":
            pending[os.path.dirname(args[0])].add(args[0])
        elif op == "rename":
            s, d = args
            if s in written:
                out.append(f"R1: {d} renamed in before its data was fsynced")
            written.discard(s)
            dd = os.path.dirname(d)
            if os.path.basename(d) == "manifest.json" and _VDIR.search(dd):
                late = pending[dd] - {s, d}
                if late:
                    out.append(f"R2: {d} committed before {sorted(late)} were durable")
                if dd in pending[os.path.dirname(dd)]:
                    out.append(f"R2: {d} committed before {dd}'s entry was durable")
            if os.path.basename(dd) == "acks":
                state_dirs = [
                    k for k, v in pending.items() if any(x.endswith("state.json") for x in v)
                ]
                if state_dirs:
                    out.append(f"R4: ack {d} written before {state_dirs} were durable")
            pending[os.path.dirname(s)].add(s)
            pending[dd].add(d)
        elif op == "unlink":
            (p,) = args
            vd = os.path.dirname(p)
            if _VDIR.search(vd):
                if os.path.basename(p) == "manifest.json":
                    uncommitting[vd] = "gone"
                elif uncommitting.get(vd) != "durable" and not os.path.basename(p).startswith("."):
                    out.append(f"R3: {p} removed before {vd}'s manifest removal was durable")
            pending[vd].add(p)
    return out


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Iterator[Recorder]:
    r = Recorder()
    r.install(monkeypatch)
    yield r


async def test_publish_apply_and_gc_keep_every_crash_state_recoverable(
    tmp_path: Path, recorder: Recorder
) -> None:
    root = tmp_path / "root"
    sd = mixed_state(0)
    async with Publisher(root, bucket_bytes=8192, keyframe_interval=3) as pub:
        await pub.seed(sd)
        agent = ReceiverAgent(root, LocalCheckpoint(tmp_path / "ck"), "e1", use_inotify=False)
        async with agent:
            for i in range(1, 7):
                sd = mutate(sd, 0.05, seed=i)
                await pub.publish(sd)
                assert await agent.sync_once() == i
    report = collect(root, RetentionPolicy(keep_versions=1, ack_ttl=None))
    assert report.deleted  # gc removed versions while recorded
    kinds = {op[0] for op in recorder.ops}
    assert {"create", "fsync", "fsync_dir", "rename", "unlink", "mkdir"} <= kinds
    assert any(op[0] == "rename" and op[2].endswith("manifest.json") for op in recorder.ops)
    assert any(op[0] == "rename" and "/acks/" in op[2] for op in recorder.ops)
    assert violations(recorder.ops) == []


@pytest.mark.parametrize(
    "ops, rule",
    [
        ([("create", "/r/v000000000001/.tmp.a"), ("rename", "/r/v000000000001/.tmp.a",
          "/r/v000000000001/a")], "R1"),
        ([("mkdir", "/r/v000000000001"), ("fsync_dir", "/r"),
          ("create", "/r/v000000000001/.tmp.s"), ("fsync", "/r/v000000000001/.tmp.s"),
          ("rename", "/r/v000000000001/.tmp.s", "/r/v000000000001/s"), ("fsync_dir", "/r"),
          ("create", "/r/v000000000001/.tmp.m"), ("fsync", "/r/v000000000001/.tmp.m"),
          ("rename", "/r/v000000000001/.tmp.m", "/r/v000000000001/manifest.json")], "R2"),
        ([("unlink", "/r/v000000000001/s"), ("unlink", "/r/v000000000001/manifest.json")], "R3"),
        ([("create", "/c/.asyncsync/.tmp.st"), ("fsync", "/c/.asyncsync/.tmp.st"),
          ("rename", "/c/.asyncsync/.tmp.st", "/c/.asyncsync/state.json"),
          ("create", "/r/acks/.tmp.e"), ("fsync", "/r/acks/.tmp.e"),
          ("rename", "/r/acks/.tmp.e", "/r/acks/e.json")], "R4"),
    ],
)  # fmt: skip
def test_the_checker_sees_each_broken_rule(ops: list[tuple[str, ...]], rule: str) -> None:
    """The mutations no kill test noticed: no fsync before the rename (R1), the root fsynced
    twice instead of the version dir (R2), files removed before the manifest (R3)."""
    found = violations(ops)
    assert found and all(v.startswith(rule) for v in found), found
