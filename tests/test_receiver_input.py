"""Bad input to the receiver: hostile sizes and arguments (issue 13, failures 6 and 7).

A size is checked against the file (``fstat``) and sane limits before anything is allocated;
``asyncsync-receiver`` refuses bad arguments up front and prints one line, never a traceback.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from asyncsync import IncompleteVersion, ManifestError, Publisher
from asyncsync.format.manifest import Manifest
from asyncsync.format.store import read_manifest
from asyncsync.fsio import read_bytes
from receiver.cli import build_parser, check_paths
from receiver.cli import main as receiver_main
from receiver.shard_reader import read_verified
from tests.conftest import mixed_state, mutate
from tests.ports import has_ipv6_loopback

REPO = Path(__file__).resolve().parent.parent


async def _root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    async with Publisher(root, bucket_bytes=8192, keyframe_interval=0) as pub:
        sd = mixed_state(0)
        await pub.seed(sd)
        await pub.publish(mutate(sd, 0.03, seed=1))
    return root


def _claim(root: Path, v: int, nbytes: int) -> Path:
    p = root / f"v{v:012d}" / "manifest.json"
    d = json.loads(p.read_text())
    d["shards"][0]["bytes"] = nbytes
    p.write_text(json.dumps(d))
    return p


async def test_a_hostile_shard_size_is_refused_by_validation(tmp_path: Path) -> None:
    root = await _root(tmp_path)
    _claim(root, 1, 1 << 40)
    with pytest.raises(ManifestError, match="bytes"):
        read_manifest(root, 1)


async def test_a_claimed_size_is_checked_against_fstat_before_reading(tmp_path: Path) -> None:
    root = await _root(tmp_path)
    m = read_manifest(root, 1)
    shard = m.shards[0]
    big = Manifest.from_json(m.to_json())  # a valid claim far above the file's size
    claim = type(shard)(shard.file, shard.role, (1 << 40) - 1, shard.checksum)
    path = root / "v000000000001" / shard.file
    tracemalloc.start()
    try:
        with pytest.raises(IncompleteVersion, match="the manifest says"):
            read_verified(path, claim, big.checksum_algorithm, root=root)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    with pytest.raises(ValueError, match="larger than 10 bytes"):
        read_bytes(path, limit=10)  # refused from fstat, nothing read


def _run_receiver(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "receiver.cli", *args],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


async def test_hostile_input_prints_one_line_never_a_traceback(tmp_path: Path) -> None:
    root = await _root(tmp_path)
    _claim(root, 0, 1 << 40)  # the keyframe an empty engine starts from
    r = _run_receiver("--root", str(root), "--engine-id", "e1",
                      "--checkpoint", str(tmp_path / "ck"), "--once")  # fmt: skip
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    errors = [ln for ln in r.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1, r.stderr
    assert "1099511627776" in r.stderr  # the bad version and why are in the log


@pytest.mark.parametrize("port", ["70000", "-5", "http"])
def test_status_port_out_of_range_is_refused_up_front(tmp_path: Path, port: str) -> None:
    argv = ["--root", str(tmp_path), "--engine-id", "e", "--checkpoint", str(tmp_path / "c"),
            "--status-port", port]  # fmt: skip
    assert receiver_main(argv) == 2
    assert not (tmp_path / "c").exists()  # nothing was opened


def test_checkpoint_inside_or_equal_to_the_root_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    for ckpt in (root, root / "ckpt", root / "a" / ".." / "b"):
        assert receiver_main(["--root", str(root), "--engine-id", "e",
                              "--checkpoint", str(ckpt), "--once"]) == 1  # fmt: skip
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "inside --root" in err
    assert sorted(p.name for p in root.iterdir()) == []


@pytest.mark.parametrize("what", ["file", "fifo", "dangling", "below_a_file"])
def test_a_checkpoint_that_is_no_directory_is_refused_up_front(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], what: str
) -> None:
    """``--checkpoint`` naming a file, a FIFO, a symlink to nothing, or a path below a file:
    one line saying so (attack-89). Before: ``FileExistsError: [Errno 17] File exists`` (or
    ``NotADirectoryError``) from the engine's mkdir."""
    root = tmp_path / "root"
    root.mkdir()
    ckpt = tmp_path / "ckpt"
    if what == "file":
        ckpt.write_bytes(b"x")
    elif what == "fifo":
        os.mkfifo(ckpt)
    elif what == "dangling":
        ckpt.symlink_to(tmp_path / "nowhere")
    else:
        (tmp_path / "f").write_bytes(b"x")
        ckpt = tmp_path / "f" / "ckpt"
    argv = ["--root", str(root), "--engine-id", "e", "--checkpoint", str(ckpt), "--once"]
    assert receiver_main(argv) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert f"--checkpoint {ckpt}" in err and "not a directory" in err
    said = {"file": "is a regular file", "fifo": "is a FIFO", "dangling": "a symlink to nothing"}
    assert said.get(what, "is a file, not a directory") in err, err


