"""Files in a root are 0644 and directories 0755 whatever the umask (issue 13, failure 2):
receivers often run as another uid (the Docker image runs as uid 10001)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncsync import Publisher, fsio
from asyncsync.errors import ConfigError
from asyncsync.format.acks import read_acks, write_ack
from asyncsync.publish.retention import RetentionPolicy
from receiver import ReceiverAgent
from receiver.engines.checkpoint import LocalCheckpoint
from tests.conftest import mixed_state, mutate

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def umask_077() -> Iterator[None]:
    old = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(old)


def _modes(root: Path) -> dict[str, int]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            out[os.path.relpath(p, root)] = stat.S_IMODE(os.lstat(p).st_mode)
    return out


async def test_every_file_and_dir_of_a_root_has_the_documented_mode(
    tmp_path: Path, umask_077: None
) -> None:
    root = tmp_path / "root"
    sd = mixed_state(0)
    policy = RetentionPolicy(keep_versions=2)
    async with Publisher(root, bucket_bytes=8192, keyframe_interval=2, retention=policy) as pub:
        await pub.seed(sd)
        for i in range(1, 4):
            sd = mutate(sd, 0.05, seed=i)
            await pub.publish(sd)
        async with ReceiverAgent(
            root, LocalCheckpoint(tmp_path / "ck"), "e1", use_inotify=False
        ) as a:
            assert await a.sync_once() == 3
            modes = _modes(root)
    assert any(k.startswith("acks") for k in modes) and any(k.startswith("leases") for k in modes)
    assert "log.jsonl" in modes and "asyncsync.json" in modes
    for rel, mode in modes.items():
        is_dir = (root / rel).is_dir()
        assert mode == (0o755 if is_dir else 0o644), (rel, oct(mode))
    assert stat.S_IMODE(root.stat().st_mode) == 0o755


def test_fsio_primitives_set_the_mode_on_the_descriptor(tmp_path: Path, umask_077: None) -> None:
    fsio.atomic_write(tmp_path / "a", b"x")
    fsio.append_line(tmp_path / "log", "{}")
    lock = fsio.FileLock(tmp_path / "lock")
    assert lock.acquire()
    lock.release()
    d = fsio.make_dir(tmp_path / "d" / "e", parents=True)
    write_ack(tmp_path, "e1", 1, "ab" * 16, "r")
    for p in ("a", "log", "lock", "acks/e1.json"):
        assert stat.S_IMODE((tmp_path / p).stat().st_mode) == 0o644, p
    for p in (d, d.parent, tmp_path / "acks"):
        assert stat.S_IMODE(p.stat().st_mode) == 0o755, p


# -- issue 20: an engine, and a receiver, running as another user than the trainer -------------

NOBODY = 65534  # nobody:nogroup


def _as_nobody(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``module.main(args)`` in a process running as nobody:nogroup (tests/as_user.py)."""
    argv = [sys.executable, "-m", "tests.as_user", str(NOBODY), str(NOBODY), module, *args]
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)


async def test_an_engine_running_as_another_user_reads_the_checkpoint(
    shared_tmp: Path, umask_077: None
) -> None:
    """(issue 20, failure 2) The checkpoint's data files are 0644 like its index, whatever the
    receiver's umask: an inference server under another uid (a non-root container, systemd's
    DynamicUser, k8s runAsUser) reads them with safetensors."""
    root, ckpt = shared_tmp / "root", shared_tmp / "ckpt"
    sd = mixed_state(0)
    async with Publisher(root, bucket_bytes=8192, keyframe_interval=2) as pub:
        await pub.seed(sd)
        for i in range(1, 4):  # deltas (files patched in place) and a keyframe (new files)
            sd = mutate(sd, 0.05, seed=i)
            await pub.publish(sd)
    async with ReceiverAgent(root, LocalCheckpoint(ckpt), "e1", use_inotify=False) as agent:
        assert await agent.sync_once() == 3
    for p in ckpt.iterdir():
        if p.name.endswith(".safetensors"):
            assert stat.S_IMODE(p.stat().st_mode) == 0o644, p
    r = _as_nobody("tests.read_checkpoint", str(ckpt))
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) == len(sd)


def _receiver_as_nobody(root: Path, ckpt: Path) -> subprocess.CompletedProcess[str]:
    return _as_nobody("receiver.cli", "--root", str(root), "--engine-id", "e1",
                      "--checkpoint", str(ckpt), "--once", "--force-polling")  # fmt: skip


