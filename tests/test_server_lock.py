"""One receiver per inference server on a host (``receiver.engines.server_lock``), with real
receiver processes on one fake SGLang server."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from yarl import URL

from asyncsync.errors import ConfigError, LockHeld
from asyncsync.format.acks import read_acks
from receiver import ReceiverAgent
from receiver.engines import SGLang, server_lock
from receiver.engines.http_engine import Timeouts
from receiver.engines.server_lock import ServerLock, server_key
from tests.fake_engines import FAST_RETRY, Chain, FakeSGLang, ServerThread, publish_chain

REPO = Path(__file__).resolve().parent.parent


def _receiver(root: Path, engine_id: str, ckpt: Path, url: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "receiver.cli", "--root", str(root), "--engine-id", engine_id,
         "--checkpoint", str(ckpt), "--sglang-url", url, "--poll-interval", "0.2",
         "--force-polling", "--log-level", "WARNING"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip


def _wait_ack(proc: subprocess.Popen[str], root: Path, engine_id: str, version: int) -> None:
    deadline = time.monotonic() + 90
    while getattr(read_acks(root).get(engine_id), "version", None) != version:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{engine_id} never acknowledged v{version}"
        time.sleep(0.1)


@pytest.mark.heavy
def test_a_second_receiver_on_the_same_server_is_refused_until_the_first_dies(
    tmp_path: Path,
) -> None:
    """(attack-76) Two receivers on one SGLang server (another root, one version behind)
    reloaded it against each other: each saw the other's label, marked the server lost and
    reloaded its own checkpoint, 20 reloads in 30 s with the server paused at each, for as long
    as both ran. The second one is refused now, one line naming the first (under another name
    of the same loopback server too); once the first is SIGKILLed, a replacement takes the
    server at once."""
    r1, r2 = tmp_path / "r1", tmp_path / "r2"
    publish_chain(r1, 3)  # v0..v2
    publish_chain(r2, 2)  # v0..v1: other weights
    with ServerThread(FakeSGLang()) as srv:
        first = _receiver(r1, "first", tmp_path / "ck1", srv.url)
        procs = [first]
        try:
            _wait_ack(first, r1, "first", 2)
            alias = srv.url.replace("127.0.0.1", "localhost")
            second = _receiver(r2, "second", tmp_path / "ck2", alias)
            procs.append(second)
            _, err = second.communicate(timeout=120)
            assert second.returncode == 1, err
            assert len(err.strip().splitlines()) == 1, err
            assert "driven by another receiver on this host" in err, err
            assert f"pid {first.pid}, checkpoint {tmp_path / 'ck1'}" in err, err
            assert srv.weight_version == "2" and "second" not in read_acks(r2)

            first.send_signal(signal.SIGKILL)
            first.communicate(timeout=30)
            third = _receiver(r2, "third", tmp_path / "ck3", srv.url)
            procs.append(third)
            _wait_ack(third, r2, "third", 1)
            assert srv.weight_version == "1"
            third.send_signal(signal.SIGTERM)
            _, err = third.communicate(timeout=60)
            assert third.returncode == 0, err
        finally:
            for p in procs:
                p.kill()
                p.communicate()  # (its pipes closed)


def test_the_lock_is_released_when_closed_and_names_its_holder(tmp_path: Path) -> None:
    url = URL("http://127.0.0.1:1/")
    lock = ServerLock.take("sglang", url, str(tmp_path / "a"))
    with pytest.raises(LockHeld, match=rf"pid {os.getpid()}, checkpoint {tmp_path / 'a'}"):
        ServerLock.take("sglang", URL("http://[::1]:1"), str(tmp_path / "b"))
    lock.release()
    lock.release()  # idempotent
    ServerLock.take("sglang", URL("http://localhost:1"), str(tmp_path / "b")).release()
    assert server_key(URL("http://LOCALHOST:80")) == server_key(URL("http://127.0.0.1"))
    assert server_key(URL("http://10.0.0.1:30000")) != server_key(URL("http://10.0.0.2:30000"))


def test_receivers_of_two_uids_exclude_each_other_under_a_umask_of_077(tmp_path: Path) -> None:
    """(attack-76) The lock file is made 0666 whatever the umask: a receiver under another uid
    (nobody) is refused while root's holds the server, naming it, and takes it once released;
    then root's is refused while nobody's holds it."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a process as another uid")
    url = URL(f"http://127.0.0.1:{65000 + os.getpid() % 500}")
    old = os.umask(0o077)
    try:
        lock = ServerLock.take("sglang", url, "/ck-root")
    finally:
        os.umask(old)
    assert lock.path is not None and stat.S_IMODE(lock.path.stat().st_mode) == 0o666

    def as_nobody() -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.as_user", "65534", "65534", "tests.server_lock_taker",
             str(url).replace("127.0.0.1", "localhost"), "/ck-nobody"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            cwd=REPO,
        )  # fmt: skip

    try:
        out, err = as_nobody().communicate(timeout=120)
        assert out.startswith("refused: ") and f"pid {os.getpid()}, checkpoint /ck-root" in out, err
        lock.release()
        holder = as_nobody()
        try:
            assert holder.stdout is not None and holder.stdout.readline() == "took\n"
            with pytest.raises(LockHeld, match=rf"pid {holder.pid}, checkpoint /ck-nobody"):
                ServerLock.take("sglang", url, "/ck-root")
        finally:
            holder.communicate("\n", timeout=60)
        assert holder.returncode == 0
    finally:
        lock.release()
        if lock.path is not None:
            lock.path.unlink(missing_ok=True)


