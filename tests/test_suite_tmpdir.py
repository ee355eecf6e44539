"""The suite keeps the temporary files of what it runs out of the host's temporary directory
(``suite_tmpdir`` in conftest.py): a receiver's server lock files, one per server address and
never removed by design, piled up in /tmp by the hundred each run. The product still puts
them where its docs say, the temporary directory (``$TMPDIR``): only the suite's is its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from yarl import URL

from receiver.engines import server_lock
from receiver.engines.server_lock import ServerLock
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[1]


def test_a_receiver_process_keeps_its_server_lock_in_the_suites_tmpdir(suite_tmpdir: Path) -> None:
    host_tmp = suite_tmpdir.parent
    assert os.environ["TMPDIR"] == tempfile.gettempdir() == str(suite_tmpdir)
    url = URL(f"http://127.0.0.1:{free_port()}")
    lock = ServerLock.take("sglang", url, "/ckpt")  # in this process: the names it takes
    assert lock.path is not None and lock.path.parent == suite_tmpdir / server_lock.DIR_NAME
    lock.release()
    legacy = "asyncsync-server-" + lock.path.name.removeprefix("server-")
    code = "import sys; from tests.server_lock_taker import main; sys.exit(main(sys.argv[1:]))"
    # (the environment of a receiver a test starts: this process's)
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(url), "/ckpt"], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "took\n"
        for path in (lock.path, suite_tmpdir / legacy):  # each holds its holder's pid
            assert json.loads(path.read_text())["pid"] == proc.pid
        assert not (host_tmp / legacy).exists()
        assert not (host_tmp / server_lock.DIR_NAME / lock.path.name).exists()
    finally:
        proc.communicate("\n", timeout=60)
