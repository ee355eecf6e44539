"""`asyncsync status`: engines, versions, lag and stragglers from the acks."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from asyncsync import Publisher
from asyncsync.errors import ManifestUnreadable
from asyncsync.format.acks import write_ack
from asyncsync.ops.cli import main
from tests.conftest import mixed_state, mutate


async def test_status_table_json_and_straggler_exit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sd = mixed_state(0)
    async with Publisher(tmp_path) as pub:
        await pub.seed(sd)
        for i in range(1, 6):
            await pub.publish(mutate(sd, 0.02, seed=i))
        run = pub.run_id
    write_ack(tmp_path, "fast", 5, "ab" * 16, run)
    write_ack(tmp_path, "slow", 1, "ab" * 16, run)
    write_ack(tmp_path, "ghost", 5, "ab" * 16, "another-run")
    assert main(["status", str(tmp_path)]) == 3
    out = capsys.readouterr().out
    assert "newest version 5, 3 engines, 2 stragglers" in out
    lines = {line.split()[0]: line for line in out.splitlines()[2:]}
    assert lines["fast"].rstrip().endswith("ok") and " 0 " in lines["fast"]
    assert "STRAGGLER" in lines["slow"] and " 4 " in lines["slow"]
    assert "OTHER RUN" in lines["ghost"]

    assert main(["status", str(tmp_path), "--json", "--max-lag", "10"]) == 3  # ghost remains
    doc = json.loads(capsys.readouterr().out)
    assert doc["latest"] == 5 and doc["stragglers"] == ["ghost"]
    assert {e["engine_id"]: e["lag"] for e in doc["engines"]} == {
        "fast": 0,
        "slow": 4,
        "ghost": None,
    }

    (tmp_path / "acks" / "ghost.json").unlink()
    assert main(["status", str(tmp_path), "--max-lag", "10"]) == 0
    capsys.readouterr()
    # behind and silent for longer than --stale is a straggler even within --max-lag
    time.sleep(0.05)
    assert main(["status", str(tmp_path), "--max-lag", "10", "--stale", "0.01"]) == 3
    assert main(["status", str(tmp_path / "missing")]) == 1


async def test_acks_it_cannot_read_are_an_error_not_all_clear(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`acks/` a regular file or a symlink: exit 1 naming it (it printed "0 engines, 0
    stragglers" and exited 0, which a monitoring script reads as healthy)."""
    async with Publisher(tmp_path) as pub:
        await pub.seed(mixed_state(0))
    assert main(["status", str(tmp_path)]) == 0  # no acks/ yet: no engine has acked
    assert "0 engines" in capsys.readouterr().out
    (tmp_path / "acks").write_text("not a directory\n")
    assert main(["status", str(tmp_path)]) == 1
    assert "'acks' on its way is a regular file" in capsys.readouterr().err
    (tmp_path / "acks").unlink()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "acks").symlink_to(tmp_path / "elsewhere")
    assert main(["status", str(tmp_path)]) == 1
    assert "is a symlink" in capsys.readouterr().err