def test_a_lock_file_a_receiver_cannot_open_is_one_clear_error(tmp_path: Path) -> None:
    """(attack-80) What sits at the lock's path and cannot be opened (a directory; a file of
    another uid this one may not read: left by a receiver under root with umask 077, made by
    hand) raised a bare IsADirectoryError or PermissionError out of the engine's open: the
    receiver printed "[Errno 13] Permission denied: '/tmp/asyncsync-server-...lock'" with no
    owner, mode nor remedy. Now a ConfigError names the path, what is there and the fix."""
    url = URL(f"http://127.0.0.1:{64000 + os.getpid() % 500}")
    lock = ServerLock.take("sglang", url, "/ck")
    lock.release()
    assert lock.path is not None
    path = lock.path
    path.unlink()
    path.mkdir()
    try:
        with pytest.raises(ConfigError, match=rf"{path} is a directory, not a lock file: remove"):
            ServerLock.take("sglang", url, "/ck")
    finally:
        path.rmdir()
    if os.geteuid() != 0:
        return  # (the rest runs a process as another uid)
    path.write_text("")
    path.chmod(0o600)  # root's, unreadable by nobody
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "tests.as_user", "65534", "65534", "tests.server_lock_taker",
             str(url), "/ck-nobody"],
            capture_output=True, text=True, cwd=REPO, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 1, (proc.stdout, proc.stderr)
        assert proc.stdout.startswith(f"error: cannot open the lock file {path}"), proc
        assert "belongs to uid 0 (mode 0600)" in proc.stdout, proc.stdout
        assert "this receiver runs as uid 65534" in proc.stdout, proc.stdout
        assert "Traceback" not in proc.stderr, proc.stderr
    finally:
        path.unlink(missing_ok=True)


def _taken_by_another_process(url: str) -> str:
    """What tests/server_lock_taker says in a process of its own: ``took`` (then let go) or
    ``refused: ...`` (this process still holds the server)."""
    code = "import sys; from tests.server_lock_taker import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.run(
        [sys.executable, "-c", code, url, "/ck-other"], input="\n", capture_output=True,
        text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    return proc.stdout.strip() or proc.stderr


