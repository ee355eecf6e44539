"""The operator's surface of the command-line tools (attack-42): an interrupted ``--once`` says
so in its exit status; a terminated demo stops its receivers; a secret file of two lines is
refused."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncsync import ConfigError, Publisher
from receiver import cli as receiver_cli
from tests.conftest import mixed_state


async def _interrupted(_args: object) -> int | None:
    raise KeyboardInterrupt  # what asyncio.run raises on a Ctrl-C inside the sync


def test_an_interrupted_once_is_not_a_success(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Ctrl-C (SIGINT) during ``--once`` ended it with status 0 and nothing on stdout or
    stderr: "0: --once done" to a script (``asyncsync-receiver --once && start-engine``),
    while the checkpoint held an older version, a version in flight left to undo. It is status
    130 now, with one line saying the sync was interrupted."""

    async def seed() -> None:
        async with Publisher(tmp_path / "root") as pub:
            await pub.seed(mixed_state(0))

    asyncio.run(seed())
    monkeypatch.setattr(receiver_cli, "_once", _interrupted)
    status = receiver_cli.main(
        ["--root", str(tmp_path / "root"), "--engine-id", "e1",
         "--checkpoint", str(tmp_path / "c"), "--once"]
    )  # fmt: skip
    out, err = capsys.readouterr()
    assert status == 130, (status, out, err)
    assert out == ""
    last = err.strip().splitlines()[-1]  # (earlier lines: the start-up's log, if any)
    assert last.startswith("asyncsync-receiver e1: error: interrupted"), err


