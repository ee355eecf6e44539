"""``asyncsync-receiver --lease-ttl``: how long a restart elsewhere waits for a dead receiver's
lease, with real receiver processes.

A receiver killed on one host leaves its engine id's lease behind; a receiver started for the
same id on another host (or in another container) cannot ask the kernel whether the holder
lives, so it watches the lease until it has stayed unchanged for the lease's own ``ttl``
(FORMAT.md section 7.1). The command had no way to set that ttl: every such restart waited 30
s. Here a receiver process with ``--lease-ttl 3`` is SIGKILLed, its lease made to read as
another boot's (what a lease from another host looks like here: the pid check cannot decide),
and a second receiver process takes the id in about 3 s.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncsync import Publisher
from receiver.cli import build_parser
from tests.conftest import mixed_state

REPO = Path(__file__).resolve().parent.parent


def _receiver(root: Path, ckpt: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "receiver.cli", "--root", str(root), "--engine-id", "e1",
            "--checkpoint", str(ckpt), "--poll-interval", "0.1", "--force-polling",
            "--lease-settle", "0", "--lease-ttl", "3", *extra]  # fmt: skip


def _ack(root: Path) -> int | None:
    try:
        return int(json.loads((root / "acks" / "e1.json").read_text())["version"])
    except (OSError, ValueError, KeyError):
        return None


@pytest.mark.parametrize(
    ("value", "words"),
    [("0.5", "from 1 to 120"), ("121", "from 1 to 120"), ("soon", "a number of seconds")],
)
def test_a_lease_ttl_out_of_range_is_a_usage_error(
    value: str, words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--root", "r", "--engine-id", "e", "--lease-ttl", value])
    assert exc.value.code == 2 and words in capsys.readouterr().err


def test_a_settle_over_a_quarter_of_the_ttl_is_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "root").mkdir()
    argv = _receiver(tmp_path / "root", tmp_path / "ckpt", "--once")
    argv[argv.index("--lease-settle") + 1] = "1"  # a quarter of 3 s is 0.75
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "quarter of the lease ttl" in done.stderr
    assert "Traceback" not in done.stderr


async def test_a_restart_elsewhere_waits_the_dead_leases_ttl(tmp_path: Path) -> None:
    root = tmp_path / "root"
    async with Publisher(root) as pub:
        await pub.seed(mixed_state(0))
    first = subprocess.Popen(_receiver(root, tmp_path / "ck1"), cwd=REPO, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while _ack(root) != 0:
            assert first.poll() is None and time.monotonic() < deadline, "no ack of v0"
            time.sleep(0.1)
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=60)
    lease_path = root / "leases" / "e1.json"
    lease = json.loads(lease_path.read_text())
    assert lease["ttl"] == 3.0 and lease["pid"] == first.pid
    lease["boot_id"] = "another-boot"  # as a lease of another host reads here
    tmp = lease_path.with_name(".tmp.e1")
    tmp.write_text(json.dumps(lease))
    os.replace(tmp, lease_path)
    (root / "acks" / "e1.json").unlink()
    started = time.monotonic()
    done = subprocess.run(
        _receiver(root, tmp_path / "ck2", "--once"), cwd=REPO, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    took = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    assert _ack(root) == 0
    # it watched the dead lease for its ttl (3 s): the 30 s default alone would pass 30 s
    assert "taking over the dead lease" in done.stderr
    assert 3.0 <= took < 30.0, (took, done.stderr[-2000:])