async def test_a_receiver_under_another_uid_is_told_what_to_make_writable(shared_tmp: Path) -> None:
    """(issue 20, failure 4) A receiver under another uid than the trainer: a clear error
    naming acks/ and leases/ and the command that fixes it; after `asyncsync prepare --group`
    it syncs and acknowledges."""
    from asyncsync.ops.cli import main as cli

    root, ckpt = shared_tmp / "root", shared_tmp / "ckpt"
    sd = mixed_state(0)
    async with Publisher(root, bucket_bytes=8192) as pub:
        await pub.seed(sd)
    ckpt.mkdir()
    os.chown(ckpt, NOBODY, NOBODY)
    r = _receiver_as_nobody(root, ckpt)
    assert r.returncode == 1
    err = " ".join(r.stderr.split())
    assert f"uid {NOBODY}" in err and "cannot write" in err, err
    assert f"{root}/acks/" in err and f"{root}/leases/" in err
    assert f"asyncsync prepare {root} --group GROUP" in err
    assert not (root / "leases").exists() and not (root / "acks").exists()
    assert not (ckpt / ".asyncsync").exists()  # refused before the engine was touched
    assert cli(["prepare", str(root), "--group", str(NOBODY)]) == 0
    for d in ("acks", "leases"):
        st = (root / d).stat()
        assert st.st_gid == NOBODY and stat.S_IMODE(st.st_mode) == 0o2775
    r = _receiver_as_nobody(root, ckpt)
    assert r.returncode == 0, r.stderr
    assert "holds version 0" in r.stdout
    assert read_acks(root)["e1"].version == 0


@pytest.mark.parametrize("redo_log", ["0", "2"])
@pytest.mark.parametrize("umask", [0o177, 0o777])
async def test_a_receiver_under_a_umask_without_the_owners_read_right_keeps_its_own_files(
    shared_tmp: Path, umask: int, redo_log: str
) -> None:
    """A receiver of an unprivileged uid run with umask 0177 (files 0600: a common "private"
    umask) or 0777 (found by attack): it made ``.asyncsync/`` (and ``journal/``,
    ``staging/``, the root's ``leases/``) 0600 or 0000, which it could not enter, and failed
    at every start ("Permission denied: .../lock", or told to chmod what it had just made);
    with 0777 its staged files and redo records were 0000 too, and a redo record it could not
    read wiped the checkpoint and re-seeded it at every version, for ever. Every directory is
    0755 and every file 0644 whatever the umask, and the receiver syncs bit-exact."""
    from asyncsync.ops.cli import main as cli

    root, ckpt = shared_tmp / "root", shared_tmp / "ckpt"
    sd = mixed_state(0)
    async with Publisher(root, bucket_bytes=8192, keyframe_interval=3) as pub:
        await pub.seed(sd)
        for i in range(1, 6):  # deltas (journaled, or redo records) and a keyframe
            sd = mutate(sd, 0.05, seed=i)
            await pub.publish(sd)
    ckpt.mkdir()
    for p in (root, *root.rglob("*"), ckpt):  # the receiver makes acks/ and leases/ itself
        os.chown(p, NOBODY, NOBODY)
    old = os.umask(umask)
    try:
        r = _as_nobody(
            "receiver.cli", "--root", str(root), "--engine-id", "e1", "--checkpoint", str(ckpt),
            "--once", "--force-polling", "--checkpoint-redo-log", redo_log,
        )  # fmt: skip
    finally:
        os.umask(old)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "holds version 5" in r.stdout
    assert read_acks(root)["e1"].version == 5
    modes = {p: stat.S_IMODE(p.lstat().st_mode) for p in (*ckpt.rglob("*"), root / "leases")}
    assert {p: m for p, m in modes.items() if m != (0o755 if p.is_dir() else 0o644)} == {}
    assert cli(["verify", str(root), "--checkpoint", str(ckpt)]) == 0


async def test_a_checkpoint_of_another_uid_is_named_with_both_uids(shared_tmp: Path) -> None:
    """(attack-42) A checkpoint made by root, then a receiver under another uid (the root
    prepared for it): the error was "Permission denied: 'lock'", no path, no fix. It names the
    checkpoint's state directory, its owner, the receiver's uid and what to do."""
    from asyncsync.ops.cli import main as cli

    root, ckpt = shared_tmp / "root", shared_tmp / "ckpt"
    async with Publisher(root, bucket_bytes=8192) as pub:
        await pub.seed(mixed_state(0))
    async with ReceiverAgent(root, LocalCheckpoint(ckpt), "e1", use_inotify=False) as agent:
        assert await agent.sync_once() == 0  # made by root
    assert cli(["prepare", str(root), "--group", str(NOBODY)]) == 0
    os.chown(ckpt, NOBODY, NOBODY)  # the directory handed over, not what root made inside it
    r = _receiver_as_nobody(root, ckpt)
    assert r.returncode == 1
    err = " ".join(r.stderr.split())
    assert f"{ckpt}/.asyncsync" in err and f"uid {NOBODY}" in err and "uid 0" in err, err
    assert "chown -R" in err


