"""A checkpoint directory the receiver cannot write (a read-only mount, a filesystem remounted
read-only after an I/O error, mode 0555): one typed error that names the path and says what
to do, and ``asyncsync-receiver`` exits 1 with that one line, no traceback.

Before, a read-only mount ended the receiver with "OSError: [Errno 30] Read-only file system:
'lock'" (the lock file's name alone, opened through its directory's descriptor), and a 0555
checkpoint opened and then failed every version with "Permission denied:
'.tmp.state.json.…'" (the daemon retried it for ever)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from asyncsync import Publisher
from asyncsync.errors import EngineStateError
from asyncsync.ops.workload import Workload, WorkloadConfig
from receiver import ReceiverAgent
from receiver.engines.checkpoint import LocalCheckpoint
from tests.mounts import bindfs_mount, tmpfs

REPO = Path(__file__).resolve().parent.parent
NOBODY = 65534


def _receiver(
    root: Path, ckpt: Path, *, as_nobody: bool = False
) -> subprocess.CompletedProcess[str]:
    """``asyncsync-receiver --once`` in a process of its own (as nobody: tests/as_user.py)."""
    head = [sys.executable, "-m", "receiver.cli"]
    if as_nobody:
        head = [sys.executable, "-m", "tests.as_user", str(NOBODY), str(NOBODY), "receiver.cli"]
    argv = [*head, "--root", str(root), "--engine-id", "e1", "--checkpoint", str(ckpt),
            "--once", "--force-polling"]  # fmt: skip
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)


def _one_line(r: subprocess.CompletedProcess[str]) -> str:
    """The receiver's stderr, asserted to be one error line and no traceback."""
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("asyncsync-receiver e1: error: "), lines[0]
    return lines[0]


async def _seed_and_sync(root: Path, ckpt: Path, deltas: int) -> None:
    """v0 published and taken by a receiver into ``ckpt``, then ``deltas`` more published."""
    wl = Workload(WorkloadConfig(layers=1, hidden=32, vocab=64, seed=3))
    async with Publisher(root) as pub:
        await pub.seed(wl.state_dict())
        async with ReceiverAgent(root, LocalCheckpoint(ckpt), "e1", use_inotify=False) as agent:
            assert await agent.sync_once() == 0
        for _ in range(deltas):
            wl.step()
            await pub.publish(wl.state_dict())


async def test_a_read_only_bind_mount_is_one_line_naming_the_lock_and_the_fix(
    shared_tmp: Path,
) -> None:
    root, src = shared_tmp / "root", shared_tmp / "ckpt"
    await _seed_and_sync(root, src, deltas=1)
    with bindfs_mount(src, shared_tmp / "ro", read_only=True) as ro:
        line = _one_line(await asyncio.to_thread(_receiver, root, ro))
        with pytest.raises(EngineStateError, match="read-only") as info:
            await LocalCheckpoint(ro).open()
    assert f"{ro}/.asyncsync/lock" in line and "read-only" in line, line
    assert "mount it read-write" in line, line
    assert "'lock'" not in line and "OSError" not in line, line
    assert str(info.value) in line


async def test_a_fresh_checkpoint_on_a_read_only_tmpfs_names_the_state_directory(
    shared_tmp: Path,
) -> None:
    root = shared_tmp / "root"
    await _seed_and_sync(root, shared_tmp / "other", deltas=0)
    with tmpfs(shared_tmp / "mnt", "1m") as mnt:
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        line = _one_line(await asyncio.to_thread(_receiver, root, mnt / "ckpt"))
    assert f"{mnt}/ckpt" in line and "read-only" in line and "mount it read-write" in line, line
    assert "Errno" not in line, line