async def test_an_open_cancelled_while_it_takes_the_lock_leaves_the_server_free(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(attack-80) ``open()`` took the server lock in a thread (``asyncio.to_thread``): cancelled
    meanwhile, the thread went on, took it, and its result was dropped: the fd leaked and this
    process held the server for good (a Ray actor reused, a library caller: no replacement
    could drive it). The take finished after its caller was cancelled is released now."""
    url = f"http://127.0.0.1:{63000 + os.getpid() % 500}"
    inside, go, released = threading.Event(), threading.Event(), threading.Event()
    real_open, real_release = server_lock._open, ServerLock.release

    def held_open(path: Path, dir_fd: int | None = None) -> tuple[int, bool]:  # held at a gate
        inside.set()
        assert go.wait(120)
        return real_open(path, dir_fd)

    def release(lock: ServerLock) -> None:
        held = lock.fd is not None
        real_release(lock)
        if held:
            released.set()

    monkeypatch.setattr(server_lock, "_open", held_open)
    monkeypatch.setattr(ServerLock, "release", release)
    engine = SGLang(url, tmp_path / "ckpt")
    task = asyncio.create_task(engine.open())
    assert await asyncio.to_thread(inside.wait, 120)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    go.set()  # the take in the thread goes on, takes the lock, and must let it go
    assert await asyncio.to_thread(released.wait, 120), "the lock a cancelled open() took is held"
    assert _taken_by_another_process(url) == "took"
    await engine.close()


async def test_a_close_cancelled_midway_releases_the_server(tmp_path: Path) -> None:
    """(attack-80) ``close()`` released the server lock on its last line only: cancelled while
    it waited for a resume call still running (or failing before that line), it left the lock
    held by a process that no longer drives the server. Released on every path now."""
    chain = Chain(tmp_path / "root")
    async with chain.pub, FakeSGLang() as srv:
        timeouts = Timeouts(control=60.0, update=2.0, connect=0.2, startup=30.0)
        engine = SGLang(srv.url, tmp_path / "ckpt", timeouts=timeouts, retry=FAST_RETRY,
                        failure_backoff=(0.0, 0.0))  # fmt: skip
        agent = ReceiverAgent(chain.root, engine, "e1", use_inotify=False)
        await agent.open()
        await chain.next()
        assert await agent.sync_once() == 0
        await chain.next()
        srv.inject("/continue_generation", status=500, delay=5.0, times=50)  # resume hangs
        n = len(srv.calls)
        sync = asyncio.create_task(agent.sync_once())
        while "POST /continue_generation" not in srv.endpoints()[n:]:
            await asyncio.sleep(0.01)
        sync.cancel()
        with pytest.raises(asyncio.CancelledError):
            await sync
        assert engine._background  # the resume call goes on: close() waits for it
        assert _taken_by_another_process(srv.url).startswith("refused: ")  # (held while open)
        closing = asyncio.create_task(agent.close())
        for _ in range(3):  # into close(): it waits for the resume call (5 s an attempt)
            await asyncio.sleep(0)
        assert not closing.done()
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
        assert _taken_by_another_process(srv.url) == "took"
        await engine.close()  # (the resume call cancelled and awaited)


def _taker(url: str, tmpdir: Path, checkpoint: str) -> subprocess.Popen[str]:
    """tests/server_lock_taker in a process of its own, its temporary directory ``tmpdir``."""
    code = "import sys; from tests.server_lock_taker import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.Popen(
        [sys.executable, "-c", code, url, checkpoint], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env={**os.environ, "TMPDIR": str(tmpdir)},
    )  # fmt: skip


def _tmpfiles_clean(tmpdir: Path) -> None:
    """The real systemd-tmpfiles' age-based cleanup of ``tmpdir``, as a distribution's
    ``tmp.conf`` runs it on /tmp every day, with every file and directory in it aged 30 days
    (by access and modification time: the change time cannot be set back, so the rule ages by
    the other two, systemd 250 and later)."""
    old = time.time() - 30 * 86400
    for path in [*tmpdir.rglob("*")]:
        os.utime(path, (old, old), follow_symlinks=False)
    conf = tmpdir.parent / "tmpfiles.conf"
    conf.write_text(f"e {tmpdir} - - - am:10d\n")
    proc = subprocess.run(
        ["systemd-tmpfiles", "--clean", str(conf)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.skipif(shutil.which("systemd-tmpfiles") is None, reason="needs systemd-tmpfiles")
def test_a_lock_held_for_weeks_survives_the_cleanup_of_the_temporary_directory(
    tmp_path: Path,
) -> None:
    """(the lead, 26th session) systemd-tmpfiles removes the files of /tmp unused for 10 days
    (most distributions): the lock file of a receiver up for longer went, and a second receiver
    on the same server made a new one and took the server. The lock file lives in a directory
    the holder keeps locked shared, which the cleanup skips; once the holder is gone, the
    cleanup removes its files as before."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    url = f"http://127.0.0.1:{62000 + os.getpid() % 500}"
    holder = _taker(url, tmpdir, "/ck-first")
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "took\n"
        _tmpfiles_clean(tmpdir)
        second = _taker(url, tmpdir, "/ck-second")
        out, err = second.communicate("\n", timeout=120)
        assert out.startswith("refused: "), (out, err)
        assert f"pid {holder.pid}, checkpoint /ck-first" in out, out
    finally:
        holder.communicate("\n", timeout=60)
    assert holder.returncode == 0
    _tmpfiles_clean(tmpdir)
    assert not [p for p in tmpdir.rglob("*") if p.is_file()]
    third = _taker(url, tmpdir, "/ck-third")
    out, err = third.communicate("\n", timeout=120)
    assert out == "took\n", (out, err)


def test_the_lock_directory_is_refused_when_it_is_not_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(the lead, 26th session) A symlink or a file where the lock files' directory goes (a
    shared temporary directory) is refused in one line, never followed; the directory made is
    mode 1777 whatever the umask, so every uid's receivers can make their lock files there."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    url = URL(f"http://127.0.0.1:{61000 + os.getpid() % 500}")
    where = tmp_path / server_lock.DIR_NAME
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where.symlink_to(elsewhere)
    with pytest.raises(ConfigError, match=rf"{where} is not a directory \(a symbolic link or a"):
        ServerLock.take("sglang", url, "/ck")
    assert not list(elsewhere.iterdir())
    where.unlink()
    where.write_text("")
    with pytest.raises(ConfigError, match=rf"{where} is not a directory"):
        ServerLock.take("sglang", url, "/ck")
    where.unlink()
    old = os.umask(0o077)
    try:
        lock = ServerLock.take("sglang", url, "/ck")
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(where.stat().st_mode) == 0o1777
        assert lock.path is not None and lock.path.parent == where
    finally:
        lock.release()