async def test_a_root_receiver_without_cap_dac_override_is_told_the_modes(
    shared_tmp: Path,
) -> None:
    """(helper-32) uid 0 with its capabilities dropped (k8s ``capabilities: drop: [ALL]``,
    ``docker run --cap-drop ALL``) is refused by the modes of a root another uid owns, like any
    uid: the refusal said "refused whatever its mode (EPERM): an immutable or append-only
    attribute ..., or a security module's policy", which sends the operator to ``lsattr``."""
    setpriv = shutil.which("setpriv")
    caps = "-dac_override,-dac_read_search,-fowner"
    drop = [f"--bounding-set={caps}", f"--inh-caps={caps}", "--"]
    if setpriv is None or subprocess.run([setpriv, *drop, "true"], check=False).returncode:
        pytest.skip("needs setpriv and the right to drop capabilities")
    root, ckpt = shared_tmp / "root", shared_tmp / "ckpt"
    async with Publisher(root, bucket_bytes=8192) as pub:
        await pub.seed(mixed_state(0))
    for d, _, files in os.walk(root):  # the publisher is another uid than the receiver
        for name in [d, *(os.path.join(d, f) for f in files)]:
            os.chown(name, NOBODY, NOBODY)
    argv = [setpriv, *drop, sys.executable, "-m", "receiver.cli", "--root", str(root),
            "--engine-id", "e1", "--checkpoint", str(ckpt), "--once"]  # fmt: skip
    r = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)
    err = " ".join(r.stderr.split())
    assert r.returncode == 1 and "Traceback" not in err, err
    assert "(uid 0," in err and "cannot write" in err and "immutable" not in err, err
    assert f"asyncsync prepare {root} --group GROUP" in err, err
    assert not (root / "acks").exists() and not (ckpt / ".asyncsync").exists()


