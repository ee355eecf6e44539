"""The README's trainer and receiver snippets are examples/trainer_loop.py and
examples/engine_receiver.py,
shown whole in the README and run here as pasted (issue 20: they did not run)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from asyncsync.format.acks import read_acks
from receiver.engines.checkpoint import LocalCheckpoint

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = ("trainer_loop.py", "engine_receiver.py")


def test_the_readme_shows_each_example_whole() -> None:
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    for name in EXAMPLES:
        assert (REPO / "examples" / name).read_text() in blocks, name
        assert f"examples/{name}" in readme


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def test_the_trainer_and_the_receiver_examples_run_as_pasted(tmp_path: Path) -> None:
    root, ckpt = tmp_path / "root", tmp_path / "ckpt"
    r = _run("examples/trainer_loop.py", str(root), "--steps", "3")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1].startswith("v3: delta")
    r = _run("examples/engine_receiver.py", str(root), str(ckpt), "--once")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "gpu0 holds version 3"
    # side by side: the trainer waits for the running receiver's acks
    root2, ckpt2 = tmp_path / "root2", tmp_path / "ckpt2"
    rx = subprocess.Popen([sys.executable, "examples/engine_receiver.py", str(root2), str(ckpt2)],
                          cwd=REPO, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        r = _run("examples/trainer_loop.py", str(root2), "--steps", "2", "--engine", "gpu0")
        assert r.returncode == 0, r.stderr
        assert read_acks(root2)["gpu0"].version == 2
    finally:
        time.sleep(0.5)
        rx.send_signal(signal.SIGINT)
        _, err = rx.communicate(timeout=60)
    assert rx.returncode == 0, err
    assert LocalCheckpoint(ckpt2).tensor_names()  # the checkpoint holds the model