def test_a_lock_directory_removed_while_a_receiver_waits_for_it_is_made_anew(
    tmp_path: Path,
) -> None:
    """(attack-98, 26th session) systemd-tmpfiles removes an aged, empty lock directory while
    it holds it exclusively: a receiver that had opened it meanwhile and waited for its shared
    lock got that lock on a directory no longer there, and its lock file could not be made in
    it (FileNotFoundError: the receiver died). It opens the directory again (made anew)."""
    tmpdir = tmp_path / "tmp"
    where = tmpdir / server_lock.DIR_NAME
    where.mkdir(parents=True)
    url = f"http://127.0.0.1:{63000 + os.getpid() % 500}"
    cleanup = os.open(where, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(cleanup, fcntl.LOCK_EX)
        taker = _taker(url, tmpdir, "/ck")
        try:  # (wait until the taker holds the directory open, its shared lock refused)
            while taker.poll() is None and str(where) not in _open_paths(taker.pid):
                time.sleep(0.02)
            assert taker.poll() is None, taker.communicate()
            where.rmdir()
        finally:
            os.close(cleanup)  # (the cleanup done: its lock released)
        out, err = taker.communicate("\n", timeout=120)
    finally:
        if taker.poll() is None:
            taker.kill()
    assert out == "took\n", (out, err)
    assert taker.returncode == 0, err
    assert where.is_dir()


def _open_paths(pid: int) -> set[str]:
    """The paths ``pid``'s open fds name (the ones readable now)."""
    paths = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            paths.add(os.readlink(fd))
    return paths


def test_a_receiver_of_another_uid_starting_as_the_lock_directory_is_made_can_use_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """(attack-98, 26th session) The first receiver made the lock directory with mkdir (mode
    0755 under the usual umask 022, 0700 under 077), then set it 1777: a receiver of another
    uid starting between the two (two services at boot on a fresh /tmp) could not make its
    lock file there, or not even open it, and stopped with a ConfigError. The directory is
    made under another name, set 1777, then moved into place: it appears whole."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a process as another uid")
    tmpdir = Path(tempfile.mkdtemp(prefix="attack98-", dir="/tmp"))
    tmpdir.chmod(0o1777)
    monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))
    base = 60000 + os.getpid() % 500
    outs = _nobody_takes_at_first_fchmod(  # (of root's directory, as made)
        monkeypatch, stat.S_ISDIR, f"http://127.0.0.1:{base + 1}", tmpdir
    )
    try:
        lock = ServerLock.take("sglang", URL(f"http://127.0.0.1:{base}"), "/ck-root")
        lock.release()
        assert outs and outs[0][0] == "took\n", outs
        where = tmpdir / server_lock.DIR_NAME
        assert stat.S_IMODE(where.stat().st_mode) == 0o1777
        assert not [p for p in tmpdir.iterdir() if p.name.startswith(".")]  # (none left)
    finally:
        shutil.rmtree(tmpdir)


def test_a_fifo_in_place_of_the_lock_file_is_refused_not_waited_on() -> None:
    """(attack-98, 26th session) Any uid can make a file in the lock directory (mode 1777), its
    name known from the server's address: a FIFO there, which another uid's receiver may not
    write, was opened read-only, and that open waits for a writer: the receiver hung at its
    engine's open, saying nothing. It is refused in one line, as a directory there is."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a process as another uid")
    tmpdir = Path(tempfile.mkdtemp(prefix="attack98-", dir="/tmp"))
    try:
        tmpdir.chmod(0o1777)
        url = f"http://127.0.0.1:{59000 + os.getpid() % 500}"
        where = tmpdir / server_lock.DIR_NAME
        where.mkdir(mode=0o1777)
        where.chmod(0o1777)
        digest = hashlib.sha256(server_key(URL(url)).encode()).hexdigest()[:24]
        fifo = where / f"server-{digest}.lock"
        os.mkfifo(fifo, 0o644)  # root's: nobody may read it, not write it
        proc = subprocess.run(
            [sys.executable, "-m", "tests.as_user", "65534", "65534", "tests.server_lock_taker",
             url, "/ck-nobody"],
            input="\n", capture_output=True, text=True, cwd=REPO, timeout=120,
            env={**os.environ, "TMPDIR": str(tmpdir)},
        )  # fmt: skip
        assert proc.stdout.startswith(f"error: {fifo} is not a regular file"), proc
        assert "Traceback" not in proc.stderr, proc.stderr
    finally:
        shutil.rmtree(tmpdir)


def test_a_hard_link_in_place_of_the_lock_file_is_refused_not_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(attack-98, 26th session) The lock file is truncated and written (the holder's pid): a
    hard link there to another file (made by any uid in the 1777 directory where
    fs.protected_hardlinks is 0, the kernel's default without systemd) had a receiver
    running as root empty that file and write its pid into it. A lock file with other
    links is refused, never written."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    url = URL(f"http://127.0.0.1:{58000 + os.getpid() % 500}")
    where = tmp_path / server_lock.DIR_NAME
    where.mkdir(mode=0o1777)
    precious = tmp_path / "passwd"
    precious.write_text("root:x:0:0::/root:/bin/sh\n")
    digest = hashlib.sha256(server_key(url).encode()).hexdigest()[:24]
    os.link(precious, where / f"server-{digest}.lock")
    with pytest.raises(ConfigError, match=r"server-.*\.lock has 2 links"):
        ServerLock.take("sglang", url, "/ck")
    assert precious.read_text() == "root:x:0:0::/root:/bin/sh\n"


def test_a_receiver_of_another_uid_starting_as_the_lock_file_is_made_is_not_told_to_remove_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """(attack-98, 26th session) The lock file was made with the umask's mode (0600 under 077)
    and set 0666 a moment later: a receiver of another uid on the same server starting in
    between could not open it and stopped with a ConfigError telling the operator to remove
    it (which lets a third receiver take a server a live one drives). Made 0666 under another
    name, then moved into place, it is one the other receiver opens: it takes or is refused."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a process as another uid")
    tmpdir = Path(tempfile.mkdtemp(prefix="attack98-", dir="/tmp"))
    tmpdir.chmod(0o1777)
    (tmpdir / server_lock.DIR_NAME).mkdir(mode=0o1777)
    (tmpdir / server_lock.DIR_NAME).chmod(0o1777)
    monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))
    url = f"http://127.0.0.1:{57000 + os.getpid() % 500}"
    outs = _nobody_takes_at_first_fchmod(monkeypatch, stat.S_ISREG, url, tmpdir)  # (the file's)
    old = os.umask(0o077)
    try:
        lock = ServerLock.take("sglang", URL(url), "/ck-root")
        lock.release()
        assert outs and outs[0][0].startswith(("took\n", "refused: ")), outs
        assert all(stat.S_IMODE(p.stat().st_mode) == 0o666 for p in tmpdir.rglob("*.lock")), list(
            tmpdir.rglob("*")
        )
        assert not [p for p in tmpdir.rglob(".*")]  # (none left)
    finally:
        os.umask(old)
        shutil.rmtree(tmpdir)


def _nobody_takes_at_first_fchmod(
    monkeypatch: pytest.MonkeyPatch, kind: Callable[[int], bool], url: str, tmpdir: Path
) -> list[tuple[str, str]]:
    """Where this process first sets the mode of a ``kind`` (a directory, a file): made, its
    mode the umask's still, tests/server_lock_taker run under nobody on ``url`` (to its end),
    its stdout and stderr in the list returned."""
    outs: list[tuple[str, str]] = []
    fchmod = os.fchmod

    def nobody_starts_meanwhile(fd: int, mode: int) -> None:
        if not outs and kind(os.fstat(fd).st_mode):
            proc = subprocess.run(
                [sys.executable, "-m", "tests.as_user", "65534", "65534",
                 "tests.server_lock_taker", url, "/ck-nobody"],
                input="\n", capture_output=True, text=True, cwd=REPO, timeout=120,
                env={**os.environ, "TMPDIR": str(tmpdir)},
            )  # fmt: skip
            outs.append((proc.stdout, proc.stderr))
        fchmod(fd, mode)

    monkeypatch.setattr(os, "fchmod", nobody_starts_meanwhile)
    return outs