@pytest.mark.parametrize("group", ["99999999999999999999", "4294967295", "٣", "no-such-group-x"])
def test_prepare_refuses_a_bad_group_before_creating_anything(
    tmp_path: Path, group: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """(an attack) ``--group 99999999999999999999`` ended in an OverflowError traceback after
    ``acks/`` was made; 4294967295 is (gid_t)-1, which chown takes as "unchanged" (a silent
    success with the wrong group); "٣" (an Arabic-Indic three) became gid 3. Now a usage error
    (exit 2) for a bad gid, a one-line error for an unknown name, and nothing is created."""
    from asyncsync.format.store import prepare_shared_dirs
    from asyncsync.ops.cli import main as cli

    root = tmp_path / "root"
    assert cli(["prepare", str(root), "--group", group]) == (1 if "-" in group else 2)
    err = capsys.readouterr().err
    assert "Traceback" not in err and ("--group" in err or "no group named" in err), err
    assert not root.exists()
    with pytest.raises(ConfigError, match="out of range"):  # the library checks it too
        prepare_shared_dirs(root, 1 << 32)
    assert not root.exists()


async def test_an_immutable_leases_dir_is_named_as_such_not_as_a_mode(tmp_path: Path) -> None:
    """(attack 27, finding 8) ``chattr +i`` on ``leases/``: the refusal blamed the uid and the
    mode and proposed a group, which cannot help; it names the attribute now."""
    if os.getuid() != 0 or not shutil.which("chattr"):
        pytest.skip("needs root and chattr")
    root = tmp_path / "root"
    async with Publisher(root, bucket_bytes=8192) as pub:
        await pub.seed(mixed_state(0))
    (root / "leases").mkdir()
    if subprocess.run(["chattr", "+i", str(root / "leases")], check=False).returncode:
        pytest.skip("this filesystem has no immutable attribute")
    try:
        agent = ReceiverAgent(root, LocalCheckpoint(tmp_path / "ckpt"), "e1", use_inotify=False)
        with pytest.raises(ConfigError, match=r"refused whatever its mode \(EPERM\): an immutable"):
            await agent.sync_once()
    finally:
        subprocess.run(["chattr", "-i", str(root / "leases")], check=True)


def test_a_privileged_status_port_says_why_it_is_refused(shared_tmp: Path) -> None:
    """(fix-47) ``--status-port 80`` for a receiver that is not root was refused as "Permission
    denied; pick a free port": the port was free. The line says that ports below the
    unprivileged start need a capability, before the engine is opened. (It was found through
    the harness, which now imports the codec a host name's lookup needs before the drop:
    without it every lookup failed as "unknown encoding: idna".)"""
    start = int(Path("/proc/sys/net/ipv4/ip_unprivileged_port_start").read_text())
    if start <= 80:
        pytest.skip("port 80 is not privileged here")
    os.chmod(shared_tmp, 0o777)
    proc = _as_nobody("receiver.cli", "--root", str(shared_tmp / "root"), "--engine-id", "e1",
                      "--checkpoint", str(shared_tmp / "c"), "--status-port", "80")  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "--status-port 80 on 127.0.0.1: Permission denied" in last, last
    assert f"ports below {start}" in last and "CAP_NET_BIND_SERVICE" in last, last
    assert not (shared_tmp / "c").exists()


async def test_prepare_refuses_a_root_receivers_of_the_group_cannot_enter(
    shared_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """(attack-60) A root made with ``mkdir`` under umask 077 stays 0700 (the publisher does
    not change the mode of a root it did not create): ``asyncsync prepare --group`` said it
    was done (exit 0), and every receiver of the group then failed "Permission denied" on the
    root. It refuses now, naming the mode and the fix, before it creates anything; a root the
    group (or everyone) may read and enter is prepared as before."""
    from asyncsync.ops.cli import main as cli

    root = shared_tmp / "root"
    root.mkdir(mode=0o700)
    os.chmod(root, 0o700)
    async with Publisher(root, bucket_bytes=8192) as pub:
        await pub.seed(mixed_state(0))
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert _receiver_as_nobody(root, shared_tmp / "ckpt").returncode == 1  # what it led to
    assert cli(["prepare", str(root), "--group", str(NOBODY)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("asyncsync prepare: error:"), err
    assert f"{root} is mode 0700" in err and f"chmod 755 {root}" in err, err
    assert not (root / "acks").exists() and not (root / "leases").exists()
    os.chown(root, -1, NOBODY)
    os.chmod(root, 0o750)  # the group may read and enter: enough
    assert cli(["prepare", str(root), "--group", str(NOBODY)]) == 0
    assert (root / "acks").is_dir() and (root / "leases").is_dir()


async def test_an_ack_of_another_uid_in_a_sticky_acks_dir_is_a_clear_error(
    shared_tmp: Path,
) -> None:
    """(attack-85's bare PermissionError) A receiver under another uid finds its engine id's ack
    written by a root-run receiver before, naming a version its empty checkpoint does not hold,
    in an acks/ an admin made 1777: it may not remove it (sticky). It said "[Errno 1] Operation
    not permitted: 'e1.json'"; now what holds it back and the two ways out."""
    root, ckpt = shared_tmp / "root", shared_tmp / "ckpt"
    async with Publisher(root, bucket_bytes=8192) as pub:
        await pub.seed(mixed_state(0))
    write_ack(root, "e1", 0, "ab" * 16, "an-earlier-run")
    (root / "leases").mkdir(exist_ok=True)
    for d in ("acks", "leases"):
        os.chmod(root / d, 0o1777)
    ckpt.mkdir()
    os.chown(ckpt, NOBODY, NOBODY)
    r = _receiver_as_nobody(root, ckpt)
    assert r.returncode == 1
    err = " ".join(r.stderr.split())
    assert f"may not replace or remove {root}/acks/e1.json" in err, err
    assert "belongs to uid 0" in err and "sticky (mode 1777)" in err
    assert f"asyncsync prepare {root} --group GROUP" in err
    assert (root / "acks" / "e1.json").exists()  # left as it was


async def test_replacing_an_ack_of_another_uid_in_a_sticky_acks_dir_is_a_clear_error(
    shared_tmp: Path,
) -> None:
    """The same, where the ack names what the checkpoint holds (a root-run receiver synced v0,
    then the checkpoint was given to nobody): the new version's ack cannot be renamed over it."""
    root, ckpt = shared_tmp / "root", shared_tmp / "ckpt"
    sd = mixed_state(0)
    async with Publisher(root, bucket_bytes=8192) as pub:
        await pub.seed(sd)
        async with ReceiverAgent(root, LocalCheckpoint(ckpt), "e1", use_inotify=False) as agent:
            assert await agent.sync_once() == 0
        await pub.publish(mutate(sd, 0.05, seed=1))
    for d in ("acks", "leases"):
        os.chmod(root / d, 0o1777)
    for p in [ckpt, *ckpt.rglob("*")]:
        os.chown(p, NOBODY, NOBODY, follow_symlinks=False)
    r = _receiver_as_nobody(root, ckpt)
    assert r.returncode == 1
    err = " ".join(r.stderr.split())
    assert f"may not replace or remove {root}/acks/e1.json" in err, err
    assert "belongs to uid 0" in err and "sticky (mode 1777)" in err
    assert read_acks(root)["e1"].version == 0  # the old ack stands; nothing claims v1
