"""The processes of tests/test_planted.py: each component of the protocol, run as its own process
against a root with something planted in it (a symlink or a FIFO at a name the protocol uses).

Each entry point runs in a process forked from a forkserver that imported this module (and so
torch and asyncsync) once; it writes what it printed and how it ended to ``out`` (JSON). The
CLIs run through their ``main()`` (what the console scripts call), with stdout and stderr
captured.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import traceback
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import torch

import receiver.cli
from asyncsync import AsyncSyncError, Publisher
from asyncsync.ops import cli
from asyncsync.publish.rendezvous import FileRendezvous
from asyncsync.publish.retention import RetentionPolicy

# A tiny model: the processes are about names in the root, not sizes.
NAMES = ("w", "b", "scale")


def state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        "b": torch.randn(32, generator=g),
        "scale": torch.tensor(float(step)),
    }


def _report(out: str, fn: Callable[[], object]) -> None:
    """Run ``fn`` with output captured; write {"ok", "error", "output"} to ``out``."""
    buf = io.StringIO()
    result: dict[str, Any] = {"ok": True, "error": None}
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            rc = fn()
        if isinstance(rc, int) and rc != 0:
            result.update(ok=False, error=f"exit status {rc}")
    except (AsyncSyncError, OSError) as exc:  # a clear error: what an operator should see
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}")
    except BaseException as exc:  # anything else is a bug of the component
        result.update(ok=False, error=f"UNEXPECTED {type(exc).__name__}: {exc}")
        buf.write(traceback.format_exc())
    result["output"] = buf.getvalue()[-4000:]
    Path(out).write_text(json.dumps(result))


def _arun(coro: Callable[[], Coroutine[Any, Any, object]]) -> Callable[[], object]:
    return lambda: asyncio.run(coro())


def publisher(root: str, out: str) -> None:
    """A restarted trainer: open the root, seed a version, apply retention (keep 2)."""

    async def main() -> None:
        policy = RetentionPolicy(keep_versions=2, ack_ttl=None)
        async with Publisher(root, keyframe_interval=0, retention=policy) as pub:
            await pub.seed(state(10))

    _report(out, _arun(main))


def ranked(root: str, out: str) -> None:
    """Rank 0 of 2 through ``.rendezvous/`` (rank 1 never comes: the publish fails soon)."""

    async def main() -> None:
        coordinator = FileRendezvous(root, 0, 2, timeout=0.3, poll_interval=0.01)
        async with Publisher(root, coordinator=coordinator, keyframe_interval=0) as pub:
            await pub.seed(state(11))

    _report(out, _arun(main))


def gc(root: str, out: str) -> None:
    _report(out, lambda: cli.main(["gc", root, "--keep-versions", "1", "--ack-ttl", "0"]))


def status(root: str, out: str) -> None:
    _report(out, lambda: cli.main(["status", root, "--json"]))


def receive(root: str, out: str, checkpoint: str) -> None:
    argv = ["--root", root, "--engine-id", "e1", "--checkpoint", checkpoint, "--once"]
    os.environ["ASYNCSYNC_FORCE_POLLING"] = "1"
    _report(out, lambda: receiver.cli.main(argv))


COMPONENTS: dict[str, Callable[..., None]] = {
    "status": status,
    "receiver": receive,
    "rank 0 of 2": ranked,
    "publisher": publisher,
    "gc": gc,
}


# --------------------------------------------------------------------------- single findings


def _cap_memory(extra: int) -> None:
    """Let this process allocate at most ``extra`` more bytes (RLIMIT_AS): an unbounded read
    ends in MemoryError here instead of in the machine's memory."""
    import resource

    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + extra, resource.RLIM_INFINITY))


def publish_bounded(root: str, out: str) -> None:
    """Finding 2: a publish with retention under ``asyncio.wait_for`` (a FIFO lease in the root
    must not make it outlive its timeout, nor keep the process from exiting)."""

    async def main() -> None:
        policy = RetentionPolicy(keep_versions=2, ack_ttl=3600)
        async with Publisher(root, keyframe_interval=0, retention=policy) as pub:
            await asyncio.wait_for(pub.seed(state(12)), 20)

    _report(out, _arun(main))


def read_ack_capped(root: str, out: str) -> None:
    """Finding 4: read this engine's ack with 512 MiB of memory to spare."""
    from asyncsync.format.acks import read_ack

    _cap_memory(512 << 20)
    _report(out, lambda: print(repr(read_ack(Path(root), "e1"))))


def parse_capped(path: str, out: str) -> None:
    """Finding 7: parse a manifest file with 1 GiB of memory to spare."""
    from asyncsync.format import Manifest

    _cap_memory(1 << 30)
    _report(out, lambda: print(Manifest.from_json(Path(path).read_bytes(), where=path)))


def receive_as_nobody(root: str, out: str, checkpoint: str) -> None:
    """Finding 3: a receiver of another uid (65534) than the publisher's, which may not read a
    manifest of mode 0000 (EACCES). A short re-read window: the version is then bad."""
    from receiver import ReceiverAgent
    from receiver.engines.checkpoint import LocalCheckpoint

    os.setgid(65534)
    os.setuid(65534)

    async def main() -> int | None:
        engine = LocalCheckpoint(checkpoint)
        agent = ReceiverAgent(
            root, engine, "e1", use_inotify=False, prefetch=False, verify_deadline=0.5
        )
        async with agent:
            version = await agent.sync_once()
            print(f"holds {version}; bad {list(agent.status().bad_versions)}")
            return 0

    _report(out, _arun(main))