async def test_status_escapes_control_characters_of_an_ack(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An ack's host with terminal escapes and a newline: shown escaped, in its own row (it
    cleared the screen and printed a forged row)."""
    async with Publisher(tmp_path) as pub:
        await pub.seed(mixed_state(0))
        run = pub.run_id
    write_ack(tmp_path, "real", 0, "ab" * 16, run)
    path = tmp_path / "acks" / "real.json"
    doc = json.loads(path.read_text())
    path.write_text(json.dumps({**doc, "host": "\x1b[2J\x1b[31mPWNED\nfake  2  0  ok"}))
    assert main(["status", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and len(out.splitlines()) == 3, out
    assert "\\x1b[2J\\x1b[31mPWNED\\nfake  2  0  ok" in out.splitlines()[2], out


async def test_lag_is_counted_from_the_newest_good_version_not_a_planted_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """(helper-26) A damaged ``v999999999999`` planted above v3: a receiver marks it bad and
    stays at v3, and `status` showed it 999999999996 versions behind, a straggler. A lag is
    now counted from the newest version whose manifest reads and that the engine has not
    marked bad; the good versions above one it marked bad still count (stuck below it)."""
    from receiver import ReceiverAgent
    from receiver.engines.checkpoint import LocalCheckpoint

    sd = mixed_state(0)
    root = tmp_path / "root"
    async with Publisher(root, keyframe_interval=0) as pub:
        await pub.seed(sd)
        for i in range(1, 4):
            await pub.publish(mutate(sd, 0.02, seed=i))
        run = pub.run_id
    planted = root / "v999999999999"
    planted.mkdir()
    (planted / "manifest.json").write_text("{damaged")
    agent = ReceiverAgent(
        root, LocalCheckpoint(tmp_path / "ckpt"), "rx", use_inotify=False, verify_deadline=0.2
    )
    async with agent:
        with pytest.raises(ManifestUnreadable):  # bad, no keyframe past it: stays at v3
            await agent.sync_once()
        assert agent.version == 3
    assert json.loads((root / "acks" / "rx.json").read_text())["bad_versions"] == [999999999999]
    write_ack(root, "unaware", 3, "ab" * 16, run)  # has not looked at it yet
    write_ack(root, "shards", 2, "ab" * 16, run, bad_versions=(3,))  # v3's shards damaged
    write_ack(root, "stuck", 1, "ab" * 16, run, bad_versions=(2,))  # v3 builds on a bad v2

    assert main(["status", str(root), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["latest"] == 999999999999 and doc["stragglers"] == []
    lags = {e["engine_id"]: e["lag"] for e in doc["engines"]}
    assert lags == {"rx": 0, "unaware": 0, "shards": 0, "stuck": 2}
    assert main(["status", str(root), "--max-lag", "1"]) == 3
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines()[2:]}
    assert rows["rx"].split()[:3] == ["rx", "3", "0"] and rows["rx"].endswith(
        "ok bad v999999999999"
    )
    assert rows["stuck"].split()[:3] == ["stuck", "1", "2"] and "STRAGGLER bad v2" in rows["stuck"]
    # (helper-29, finding 3) more damaged versions than status looked at (16) above v3: the
    # lag is still counted from v3, as the receivers go past any number of them
    for v in range(999999999980, 999999999999):
        (root / f"v{v}").mkdir()
        (root / f"v{v}" / "manifest.json").write_text("garbage")
    assert main(["status", str(root), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {e["engine_id"]: e["lag"] for e in doc["engines"]}["unaware"] == 0


@pytest.mark.parametrize("kind", ["fifo", "symlink", "garbage", "other engine"])
async def test_an_ack_it_cannot_read_is_named_not_all_clear(
    tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """(attack-60) An ack file it could not read (a FIFO or a symlink put there, bytes that are
    no record, a record naming another engine) was left out: "1 engines, 0 stragglers", exit 0,
    while that engine's version was unknown. It is listed now, and the exit status is 1."""
    async with Publisher(tmp_path) as pub:
        await pub.seed(mixed_state(0))
        run = pub.run_id
    write_ack(tmp_path, "good", 0, "ab" * 16, run)
    bad = tmp_path / "acks" / "lost.json"
    if kind == "fifo":
        os.mkfifo(bad)
    elif kind == "symlink":
        bad.symlink_to(tmp_path / "acks" / "good.json")
    elif kind == "garbage":
        bad.write_bytes(b"\x00\xff not json")
    else:
        bad.write_text((tmp_path / "acks" / "good.json").read_text())
    for argv in (["status", str(tmp_path)], ["status", str(tmp_path), "--json"]):
        assert main(argv) == 1
        out, err = capsys.readouterr()
        assert "\x1b" not in out and str(bad) in out, out
        assert err.strip().splitlines()[-1].startswith("asyncsync status: error: 1 ack"), err
    assert json.loads(out)["unreadable_acks"][0]["path"] == str(bad)
    bad.unlink()
    assert main(["status", str(tmp_path)]) == 0