async def test_a_state_directory_made_immutable_under_a_running_engine_is_named(
    shared_tmp: Path,
) -> None:
    """A write refused while the engine runs (here ``chattr +i`` on its state directory; a
    filesystem remounted read-only after an I/O error alike): the version is refused with the
    directory named, not "PermissionError: '.tmp.state.json.…'" (a name opened in its
    directory), and nothing was written."""
    if shutil.which("chattr") is None:
        pytest.skip("needs chattr (e2fsprogs)")
    root = shared_tmp / "root"
    with tmpfs(shared_tmp / "mnt", "8m") as mnt:  # (a tmpfs takes the attribute since 6.0)
        ckpt = mnt / "ckpt"
        await _seed_and_sync(root, ckpt, deltas=1)
        engine = LocalCheckpoint(ckpt)
        async with ReceiverAgent(root, engine, "e1", use_inotify=False) as agent:
            state = ckpt / ".asyncsync"
            r = subprocess.run(["chattr", "+i", str(state)], capture_output=True, text=True)
            if r.returncode:
                pytest.skip(f"chattr +i refused here: {r.stderr.strip()}")
            try:
                with pytest.raises(EngineStateError, match="EPERM") as info:
                    await agent.sync_once()
            finally:
                subprocess.run(["chattr", "-i", str(state)], check=True)
            assert engine.state.version == 0
    assert f"cannot write {state}:" in str(info.value), info.value
    assert f"lsattr -d {state}" in str(info.value), info.value


@pytest.mark.parametrize("what", ["data file", "journal"])
async def test_an_immutable_file_at_start_is_named_as_such_not_as_a_mode(
    shared_tmp: Path, what: str
) -> None:
    """A data file or ``journal/`` made immutable (``chattr +i``) while the receiver was down
    (found by attack with a real receiver): its start said "has mode 0644, which does not let
    its owner write it ... `chmod -R u+w`" (a chmod that changes nothing). Now the one line
    says the mode is not the cause and names ``lsattr``."""
    if shutil.which("chattr") is None:
        pytest.skip("needs chattr (e2fsprogs)")
    root = shared_tmp / "root"
    with tmpfs(shared_tmp / "mnt", "8m") as mnt:  # (a tmpfs takes the attribute since 6.0)
        ckpt = mnt / "ckpt"
        await _seed_and_sync(root, ckpt, deltas=1)
        target = ckpt / ".asyncsync" / "journal"
        if what == "data file":
            (target,) = ckpt.glob("*.safetensors")
        r = subprocess.run(["chattr", "+i", str(target)], capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"chattr +i refused here: {r.stderr.strip()}")
        try:
            line = _one_line(_receiver(root, ckpt))
        finally:
            subprocess.run(["chattr", "-i", str(target)], check=True)
    assert f"cannot write {target}: refused whatever its mode (EPERM)" in line, line
    assert f"lsattr -d {target}" in line and "chmod" not in line, line


@pytest.mark.parametrize("fresh", [False, True], ids=["held", "fresh"])
async def test_a_0555_checkpoint_of_the_receivers_own_uid_says_chmod(
    shared_tmp: Path, fresh: bool
) -> None:
    """The owner without the write bit: refused at start, not at each version (the state dir
    too: its lock file, 0644, still opens for writing), and told to chmod, not to chown."""
    from asyncsync.ops.cli import main as cli

    root, ckpt = shared_tmp / "root", shared_tmp / "ckpt"
    await _seed_and_sync(root, shared_tmp / "other" if fresh else ckpt, deltas=1)
    assert cli(["prepare", str(root), "--group", str(NOBODY)]) == 0
    ckpt.mkdir(exist_ok=True)
    subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", str(ckpt)], check=True)
    for d in (ckpt, ckpt / ".asyncsync"):
        if d.exists():
            d.chmod(0o555)
    line = _one_line(await asyncio.to_thread(_receiver, root, ckpt, as_nobody=True))
    assert f"uid {NOBODY}" in line and "mode 0555" in line, line
    assert f"chmod -R u+w {ckpt}" in line and "chown" not in line, line
    assert "Errno" not in line and ".tmp." not in line, line
