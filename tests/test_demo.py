"""``python -m asyncsync.ops.demo`` end to end, small: a trainer, two receivers, bit-exact."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from asyncsync.ops.demo import main

REPO = Path(__file__).resolve().parent.parent


def test_demo_end_to_end() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "asyncsync.ops.demo",
         "--versions", "4", "--elements", "200000", "--engines", "2"],
        capture_output=True, text=True, timeout=240, cwd=REPO,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[-1] == "DEMO OK: every engine is bit-exact at version 3 (2 engines)", out.stdout
    progress = [line for line in lines if re.match(r"v\d+ ", line)]
    assert [p.split()[1] for p in progress] == ["full", "delta", "zero-diff", "delta"]
    assert sum("every byte equals the trainer's state dict" in line for line in lines) == 2
    assert any(line.startswith("deltas: 3 versions") for line in lines)
    removed = next(line for line in lines if line.startswith("removed "))
    assert not Path(removed.split()[1]).exists()
    assert "Traceback" not in out.stderr


def test_demo_refuses_a_non_empty_root(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "something").write_text("x")
    assert main(["--root", str(tmp_path)]) == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("DEMO FAILED:") and "empty or missing" in last


def test_demo_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--versions", "1"]) == 2
    assert main(["--engines", "zero"]) == 2
    assert "usage:" in capsys.readouterr().err


def test_the_demo_compares_bytes_not_bool_values() -> None:
    """The demo's check copied a non-contiguous bool with ``contiguous()`` (which writes 0/1)
    before comparing: a mask viewed from uint8 compared equal to its normalised copy."""
    import torch

    from asyncsync.codec import raw_clone
    from asyncsync.ops.demo import _same_bytes

    mask = torch.arange(24, dtype=torch.uint8).view(torch.bool).reshape(4, 6).t()
    assert not _same_bytes(mask, mask.contiguous())
    assert _same_bytes(mask, raw_clone(mask)) and _same_bytes(torch.ones(3), torch.ones(3))
