"""The operator CLI (``asyncsync``) and the receiver CLI (``asyncsync-receiver``), against roots a
real Publisher wrote: output, exit codes, and clean one-line errors."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncsync import Manifest, Publisher
from asyncsync.format.acks import read_acks
from asyncsync.ops.cli import human_bytes, main
from asyncsync.ops.workload import Workload, WorkloadConfig
from receiver import ReceiverAgent
from receiver.cli import main as receiver_main
from receiver.engines.checkpoint import LocalCheckpoint
from tests.conftest import mixed_state, mutate

REPO = Path(__file__).resolve().parent.parent
FLIPPED = "model.layers.0.self_attn.q_proj.weight"


async def _publish(root: Path) -> None:
    wl = Workload(WorkloadConfig(layers=1, hidden=32, vocab=64, seed=3))
    async with Publisher(root) as pub:
        await pub.seed(wl.state_dict())  # v0
        for _ in range(2):  # v1, v2
            wl.step()
            await pub.publish(wl.state_dict())
        await pub.publish(wl.state_dict())  # v3: zero diff


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    r = tmp_path_factory.mktemp("cli") / "root"
    asyncio.run(_publish(r))
    return r


async def _sync(root: Path, ckpt: Path, engine_id: str) -> int | None:
    async with ReceiverAgent(root, LocalCheckpoint(ckpt), engine_id, use_inotify=False) as agent:
        return await agent.sync_once()


@pytest.fixture
def checkpoint(root: Path, tmp_path: Path) -> Path:
    ckpt = tmp_path / "ckpt"
    assert asyncio.run(_sync(root, ckpt, f"cli-{tmp_path.name}"[:100])) == 3
    return ckpt


def _flip_byte(ckpt: Path, name: str) -> None:
    """Flip one byte of tensor ``name`` in place, in its safetensors file."""
    weight_map = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    path = ckpt / weight_map[name]
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        begin = json.loads(f.read(n))[name]["data_offsets"][0]
        f.seek(8 + n + begin + 1)
        b = f.read(1)
        f.seek(8 + n + begin + 1)
        f.write(bytes([b[0] ^ 0x01]))


# --------------------------------------------------------------------------- inspect


def test_inspect_table(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(root)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split() == [
        "version", "kind", "base", "changed", "density", "wire", "shards", "committed",
    ]  # fmt: skip
    assert len(lines) == 5
    assert lines[1].split()[:3] == ["0", "full", "-"]
    assert lines[4].split()[:5] == ["3", "delta", "2", "0", "0.000%"]


def test_inspect_json_lists_every_version(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(root), "--json"]) == 0
    summaries = json.loads(capsys.readouterr().out)
    assert [s["version"] for s in summaries] == [0, 1, 2, 3]
    assert summaries[3]["changed"] == 0 and summaries[1]["changed"] > 0


def test_inspect_version(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(root), "1"]) == 0
    out = capsys.readouterr().out
    assert "version      1 (delta, base 0)" in out
    assert "smaller than the full model" in out
    row = next(line for line in out.splitlines() if line.startswith("lm_head.weight "))
    _name, dtype, shape, changed, mode, shard = row.split()
    assert (dtype, shape, mode, shard) == ("bfloat16", "64x32", "sparse", "delta-00000.safetensors")
    assert int(changed) > 0
    assert "model.global_step" in out and "int64" in out


def test_inspect_lists_the_others_when_one_manifest_is_damaged(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A manifest with no log line that does not parse: that version is listed as bad, the
    others as before (the whole listing failed with exit 1)."""
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    (copy / "v000000000004").mkdir()
    (copy / "v000000000004" / "manifest.json").write_text('{"trunc')
    assert main(["inspect", str(copy)]) == 0
    rows = capsys.readouterr().out.splitlines()[1:]
    assert [r.split()[:2] for r in rows] == [
        ["0", "full"], ["1", "delta"], ["2", "delta"], ["3", "delta"], ["4", "bad"]
    ]  # fmt: skip
    assert main(["inspect", str(copy), "--json"]) == 0
    last = json.loads(capsys.readouterr().out)[-1]
    assert last["kind"] == "bad" and "not valid JSON" in last["error"]