REPO = Path(__file__).resolve().parent.parent


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["sigterm", "sighup"])
def test_a_terminated_demo_stops_its_receivers(tmp_path: Path, sig: signal.Signals) -> None:
    """SIGTERM (``timeout``, a CI job cancelled, ``kill``) or SIGHUP (the terminal closed) to
    ``python -m asyncsync.ops.demo`` killed it at once and left its receiver processes running
    for good, polling the root. They are stopped now, as on Ctrl-C: "DEMO FAILED:
    interrupted", status 1."""
    workdir = tmp_path / "demo"
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncsync.ops.demo", "--root", str(workdir),
         "--versions", "1000", "--elements", "100000", "--engines", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    kids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not all((workdir / "shared" / "acks" / f"engine-{i}.json").exists() for i in (0, 1)):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the receivers never acknowledged"
            time.sleep(0.1)
        kids = _children(proc.pid)
        assert len(kids) == 2, kids
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
        deadline = time.monotonic() + 10
        while any(_alive(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [k for k in kids if _alive(k)], "receivers left running"
    finally:
        proc.kill()
        for k in kids:
            if _alive(k):
                os.kill(k, signal.SIGKILL)
    assert proc.returncode == 1, (proc.returncode, out, err)
    assert out.strip().splitlines()[-1] == "DEMO FAILED: interrupted", out
    assert "Traceback" not in err, err


@pytest.mark.parametrize("option", ["--control-token-file", "--api-key-file"])
def test_a_secret_file_of_more_than_one_line_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str
) -> None:
    """A token file of two lines (a comment, ``KEY=value`` pairs, two keys pasted) was taken
    whole, newline included: no Authorization header can carry it, so POST /sync answered
    401 to every request of a receiver that had started without a word, and an API key of two
    lines failed each request to the server with aiohttp's "Forbidden control character
    detected in headers. Potential header injection attack". Refused at start now, naming
    the option and the file; surrounding whitespace is still stripped."""
    secret = tmp_path / "secret"
    secret.write_text("0123456789abcdef0123\n# rotated 2026-12-01\n")
    argv = ["--root", str(tmp_path / "root"), "--engine-id", "e1",
            "--checkpoint", str(tmp_path / "c"), option, str(secret)]  # fmt: skip
    argv += ["--status-port", "0"] if option == "--control-token-file" else [
        "--sglang-url", "http://127.0.0.1:9", "--engine-startup-timeout", "1"]  # fmt: skip
    assert receiver_cli.main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert f"{option} {secret}" in err and "one line" in err, err
    assert not (tmp_path / "c").exists()
    secret.write_text("  0123456789abcdef0123 \n\n")
    assert receiver_cli.read_secret(str(secret), "X", option) == "0123456789abcdef0123"


def test_a_secret_of_more_than_one_line_in_the_environment_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(receiver_cli.TOKEN_ENV, "0123456789abcdef0123\nsecond line")
    with pytest.raises(ConfigError, match=r"\$ASYNCSYNC_RECEIVER_TOKEN must hold the secret"):
        receiver_cli.read_secret(None, receiver_cli.TOKEN_ENV, "--control-token-file")
    monkeypatch.setenv(receiver_cli.TOKEN_ENV, "  0123456789abcdef0123\n")
    assert receiver_cli.read_secret(None, receiver_cli.TOKEN_ENV, "x") == "0123456789abcdef0123"
    monkeypatch.setenv(receiver_cli.TOKEN_ENV, " ")
    assert receiver_cli.read_secret(None, receiver_cli.TOKEN_ENV, "x") is None


def test_an_error_naming_a_path_with_control_characters_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``asyncsync inspect`` (and every command's error) printed the path as it was: a newline
    in it split the "one line on stderr" in two, an escape sequence reached the terminal. They
    are escaped now, as ``printable`` escapes a root's strings in tables; so is the root in
    ``asyncsync status``'s header."""
    from asyncsync.ops.cli import main as asyncsync_main

    weird = tmp_path / "we\nird\x1b[31mRED"
    assert asyncsync_main(["inspect", str(weird)]) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "\x1b" not in err, err
    assert "we\\nird\\x1b[31mRED" in err, err

    async def seed() -> None:
        async with Publisher(weird) as pub:
            await pub.seed(mixed_state(0))

    asyncio.run(seed())
    assert asyncsync_main(["status", str(weird)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("root ") and "\x1b" not in out, out
    assert "we\\nird\\x1b[31mRED: newest version 0" in out.splitlines()[0], out


def test_a_poll_interval_below_the_floor_is_refused_everywhere_it_is_taken(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--poll-interval 0.001`` had no floor: an idle receiver spun ~60-70 % of a core on its
    polls of the root. Below 0.01 s it is refused, naming the option and the floor, wherever a
    poll interval is taken: the receiver's command line, ReceiverAgent, the Ray ReceiverSpec
    and ReceiverFleet.wait_for, ``asyncsync tail -f --interval`` and follow_log."""
    from asyncsync.format.log import follow_log
    from asyncsync.ops.cli import main as asyncsync_main
    from asyncsync.training.ray.base import ReceiverSpec
    from asyncsync.training.ray.receivers import ReceiverFleet
    from asyncsync.training.slime.engines import RayReceivers
    from receiver import ReceiverAgent
    from receiver.engines.checkpoint import LocalCheckpoint

    calls = {
        "poll_interval": lambda v: ReceiverAgent(
            tmp_path, LocalCheckpoint(tmp_path / "c"), "e", poll_interval=v
        ),
        "e0: poll_interval": lambda v: ReceiverSpec("e0", str(tmp_path / "c"), poll_interval=v),
        "ReceiverFleet.wait_for: poll_interval": lambda v: ReceiverFleet(
            str(tmp_path), {}, {}
        ).wait_for(1, poll_interval=v),
        "follow_log: poll_interval": lambda v: follow_log(tmp_path, poll_interval=v),
        # slime's receivers: at construction, not when the engines connect (a Ray actor's error)
        "spec_options: poll_interval": lambda v: RayReceivers(
            str(tmp_path), str(tmp_path / "c"), spec_options={"poll_interval": v}
        ),
    }
    for name, call in calls.items():
        for value in (0.001, 1e-9, 0.0099):
            with pytest.raises(ConfigError, match=f"^{name} must be at least 0.01 seconds"):
                call(value)
    ReceiverAgent(tmp_path, LocalCheckpoint(tmp_path / "c"), "e", poll_interval=0.01)
    ReceiverSpec("e0", str(tmp_path / "c"), poll_interval=0.01)
    # (after the calls: before the fix, the receiver ran)
    argv = ["--root", str(tmp_path / "root"), "--engine-id", "e1",
            "--checkpoint", str(tmp_path / "c"), "--poll-interval", "0.001"]  # fmt: skip
    assert receiver_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "--poll-interval" in err and "at least 0.01" in err and "Traceback" not in err, err
    assert asyncsync_main(["tail", str(tmp_path), "-f", "--interval", "0.001"]) == 2
    err = capsys.readouterr().err
    assert "--interval" in err and "at least 0.01" in err, err


def test_a_size_past_one_pib_is_refused_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Byte sizes had no upper bound: ``prefetch_bytes=10**400`` (and a bucket, a shard, a
    retention size) passed, and a size string of 400 digits was an OverflowError traceback
    from parse_size. Each is at most 1 PiB now, a ConfigError naming it; the command line's
    sizes say so as a usage error."""
    from asyncsync.console.args import parse_size
    from asyncsync.publish.retention import RetentionPolicy
    from asyncsync.training.config import SyncConfig
    from receiver import ReceiverAgent
    from receiver.engines.checkpoint import LocalCheckpoint

    def agent(**kw: object) -> object:
        return ReceiverAgent(tmp_path, LocalCheckpoint(tmp_path / "c"), "e", **kw)  # type: ignore[arg-type]

    def publisher(**kw: object) -> object:
        return Publisher(tmp_path / "root", **kw)  # type: ignore[arg-type]

    calls = {
        "prefetch_bytes": lambda v: agent(prefetch_bytes=v),
        "apply_group_bytes": lambda v: agent(apply_group_bytes=v),
        "bucket_bytes": lambda v: publisher(bucket_bytes=v),
        "delta_shard_bytes": lambda v: publisher(delta_shard_bytes=v),
        "keep_bytes": lambda v: RetentionPolicy(keep_bytes=v),
    }
    for name, call in calls.items():
        for value in (10**400, (1 << 50) + 1):
            with pytest.raises(ConfigError, match=f"^{name} must be at most 1 PiB"):
                call(value)
        call(1 << 50)  # the bound itself is taken
    for name in ("bucket_bytes", "keep_bytes"):
        for value in (10**400, "2PiB", "9" * 400, "1025T"):
            with pytest.raises(ConfigError, match=f"{name}.*at most 1 PiB"):
                SyncConfig(root=tmp_path, **{name: value})
    for text in ("9" * 400, "1025T", "2000000000000000"):
        with pytest.raises(ValueError, match="at most 1 PiB"):
            parse_size(text)
    assert parse_size("1024T") == 1 << 50
    argv = ["--root", str(tmp_path / "root"), "--engine-id", "e1",
            "--checkpoint", str(tmp_path / "c"), "--apply-group-bytes", "9" * 400]  # fmt: skip
    assert receiver_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "--apply-group-bytes" in err and "at most 1 PiB" in err and "Traceback" not in err


def test_the_in_engine_loaders_batch_size_is_bounded_and_its_setting_never_fails_the_load(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``InEngineLoader(batch_bytes=10**400)`` passed, and a bad
    ``$ASYNCSYNC_SGLANG_BATCH_BYTES`` (``abc``, ``64MiB``, 400 digits) failed the engine's model
    load with a bare ValueError or OverflowError from ``int()``. The argument is checked as a
    size (ConfigError naming it); the setting takes sizes as the command lines do, and one that
    is none is a warning naming it, and the default (1 GiB), as the audit's settings are."""
    from receiver.plugins.inplace import ENV_BATCH_BYTES, InEngineLoader

    for value in (10**400, 0, 1.5, True):
        with pytest.raises(ConfigError, match=r"^InEngineLoader: batch_bytes must be"):
            InEngineLoader(object(), batch_bytes=value)  # type: ignore[arg-type]
    monkeypatch.setenv(ENV_BATCH_BYTES, "64MiB")
    assert InEngineLoader(object()).batch_bytes == 64 << 20
    for bad in ("abc", "9" * 400, "0", "2PiB"):
        monkeypatch.setenv(ENV_BATCH_BYTES, bad)
        caplog.clear()
        assert InEngineLoader(object()).batch_bytes == 1 << 30
        assert f"${ENV_BATCH_BYTES}=" in caplog.text and "using 1073741824" in caplog.text


def test_secret_files_with_odd_contents(tmp_path: Path) -> None:
    """(fix-47, a hostile operator's token files) A file saved with a byte order mark (Windows
    editors write one) was refused as "must hold the secret alone, on one line", as was one
    with a NUL, without saying what was wrong: the mark is dropped now, and another character
    no header carries is named (escaped) with its place. A non-ASCII secret was taken, but
    clients encode it differently: POST /sync with the right token answered 401 to urllib
    (Latin-1) and 202/409 to curl and aiohttp (UTF-8); an API key so written reaches SGLang
    (Latin-1) as other bytes. Refused, naming the file; StatusServer refuses such a token."""
    from receiver.server import StatusServer

    f = tmp_path / "secret"
    f.write_bytes(b"\xef\xbb\xbf0123456789abcdef0123\r\n")
    assert receiver_cli.read_secret(str(f), "X", "--control-token-file") == "0123456789abcdef0123"
    f.write_bytes(b"0123\x00456789abcdef0123")
    with pytest.raises(ConfigError, match=r"holds '\\x00' at character 5"):
        receiver_cli.read_secret(str(f), "X", "--control-token-file")
    f.write_text("pässwörd-0123456789", encoding="utf-8")
    with pytest.raises(ConfigError, match=f"--api-key-file {f} holds a non-ASCII character"):
        receiver_cli.read_secret(str(f), "X", "--api-key-file")
    with pytest.raises(ConfigError, match="StatusServer: token must be ASCII"):
        StatusServer(None, token="pässwörd-0123456789")  # type: ignore[arg-type]


def test_a_bad_throttle_env_is_refused_by_every_command_before_it_touches_the_root(
    tmp_path: Path,
) -> None:
    """(attack-72) ASYNCSYNC_THROTTLE=fast was refused by the bench, a Publisher and a receiver
    only: ``inspect``, ``tail``, ``status``, ``gc``, ``verify`` and ``prepare`` ran unthrottled
    without a word, where a throttle was asked for (a typo in a slow-filesystem rehearsal).
    Every command refuses it now, one line naming the variable, exit 1, before it reads the
    root: ``gc`` deletes nothing, ``prepare`` creates nothing, ``status`` makes no probe."""

    async def seed() -> None:
        async with Publisher(tmp_path / "root", keyframe_interval=1) as pub:
            await pub.seed(mixed_state(0))
            for step in (1, 2):
                await pub.publish(mixed_state(step), step=step)

    asyncio.run(seed())
    root = tmp_path / "root"
    before = sorted(p.name for p in root.iterdir()), root.stat().st_mtime_ns
    bad = {**os.environ, "ASYNCSYNC_THROTTLE": "fast"}
    said = "ASYNCSYNC_THROTTLE='fast': cannot parse throttle 'fast'"
    for args in (
        ["inspect", str(root)], ["tail", str(root)], ["status", str(root)],
        ["gc", str(root), "--keep-versions", "1", "--ack-ttl", "0"],
        ["verify", str(root), "--checkpoint", str(tmp_path / "c")],
        ["prepare", str(tmp_path / "new"), "--group", str(os.getgid())],
    ):  # fmt: skip
        done = subprocess.run(
            [sys.executable, "-m", "asyncsync", *args],
            env=bad, capture_output=True, text=True, timeout=120, cwd=REPO,
        )  # fmt: skip
        assert done.returncode == 1, (args, done.returncode, done.stdout, done.stderr)
        assert done.stdout == "", (args, done.stdout)
        assert done.stderr.strip().splitlines() == [
            f"asyncsync {args[0]}: error: {said}: use e.g. '200MB/s,5ms@/root'"
        ], (args, done.stderr)
    assert (sorted(p.name for p in root.iterdir()), root.stat().st_mtime_ns) == before
    assert not (tmp_path / "new").exists()
    good = {**os.environ, "ASYNCSYNC_THROTTLE": "1GB/s,1ms"}  # a good one: the command runs
    done = subprocess.run(
        [sys.executable, "-m", "asyncsync", "inspect", str(root)],
        env=good, capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0 and len(done.stdout.splitlines()) == 4, done


def test_tail_follow_says_a_steady_stream_of_junk_in_a_few_lines_a_minute(
    tmp_path: Path,
) -> None:
    """(attack-72) Junk appended to the log at every poll (30 lines that are no records) and
    junk ack files written at every poll: ``tail -f`` said the cap's 20 notices and an "and N
    more" line at every poll (thousands of lines a minute), and one WARNING per junk ack file,
    uncapped. Now each kind says its first 20 of a minute and one line counting the rest, at
    most once a minute: here (under a minute, or a few) a few dozen lines in all."""
    from asyncsync.format import LOG_NAME
    from asyncsync.format.acks import write_ack
    from asyncsync.format.store import read_manifest

    async def seed() -> None:
        async with Publisher(tmp_path / "root") as pub:
            await pub.seed(mixed_state(0))

    asyncio.run(seed())
    root = tmp_path / "root"
    (root / "acks").mkdir(exist_ok=True)
    started = time.monotonic()
    with open(tmp_path / "stderr", "w") as errors:  # (a pipe not read meanwhile would fill)
        proc = subprocess.Popen(
            [sys.executable, "-m", "asyncsync", "tail", str(root), "-f", "--interval", "0.05"],
            stdout=subprocess.PIPE, stderr=errors, text=True, cwd=REPO,
        )  # fmt: skip
        rounds, junk_lines, junk_acks = 40, 30, 3
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().startswith("v0")  # up and following
            for r in range(rounds):
                with open(root / LOG_NAME, "ab") as f:
                    f.write(b"".join(b"junk %d %d\n" % (r, i) for i in range(junk_lines)))
                for i in range(junk_acks):
                    (root / "acks" / f"junk-{r}-{i}.json").write_text("{not json\n")
                time.sleep(0.1)  # a couple of polls
            m = read_manifest(root, 0)
            write_ack(root, "marker", 0, m.fingerprint, m.run_id)  # said after every junk file
            while "ack engine=marker version=0" not in proc.stdout.readline():
                assert proc.poll() is None, proc.communicate()
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=60)
        finally:
            proc.kill()
    err = (tmp_path / "stderr").read_text()
    minutes = 1 + int((time.monotonic() - started) // 60)
    assert proc.returncode == 0, err
    lines = err.splitlines()
    skipped = [ln for ln in lines if "skipped a line that is not a log record" in ln]
    more = [ln for ln in lines if "more lines skipped" in ln]
    acks = [ln for ln in lines if "ignoring unreadable ack" in ln]
    acks_more = [ln for ln in lines if "more complaints about ack files" in ln]
    assert len(lines) == len(skipped) + len(more) + len(acks) + len(acks_more), lines
    assert "junk 0 0" in skipped[0] and len(skipped) <= 20 * minutes, len(skipped)
    assert 1 <= len(more) <= minutes + 1, more
    assert 20 <= len(acks) <= 20 * minutes and 1 <= len(acks_more) <= minutes + 1, lines
