"""examples/train_loop.py, run small: bounded staleness, bit-exact engines, both modes."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).parent.parent / "examples" / "train_loop.py"
SMALL = ["--vocab", "256", "--hidden", "32", "--layers", "1", "--batch", "4", "--quiet"]


@pytest.fixture(scope="module")
def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_loop_example", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("ASYNCSYNC_") and key != "ASYNCSYNC_FORCE_POLLING":
            monkeypatch.delenv(key)


@pytest.mark.parametrize(
    ("mode", "staleness", "kind"), [("delta", "1", "delta"), ("full", "0", "full")]
)
def test_train_loop(
    example: ModuleType, tmp_path: Path, mode: str, staleness: str, kind: str
) -> None:
    argv = [*SMALL, "--steps", "4", "--sync-root", str(tmp_path), "--sync-mode", mode]
    summary = example.main(
        [*argv, "--sync-max-staleness", staleness, "--sync-keyframe-interval", "0"]
    )
    assert summary["bit_exact"] is True
    assert summary["last_version"] == 4
    assert summary["engines_at"] == {"engine0": 4, "engine1": 4}
    assert 0 <= summary["max_staleness_seen"] <= int(staleness)
    if kind == "delta":
        assert summary["wire_vs_full"] < 0.5 and summary["keyframes"] == 1  # only the seed
    else:
        assert summary["mean_density"] == 1.0 and summary["keyframes"] == 5


def test_script_prints_its_table(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), *SMALL[:-1], "--steps", "3", "--sync-root", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("ASYNCSYNC_")},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[1].split()[:4] == ["step", "loss", "ver", "kind"]
    assert [line.split()[2] for line in lines[2:5]] == ["1", "2", "3"]
    assert "bit-exact with the trainer: True" in out.stdout
    assert "allowed 1" in out.stdout