def test_inspect_version_json_is_the_manifest(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(root), "latest", "--json"]) == 0
    m = Manifest.from_json(capsys.readouterr().out)
    assert m.version == 3 and m.totals.changed == 0


def test_tail_prints_one_line_per_version(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tail", str(root)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split()[0] for line in lines] == ["v0", "v1", "v2", "v3"]
    assert "density=0.000%" in lines[3] and "wire=0 B" in lines[3]


def test_tail_follow_prints_new_acks_and_exits_0_on_ctrl_c(root: Path, tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncsync", "tail", str(root), "-f", "--interval", "0.1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        lines.append(proc.stdout.readline())  # the first log line: it is up and following
        asyncio.run(_sync(root, tmp_path / "ckpt", "tail-follower"))
        while "ack engine=tail-follower version=3" not in lines[-1]:
            line = proc.stdout.readline()
            assert line, "tail -f ended early"
            lines.append(line)
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=30)
        out = "".join(lines) + rest
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert out.splitlines()[0].startswith("v0")
    assert "ack engine=tail-follower version=3" in out
    assert "Traceback" not in err


def test_tail_follow_ends_with_one_line_when_the_root_becomes_a_file(
    root: Path, tmp_path: Path
) -> None:
    """The follower's error leaves its TaskGroup as an ExceptionGroup: the CLI reports the
    error inside it in one line (it printed the group's traceback)."""
    moved = tmp_path / "copy"
    shutil.copytree(root, moved)
    with subprocess.Popen(
        [sys.executable, "-m", "asyncsync", "tail", str(moved), "-f", "--interval", "0.05"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
    ) as proc:  # fmt: skip
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline()  # a first line: it is up and following
            shutil.rmtree(moved)
            moved.write_text("not a directory\n")
            _, err = proc.communicate(timeout=30)
        finally:
            proc.kill()
    assert proc.returncode == 1, err
    assert "Traceback" not in err and "Not a directory" in err, err
    errors = [ln for ln in err.splitlines() if "WARNING" not in ln]  # the acks' warning may come
    assert len(errors) == 1 and errors[0].startswith("asyncsync tail: error:"), err


def test_a_log_over_the_limit_is_one_line_for_tail_and_skipped_by_inspect(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A log.jsonl over 256 MiB (sparse here): `tail` says so in one line and exits 1, `inspect`
    lists the versions from their manifests after one line (both printed a traceback)."""
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    os.truncate(copy / "log.jsonl", 300_000_000)
    assert main(["tail", str(copy)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("asyncsync tail: error:"), err
    assert f"{copy / 'log.jsonl'} is larger than 268435456 bytes" in err, err
    assert main(["inspect", str(copy)]) == 0
    out, err = capsys.readouterr()
    assert [line.split()[0] for line in out.splitlines()[1:]] == ["0", "1", "2", "3"], out
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("asyncsync inspect: skipped the log:") and "268435456" in err, err


@pytest.mark.parametrize("damage", ["fifo", "directory", "symlink", "unreadable"])
def test_a_log_that_cannot_be_read_is_skipped_by_inspect(
    root: Path, shared_tmp: Path, damage: str
) -> None:
    """Found by attack (forty-third session): a log.jsonl that is a FIFO, a directory or a
    symlink, or that the operator may not read, made `asyncsync inspect ROOT` fail as a whole
    (exit 1) although every manifest reads, while a log too large to read was skipped: each
    is now skipped with one line, and the versions listed from their manifests (a real
    process; "unreadable" as nobody)."""
    copy = shared_tmp / "copy"
    shutil.copytree(root, copy)
    log = copy / "log.jsonl"
    if damage != "unreadable":
        log.unlink()
    if damage == "fifo":
        os.mkfifo(log)
    elif damage == "directory":
        log.mkdir()
    elif damage == "symlink":
        log.symlink_to("/dev/zero")
    else:
        log.chmod(0)
    head = [sys.executable, "-m", "tests.as_user", "65534", "65534", "asyncsync.ops.cli"]
    r = subprocess.run(
        [*head, "inspect", str(copy)], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert [line.split()[0] for line in r.stdout.splitlines()[1:]] == ["0", "1", "2", "3"]
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("asyncsync inspect: skipped the log: "), err
    assert str(log) in err[0], err


def test_a_root_part_this_user_may_not_read_is_said_with_the_uid(
    root: Path, shared_tmp: Path
) -> None:
    """Found by attack (forty-third session): `asyncsync status ROOT` run by a user who may not
    read the root's ``acks/`` said only "[Errno 13] Permission denied: 'R/acks'"; the one line
    names the uid and what to do now (a real process, as nobody)."""
    copy = shared_tmp / "copy"
    shutil.copytree(root, copy)
    (copy / "acks").mkdir(exist_ok=True)
    (copy / "acks").chmod(0o700)
    head = [sys.executable, "-m", "tests.as_user", "65534", "65534", "asyncsync.ops.cli"]
    r = subprocess.run(
        [*head, "status", str(copy)], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 1, r.stdout + r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("asyncsync status: "), err
    assert (
        "Permission denied" in err[0]
        and "not allowed to uid 65534; run as a user who may read it" in err[0]
    ), err


def test_tail_and_inspect_escape_control_characters_from_the_root(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A log line's strings reach the terminal escaped (`tail` printed a forged line's escape
    sequences raw: a colour, a cleared screen, a forged line)."""
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    with open(copy / "log.jsonl", "a") as f:
        f.write(json.dumps({"version": 3, "kind": "\x1b[2J\x1b[31mRED\nv9  fake\u2028\x9b"}) + "\n")
    for cmd in ("tail", "inspect"):
        assert main([cmd, str(copy)]) == 0
        out = capsys.readouterr().out
        assert "\x1b" not in out and "\u2028" not in out and "\x9b" not in out, out
        assert "\\x1b[2J\\x1b[31mRED\\nv9  fake\\u2028\\x9b" in out, out
        assert not any(line.startswith("v9") for line in out.splitlines()), out


def test_tail_says_when_it_skips_a_line_that_is_no_record_as_tail_f_does(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """(helper-26) `tail` without -f dropped a line that is no record (invalid JSON) without a
    word, while `tail -f` says so: the same one line now, on stderr, the line's start escaped.
    An unfinished last line (an append under way) is not one: -f waits for its newline."""
    from asyncsync.format.log import follow_log

    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    with open(copy / "log.jsonl", "ab") as f:
        f.write(b'{"version": 5, "kind": "d\x1b[31mRED"}\n{"version": 4}\n{"version": 6, "ki')
    assert main(["tail", str(copy)]) == 0
    out, err = capsys.readouterr()
    assert [line.split()[0] for line in out.splitlines()] == ["v0", "v1", "v2", "v3", "v4"], out
    assert err.splitlines() == [
        "asyncsync tail: log.jsonl: skipped a line that is not a log record: "
        'b\'{"version": 5, "kind": "d\\x1b[31mRED"}\''
    ], err

    async def follow() -> list[str]:
        notices: list[str] = []
        async for rec in follow_log(copy, poll_interval=0.01, notice=notices.append):
            if rec["version"] == 4:
                return notices
        raise AssertionError("unreachable")

    assert [f"asyncsync tail: {n}" for n in asyncio.run(follow())] == err.splitlines()


# --------------------------------------------------------------------------- verify


def test_verify_ok(root: Path, checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(root), "--checkpoint", str(checkpoint)]) == 0
    out = capsys.readouterr().out.strip()
    assert out == f"OK: {checkpoint} is bit-exact at version 3 (16 tensors)"


def test_verify_flipped_byte_names_the_tensor(
    root: Path, checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _flip_byte(checkpoint, FLIPPED)
    assert main(["verify", str(root), "--checkpoint", str(checkpoint)]) == 1
    out = capsys.readouterr().out
    assert "MISMATCH" in out and "1 of 16 tensors" in out
    assert f"  {FLIPPED}" in out.splitlines()


def test_verify_against_an_older_version_lists_the_changed_tensors(
    root: Path, checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", str(root), "--checkpoint", str(checkpoint), "--version", "0"]) == 1
    out = capsys.readouterr().out
    assert "lm_head.weight" in out and "model.global_step" in out
    assert main(["verify", str(root), "--checkpoint", str(checkpoint), "--version", "2"]) == 0


@pytest.mark.parametrize("receiver", ["killed", "running"])
def test_verify_of_an_apply_its_receiver_left_says_it_is_undone_at_the_next_open(
    checkpoint: Path, root: Path, receiver: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A checkpoint whose receiver was killed mid-apply (its state ``applying``, no process
    holding its lock: found by attack, SIGKILL of a real receiver): verify said "stop its
    receiver for a stable answer" (it was stopped) and MISMATCH, as if the files were
    damaged. It now says the apply was interrupted and is rolled back at the next open; while
    a receiver holds the lock, what it said before."""
    from receiver.state import STATE_DIR_NAME, StateStore

    store = StateStore(checkpoint / STATE_DIR_NAME)
    ps = store.open()
    assert ps is not None and ps.version == 3
    store.save(ps.begin(4, "delta"))
    if receiver == "killed":
        store.close()  # (as a SIGKILL does: the kernel drops the flock)
    _flip_byte(checkpoint, FLIPPED)  # a position of v4 already written
    try:
        assert main(["verify", str(root), "--checkpoint", str(checkpoint)]) == 1
    finally:
        store.close()
    out, err = capsys.readouterr()
    assert "MISMATCH" in out and "1 of 16 tensors" in out
    said = "its apply of v4 was interrupted (no receiver holds it)"
    if receiver == "killed":
        assert said in out and "rolls them back to v3" in out, out
        assert "stop its receiver" not in err, err
    else:
        assert said not in out + err and "stop its receiver for a stable answer" in err, err


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["inspect"],
        ["bogus"],
        ["verify", "ROOT"],  # no --checkpoint
        ["tail", "ROOT", "--interval", "0"],
        ["verify", "ROOT", "--checkpoint", "X", "--version", "-1"],
        ["inspect", "ROOT", "one"],  # (issue 20) a VERSION that is no number is bad usage
    ],
)
def test_bad_usage_exits_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert "usage:" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["inspect", "{missing}"], "is not a directory"),
        (["inspect", "{empty}"], "is not an asyncsync root"),
        (["inspect", "{root}", "9"], "version 9 is not committed"),
        (["verify", "{root}", "--checkpoint", "{missing}"], "does not exist"),
        (["verify", "{root}", "--checkpoint", "{empty}"], "is not an asyncsync checkpoint"),
        (["verify", "{root}", "--checkpoint", "{empty}", "--version", "7"], "not an asyncsync"),
    ],
)
def test_errors_are_one_line_without_traceback(
    argv: list[str], needle: str, root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty").mkdir()
    paths = {"root": root, "missing": tmp_path / "missing", "empty": tmp_path / "empty"}
    assert main([a.format(**paths) for a in argv]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"asyncsync {argv[0]}: error:") and needle in err, err


@pytest.mark.parametrize(
    "name", ["model.safetensors.index.json", "model-00001-of-00001.safetensors"]
)
def test_a_fifo_in_the_checkpoint_is_refused_without_hanging(
    root: Path, checkpoint: Path, name: str
) -> None:
    """(an attack) a FIFO named like the index or a data file made ``asyncsync verify`` and
    ``asyncsync-receiver --once`` block for ever in open(); now one line names it, at once."""
    fifo = checkpoint / name
    assert fifo.is_file()
    fifo.unlink()
    os.mkfifo(fifo)
    runs = [
        [sys.executable, "-m", "asyncsync", "verify", str(root), "--checkpoint", str(checkpoint)],
        [sys.executable, "-m", "receiver.cli", "--root", str(root), "--engine-id", "rx-fifo",
         "--checkpoint", str(checkpoint), "--once", "--force-polling"],
    ]  # fmt: skip
    for argv in runs:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=REPO)
        assert out.returncode == 1, out.stderr
        err = out.stderr.strip().splitlines()
        assert len(err) == 1 and f"{fifo} is a FIFO, not a regular file" in err[0], err


def test_a_deeply_nested_index_is_a_one_line_error(
    root: Path, checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """(an attack) ``read_index`` caught OSError and ValueError only: a deeply nested JSON
    index ended ``asyncsync verify`` in a RecursionError traceback."""
    (checkpoint / "model.safetensors.index.json").write_text("[" * 100_000 + "]" * 100_000)
    assert main(["verify", str(root), "--checkpoint", str(checkpoint)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nested too deeply" in err, err


@pytest.mark.parametrize("damage", ["trailing", "gap"])
def test_verify_refuses_a_data_file_safetensors_would_not_load(
    root: Path, checkpoint: Path, damage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """(attack-60) bytes past a data file's last tensor, or a hole between two tensors, make
    safetensors (the engine's loader) refuse the file, while ``asyncsync verify`` said the
    checkpoint was bit-exact (exit 0); it is now one line naming the file (exit 1)."""
    from safetensors import SafetensorError, safe_open

    data = checkpoint / "model-00001-of-00001.safetensors"
    if damage == "trailing":
        with open(data, "ab") as f:
            f.write(b"JUNK")
    else:  # the last tensor's bytes moved 8 bytes on: a hole of 8 bytes before them
        raw = data.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
        last = max((k for k in header if k != "__metadata__"),
                   key=lambda k: header[k]["data_offsets"][0])  # fmt: skip
        lo, hi = header[last]["data_offsets"]
        header[last]["data_offsets"] = [lo + 8, hi + 8]
        head = json.dumps(header, separators=(",", ":")).encode().ljust(n)  # spaces: allowed
        assert len(head) == n
        data.write_bytes(raw[:8] + head + raw[8 + n : 8 + n + lo] + bytes(8) + raw[8 + n + lo :])
    with pytest.raises(SafetensorError), safe_open(str(data), "pt"):
        pass
    assert main(["verify", str(root), "--checkpoint", str(checkpoint)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("asyncsync verify: error:"), err
    assert f"{data}:" in err and "not covered" in err, err


def test_human_bytes() -> None:
    assert human_bytes(0) == "0 B"
    assert human_bytes(1023) == "1023 B"
    assert human_bytes(1536) == "1.5 KiB"
    assert human_bytes(5 << 30) == "5.0 GiB"


# --------------------------------------------------------------------------- receiver CLI


def test_receiver_once_applies_and_the_checkpoint_verifies(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "engine"
    out = subprocess.run(
        [sys.executable, "-m", "receiver.cli", "--root", str(root), "--engine-id", "rx-once",
         "--checkpoint", str(ckpt), "--once", "--force-polling", "--log-level", "WARNING",
         "--apply-group-bytes", "4096"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "rx-once: holds version 3"
    state = json.loads((ckpt / ".asyncsync" / "state.json").read_text())
    assert state.get("synced", True) is True  # flushed before the process exited
    assert main(["verify", str(root), "--checkpoint", str(ckpt)]) == 0
    assert "bit-exact at version 3" in capsys.readouterr().out
    acks = json.loads((root / "acks" / "rx-once.json").read_text())
    assert acks["version"] == 3


def _ignore_sighup() -> None:  # as nohup starts a process
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


@pytest.mark.parametrize("how", ["sigint", "sighup", "sighup-under-nohup"])
def test_receiver_runs_until_sigint_and_exits_0(root: Path, tmp_path: Path, how: str) -> None:
    """Ctrl-C stops it after the version in flight, status 0. So does SIGHUP (attack-42: the
    terminal closed, or a supervisor's hang-up, killed it mid-version: status 129, the version
    undone at the next start), except where it is ignored (``nohup``): it is left ignored."""
    ckpt, engine_id = tmp_path / "engine", f"rx-run-{how}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "receiver.cli", "--root", str(root), "--engine-id", engine_id,
         "--checkpoint", str(ckpt), "--poll-interval", "0.1", "--sync-before-ack"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        preexec_fn=_ignore_sighup if how == "sighup-under-nohup" else None,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        # the catch-up done (a stop ends it after the version in flight)
        while getattr(read_acks(root).get(engine_id), "version", None) != 3:
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "the receiver never acknowledged"
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT if how == "sigint" else signal.SIGHUP)
        if how == "sighup-under-nohup":
            time.sleep(1.0)
            assert proc.poll() is None  # ignored, as nohup asked
            proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    assert "stopped at version 3" in err


_SECOND_SIGNAL = """
import signal, sys
from receiver.entry import main
status = main()
signal.raise_signal(signal.{sig})  # a second one, landing while the process exits
print("exiting", flush=True)
sys.exit(status)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_a_second_stop_signal_while_the_receiver_stops_is_ignored(
    root: Path, tmp_path: Path, sig: signal.Signals
) -> None:
    """(helper-26) The first Ctrl-C stops the running receiver cleanly (status 0); a second
    one that landed after its signal handlers were removed (the loop's and the interpreter's
    teardown, ~0.1 s) raised KeyboardInterrupt there: status 130, maybe a traceback. It is
    ignored now until the process has exited, as one during the shutdown itself is. So is a
    second SIGTERM (a supervisor sending it twice), which ended the process there: 143."""
    engine_id = f"rx-2nd-{sig.name.lower()}"
    proc = subprocess.Popen(
        [sys.executable, "-c", _SECOND_SIGNAL.format(sig=sig.name), "--root", str(root),
         "--engine-id", engine_id, "--checkpoint", str(tmp_path / "engine"),
         "--poll-interval", "0.1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while getattr(read_acks(root).get(engine_id), "version", None) != 3:
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "the receiver never acknowledged"
            time.sleep(0.1)
        proc.send_signal(sig)
        time.sleep(0.05)
        proc.send_signal(sig)  # during the shutdown, or as it exits
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, (proc.returncode, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "stopped at version 3" in err and out == "exiting\n", (out, err)


def test_a_ctrl_c_while_the_receiver_starts_is_quiet(tmp_path: Path) -> None:
    """The console script (``receiver.entry:main``) stopped by SIGINT at moments inside its
    imports (torch: a second or more) and right after: no traceback, status 0. It printed
    the import's KeyboardInterrupt traceback."""
    root = tmp_path / "root"
    root.mkdir()
    # the delays count from the interpreter's start-up done (a marker line): a SIGINT before
    # Python has imported its site module is CPython's "Fatal Python error: init_import_site"
    # with a traceback, no code of ours yet (seen on a loaded host: `python -c pass` took 0.26 s)
    script = "import sys; print(flush=True); from receiver.entry import main; sys.exit(main())"
    for delay in (0.15, 0.3, 0.5, 0.8):
        proc = subprocess.Popen(
            [sys.executable, "-c", script, "--root", str(root), "--engine-id", "e1",
             "--checkpoint", str(tmp_path / "ckpt")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        )  # fmt: skip
        try:
            assert proc.stdout is not None and proc.stdout.readline() == "\n"  # the marker
            time.sleep(delay)
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
        assert "Traceback" not in err, (delay, err)
        assert proc.returncode in (0, -signal.SIGINT), (delay, proc.returncode, err)


_GATED_START = """
import importlib.abc, sys
GATE = sys.argv.pop(1)


def wait(where):  # the test sends its signal now, then lets the start-up go on
    print(where, flush=True)
    sys.stdin.readline()


class Gate(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == GATE:
            sys.meta_path.remove(self)
            wait("importing " + name)
        return None


def listing(event, args):  # the first listing of the root: its check, before the handlers
    if event in ("os.listdir", "os.scandir") and args and str(args[0]) == ROOT and GATE:
        globals()["GATE"] = None
        wait("checking the root")


ROOT = sys.argv[sys.argv.index("--root") + 1]
if GATE == "check_paths":  # after the imports (the console script's own)
    sys.addaudithook(listing)
else:
    sys.meta_path.insert(0, Gate())
from receiver.entry import main
sys.exit(main())
"""


@pytest.mark.parametrize(
    ("sig", "gate", "once"),
    [
        (signal.SIGTERM, "torch", False),  # inside the imports
        (signal.SIGHUP, "torch", False),
        (signal.SIGTERM, "receiver.cli_start", False),  # their end
        (signal.SIGTERM, "check_paths", False),  # imported, the handlers not installed yet
        (signal.SIGINT, "check_paths", False),
        (signal.SIGINT, "torch", True),
    ],
    ids=["sigterm-torch", "sighup-torch", "sigterm-last-import", "sigterm-checks",
         "sigint-checks", "sigint-torch-once"],
)  # fmt: skip
def test_a_stop_signal_while_the_receiver_starts_stops_it_as_after_start_up(
    tmp_path: Path, sig: signal.Signals, gate: str, once: bool
) -> None:
    """(attack-76) A SIGTERM or SIGHUP while the console script imported its modules killed it
    silently: status 143 or 129 (a supervisor stopping a receiver just started read a crash).
    A Ctrl-C after the imports, before the handlers, exited 0 without a word, and a Ctrl-C
    during the imports of ``--once`` exited 0 as if every version were applied. The signal is
    held now until the handlers are installed: one line, status 0 (``--once``: 130), as a stop
    after start-up; nothing is opened."""
    root = tmp_path / "root"
    root.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", _GATED_START, gate, "--root", str(root), "--engine-id", "e1",
         "--checkpoint", str(tmp_path / "ckpt"), *(["--once"] if once else [])],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=REPO,
    )  # fmt: skip
    try:
        assert proc.stdin is not None and proc.stdout is not None
        marker = proc.stdout.readline()
        assert marker.startswith(("importing", "checking")), (marker, proc.communicate())
        proc.send_signal(sig)
        _, err = proc.communicate("go\n", timeout=120)
    finally:
        proc.kill()
    assert "Traceback" not in err, err
    if once:
        assert proc.returncode == 130, (proc.returncode, err)
        assert "interrupted before every committed version was applied" in err, err
        return
    assert proc.returncode == 0, (proc.returncode, err)
    assert "receiver e1: stopped before it started" in err, err
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir()), err


def test_the_console_script_is_the_light_entry() -> None:
    import tomllib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["asyncsync-receiver"] == "receiver.entry:main"
    out = subprocess.run(
        [sys.executable, "-c", "import sys, receiver.entry; print('torch' in sys.modules)"],
        capture_output=True, text=True, cwd=REPO, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == "False"


def test_receiver_errors(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--root", str(root), "--checkpoint", str(tmp_path / "c"), "--once"]
    for bad in ("bad/id", "two\nlines", ""):  # bad usage (was exit 1 after start-up)
        assert receiver_main([*base, "--engine-id", bad]) == 2
        err = capsys.readouterr().err.strip()
        assert "argument --engine-id: invalid engine id" in err.splitlines()[-1], err
        assert not (tmp_path / "c").exists()
    assert receiver_main([*base, "--engine-id", "x", "--poll-interval", "0"]) == 2
    assert receiver_main([*base, "--engine-id", "x", "--apply-group-bytes", "0"]) == 2
    assert receiver_main(["--root", str(root)]) == 2
    assert "usage:" in capsys.readouterr().err
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "model.safetensors").write_bytes(b"\0" * 16)
    argv = ["--root", str(root), "--checkpoint", str(foreign), "--engine-id", "x", "--once"]
    assert receiver_main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not an asyncsync checkpoint" in err, err


def test_python_dash_m_asyncsync(root: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "asyncsync", "inspect", str(root), "--json"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
        env={**os.environ, "PYTHONWARNINGS": "error"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)) == 4


async def test_gc_with_nothing_to_delete_says_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """(issue 20, operator) not a bare "nothing to delete": the reason the oldest is kept."""
    async with Publisher(tmp_path, keyframe_interval=0) as pub:
        sd = mixed_state(0)
        await pub.seed(sd)
        await pub.publish(mutate(sd, 0.05, seed=1))
    assert main(["gc", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("nothing to delete: v0 (the oldest) is kept: ") and "-v" in out, out


@pytest.mark.parametrize(
    "argv",
    [
        ["gc", "ROOT", "--dry-run", "--ack-ttl", "nan"],
        ["gc", "ROOT", "--dry-run", "--ack-ttl", "inf"],
        ["bench", "--quick", "--throttle", "garbage"],
        ["bench", "--quick", "--throttle", "0MB/s,5ms"],
        ["bench", "--quick", "--device", "nosuchdev"],
    ],
)
def test_bad_values_are_usage_errors_before_any_work(
    root: Path, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Exit 2 with argparse's one line (a bad --throttle or --device was a traceback after the
    state was built; --ack-ttl nan was taken and kept every ack pinning forever)."""
    argv = [str(root) if a == "ROOT" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"argument {argv[-2]}:" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("flag", "value", "why"),
    [
        ("--json", "DIR", "is a directory, not a file"),
        ("--markdown", "FIFO", "exists and is not a regular file"),
        ("--json", "FILE/out.json", "FILE is not a directory"),
        ("--plot", "FILE", "exists and is not a directory"),
        ("--profile", "FILE/deeper/dir", "FILE is not a directory"),
        ("--threads", "5000", "must be <= 1024"),
        ("--markdown", "/proc/asyncsync-x/out.md", "/proc/asyncsync-x"),  # root may "access" it
        ("--plot", "/proc/asyncsync-x/plots", "/proc/asyncsync-x"),
    ],
)
def test_bench_outputs_and_threads_are_checked_before_the_run(
    tmp_path: Path, flag: str, value: str, why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An output the run cannot write failed only after minutes of benchmarking (a FIFO
    would block it at the end); --threads 10000000 was taken."""
    (tmp_path / "FILE").write_text("x\n")
    (tmp_path / "DIR").mkdir()
    os.mkfifo(tmp_path / "FIFO")
    arg = value if value.isdigit() or value.startswith("/") else str(tmp_path / value)
    assert main(["bench", "--quick", flag, arg]) == 2
    err = capsys.readouterr().err
    assert f"argument {flag}:" in err and why.replace("FILE", str(tmp_path / "FILE")) in err, err


def test_a_file_where_a_directory_is_expected_is_named_as_such(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """verify said "does not exist" and prepare "[Errno 17] File exists" for a regular file."""
    f = tmp_path / "file"
    f.write_text("x\n")
    assert main(["verify", str(root), "--checkpoint", str(f)]) == 1
    assert f"checkpoint directory {f} is not a directory" in capsys.readouterr().err
    assert main(["prepare", str(f), "--group", "0"]) == 1
    assert f"{f} is not a directory" in capsys.readouterr().err
    assert f.read_text() == "x\n"


@pytest.mark.parametrize("once", [False, True], ids=["daemon", "once"])
def test_a_root_below_a_file_is_refused_not_waited_for(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], once: bool
) -> None:
    """(attack-76) ``--root FILE/sub``: the daemon logged "does not exist (yet); waiting for the
    publisher to create it" and waited forever (no publisher can make a directory below a
    file); --once said "does not exist". One line naming the file now, exit 1."""
    f = tmp_path / "file"
    f.write_text("x\n")
    argv = ["--root", str(f / "sub" / "root"), "--engine-id", "e1",
            "--checkpoint", str(tmp_path / "ckpt"), *(["--once"] if once else [])]  # fmt: skip
    assert receiver_main(argv) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert f"--root {f / 'sub' / 'root'}: {f} is a file, not a directory" in err, err
    assert not (tmp_path / "ckpt").exists() and f.read_text() == "x\n"