def test_a_missing_root_is_refused_by_once_and_logged_by_the_daemon(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    missing = tmp_path / "nope"
    argv = ["--root", str(missing), "--engine-id", "e", "--checkpoint", str(tmp_path / "c")]
    check_paths(build_parser().parse_args(argv))  # the daemon waits for it, and says so
    assert any("does not exist (yet); waiting" in r.getMessage() for r in caplog.records)
    assert receiver_main([*argv, "--once"]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_a_directory_that_is_not_a_root_is_refused_before_anything_is_created(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """(issue 20, failure 6) --root pointing at another engine's checkpoint (or any directory
    that no publisher writes) exits 1 saying so; nothing is created in it, nor the checkpoint."""
    other = tmp_path / "other-engine"
    (other / ".asyncsync").mkdir(parents=True)
    (other / "model-00001-of-00001.safetensors").write_bytes(b"\0" * 16)
    (other / "config.json").write_text("{}")
    before = sorted(p.name for p in other.rglob("*"))
    ckpt = tmp_path / "ckpt"
    for extra in (["--once"], []):
        argv = ["--root", str(other), "--engine-id", "e1", "--checkpoint", str(ckpt), *extra]
        assert receiver_main(argv) == 1
        err = capsys.readouterr().err
        assert "is not an asyncsync root" in err and "config.json" in err, err
        assert sorted(p.name for p in other.rglob("*")) == before
        assert not ckpt.exists()
    # an empty directory is a root the publisher has not opened yet: nothing is created in it
    empty = tmp_path / "empty"
    empty.mkdir()
    assert receiver_main(["--root", str(empty), "--engine-id", "e1", "--checkpoint", str(ckpt),
                          "--once"]) == 0  # fmt: skip
    assert "holds no version" in capsys.readouterr().out
    assert list(empty.iterdir()) == []


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory"])
def test_an_asyncsync_json_that_is_no_file_makes_no_root(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    """(an attack) another engine's checkpoint directory with a dangling symlink, a FIFO or a
    directory named ``asyncsync.json`` was taken for a root: the receiver exited 0 and made
    ``leases/`` in it. Only a regular file makes a root; the rest is refused as foreign."""
    import os

    other = tmp_path / "other-engine"
    other.mkdir()
    (other / "config.json").write_text("{}")
    info = other / "asyncsync.json"
    if kind == "symlink":
        info.symlink_to(tmp_path / "nowhere.json")
    elif kind == "fifo":
        os.mkfifo(info)
    else:
        info.mkdir()
    before = sorted(p.name for p in other.iterdir())
    argv = ["--root", str(other), "--engine-id", "e1", "--checkpoint", str(tmp_path / "c")]
    assert receiver_main([*argv, "--once"]) == 1
    assert "is not an asyncsync root" in capsys.readouterr().err
    assert sorted(p.name for p in other.iterdir()) == before


def test_a_root_the_publisher_opens_between_the_two_looks_is_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(CI of 18a8589) the receiver found no ``asyncsync.json``, the publisher wrote it, and the
    listing that followed showed it: the root was refused as "some other directory" that holds
    ``asyncsync.json``. The lookup is made again after the listing."""
    import os

    from asyncsync.format.store import ensure_root_info
    from receiver.acking import check_root_for_receiver

    root = tmp_path / "root"
    root.mkdir()
    real_listdir = os.listdir
    opened: list[Path] = []

    def publisher_opens_then_list(path: object = ".") -> list[str]:
        if path == root and not opened:  # the root was looked up: the publisher opens it now
            opened.append(root)
            ensure_root_info(root)
        return real_listdir(path)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "listdir", publisher_opens_then_list)
    assert check_root_for_receiver(root) is True
    assert opened == [root]


def test_usage_is_checked_before_the_engine_is_opened(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    root = tmp_path / "root"
    root.mkdir()
    ckpt = tmp_path / "ckpt"
    base = ["--root", str(root), "--engine-id", "e1", "--checkpoint", str(ckpt)]
    # --status-port with --once: a usage error, not ignored
    assert receiver_main([*base, "--once", "--status-port", "0"]) == 2
    assert "--once" in capsys.readouterr().err
    # a short control token: refused before the engine is opened
    monkeypatch.setenv("ASYNCSYNC_RECEIVER_TOKEN", "short")
    assert receiver_main([*base, "--status-port", "0"]) == 1
    assert "at least 16 characters" in capsys.readouterr().err
    assert not ckpt.exists()
    monkeypatch.delenv("ASYNCSYNC_RECEIVER_TOKEN")
    # a status port in use: refused before the engine is opened
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert receiver_main([*base, "--status-port", str(port)]) == 1
    assert f"--status-port {port}" in capsys.readouterr().err
    assert not ckpt.exists()
    # sizes as SyncConfig takes them; errors as JSON with --log-format json
    assert (
        build_parser().parse_args([*base, "--apply-group-bytes", "1MiB"]).apply_group_bytes
        == 1 << 20
    )
    assert receiver_main([*base, "--log-format", "json", "--apply-group-bytes", "lots"]) == 2
    doc = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert doc["level"] == "ERROR" and "lots" in doc["msg"]
    assert receiver_main([*base, "--log-format", "json", "--status-port", "1",
                          "--status-host", "256.0.0.1"]) == 1  # fmt: skip
    doc = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert doc["level"] == "ERROR" and "asyncsync-receiver e1" in doc["logger"]
    # a --status-host that is no address of this host, with --status-port 0 too: one line
    # naming the option, before the engine is opened (it was "[Errno -2] Name or service not
    # known" or asyncio's bind error once the engine was open, with port 0 not checked at all)
    ipv6 = [("fe80::1", "needs its scope")] if has_ipv6_loopback() else []
    for host, why in [("no.such.host.invalid", "Name or service not known"),
                      ("a..b", "idna"), ("192.0.2.1", "not an address this host can serve"),
                      *ipv6]:  # fmt: skip
        for port in ("0", "1"):
            assert receiver_main([*base, "--status-port", port, "--status-host", host]) == 1
            err = capsys.readouterr().err
            assert f"--status-host {host!r}" in err and why in err, err
            assert not ckpt.exists()


@pytest.mark.parametrize(
    ("option", "kind"),
    [
        ("--control-token-file", "fifo"),
        ("--api-key-file", "fifo"),
        ("--admin-api-key-file", "fifo"),
        ("--control-token-file", "/dev/zero"),
        ("--control-token-file", "not-utf8"),
        ("--api-key-file", "too-big"),
    ],
)
def test_a_secret_file_is_a_small_regular_utf8_file(tmp_path: Path, option: str, kind: str) -> None:
    """(an attack) a secret file was read blocking and without limit: a FIFO with no writer hung
    the receiver's start-up, ``/dev/zero`` grew it by gigabytes, and a non-UTF-8 file gave a
    decode error naming neither the option nor the file. Now: one line naming both, at once."""
    import os
    import resource

    (tmp_path / "root").mkdir()
    path = tmp_path / "secret"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "/dev/zero":
        path = Path("/dev/zero")
    elif kind == "not-utf8":
        path.write_bytes(b"\xff\xfe" + b"garbage" * 4)
    else:
        path.write_bytes(b"k" * (65 << 10))
    argv = ["--root", str(tmp_path / "root"), "--engine-id", "e1",
            "--checkpoint", str(tmp_path / "c"), option, str(path)]  # fmt: skip
    if option != "--control-token-file":  # read when the engine is made: --once is enough
        argv += ["--once", "--sglang-url", "http://127.0.0.1:1"]
    limit = 4 << 30  # before the fix /dev/zero was read until memory ran out: bound it here
    out = subprocess.run(
        [sys.executable, "-m", "receiver.cli", *argv],
        capture_output=True, text=True, timeout=60, cwd=REPO,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_DATA, (limit, limit)),
    )  # fmt: skip
    assert out.returncode == 1, out.stderr
    err = out.stderr.strip().splitlines()[-1]
    assert "Traceback" not in out.stderr and f"{option} {path}" in err, err
    needle = {"not-utf8": "not UTF-8", "too-big": "larger than 64 KiB"}.get(kind, "regular file")
    assert needle in err, err
    assert not (tmp_path / "c").exists()


def test_verify_deadline_is_a_flag_that_reaches_the_agent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``verify_deadline`` (how long a damaged or incomplete shard is re-read before its
    version is refused) had no flag: a receiver on a slow mount could not raise it."""
    import asyncio

    import receiver.cli
    from receiver.agent import VERIFY_DEADLINE, ReceiverAgent

    root = asyncio.run(_root(tmp_path))
    base = ["--root", str(root), "--engine-id", "e1", "--checkpoint", str(tmp_path / "ckpt")]
    parser = build_parser()
    assert parser.parse_args(base).verify_deadline == VERIFY_DEADLINE
    assert parser.parse_args([*base, "--verify-deadline", "0"]).verify_deadline == 0.0
    assert "--verify-deadline" in parser.format_help()
    for bad in ("-1", "nan", "inf", "1e300", "soon"):
        assert receiver_main([*base, "--once", "--verify-deadline", bad]) == 2
        assert "--verify-deadline" in capsys.readouterr().err
    made: list[ReceiverAgent] = []

    class Recorded(ReceiverAgent):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            made.append(self)

    monkeypatch.setattr(receiver.cli, "ReceiverAgent", Recorded)
    assert receiver_main([*base, "--once", "--verify-deadline", "2.5"]) == 0
    assert [a.verify_deadline for a in made] == [2.5]
    assert made[0]._bad.verify_deadline == 2.5  # what the re-reads wait on


@pytest.mark.parametrize("what", ["a FIFO", "a regular file"])
@pytest.mark.parametrize("sub", ["journal", "staging", "redo"])
async def test_a_state_subdirectory_that_is_no_directory_is_named_with_the_fix(
    tmp_path: Path, sub: str, what: str
) -> None:
    """Something else in place of the checkpoint's ``.asyncsync/journal`` or ``staging``: one
    line naming it and what to do (as for a symlink there). Before: ``FileExistsError: [Errno
    17] File exists`` (``redo/``: with a redo log)."""
    root = await _root(tmp_path)
    ck = tmp_path / "ck"
    args = ("--root", str(root), "--engine-id", "e1", "--checkpoint", str(ck), "--once")
    if sub == "redo":
        args += ("--checkpoint-redo-log", "2")
    assert _run_receiver(*args).returncode == 0
    path = ck / ".asyncsync" / sub
    shutil.rmtree(path)  # (journal/ holds the spare undo records of the version applied)
    if what == "a FIFO":
        os.mkfifo(path)
    else:
        path.write_bytes(b"x")
    r = _run_receiver(*args)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    errors = [ln for ln in r.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1, r.stderr
    assert f"{path} is {what}, not the engine's own directory" in errors[0]
    assert "remove it" in errors[0]


def test_a_redo_symlink_is_never_followed_without_a_redo_log(tmp_path: Path) -> None:
    """``.asyncsync/redo`` a symlink to another directory (moved to a bigger disk by hand) and
    the receiver run without ``--checkpoint-redo-log``: refused by name, as with a redo log,
    and the directory it points to is left alone. Before, its open followed the link and
    removed every file there as a redo record no state names."""
    root = asyncio.run(_root(tmp_path))
    ck, elsewhere = tmp_path / "ck", tmp_path / "elsewhere"
    args = ("--root", str(root), "--engine-id", "e1", "--checkpoint", str(ck), "--once")
    assert _run_receiver(*args, "--checkpoint-redo-log", "2").returncode == 0
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_bytes(b"not the receiver's")
    redo = ck / ".asyncsync" / "redo"
    redo.rmdir()
    redo.symlink_to(elsewhere)
    r = _run_receiver(*args)
    assert (elsewhere / "keep.txt").read_bytes() == b"not the receiver's"
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"{redo} is a symlink, not the engine's own directory" in r.stderr
