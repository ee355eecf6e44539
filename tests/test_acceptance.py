"""The core slice's acceptance script (examples/acceptance.py), run small."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent.parent / "examples" / "acceptance.py"


@pytest.mark.slow
def test_acceptance_script(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--elements", "2000000", "--root", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[-1].startswith("ACCEPTANCE OK"), out.stdout
    assert any("changed=         0" in line for line in lines)  # the zero-diff version
    assert any(line.startswith("refused v7") for line in lines)


@pytest.mark.heavy
def test_acceptance_script_removes_its_temp_directory(tmp_path: Path) -> None:
    """(issue 20, operator) Without --root it works in a temp directory and removes it."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    out = subprocess.run([sys.executable, str(SCRIPT), "--elements", "200000"],
                         capture_output=True, text=True, timeout=240, env=env)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ACCEPTANCE OK" in out.stdout and "removed " in out.stdout
    assert list(tmp_path.iterdir()) == []
    help_text = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True,
                               text=True, timeout=60).stdout  # fmt: skip
    assert "elements of the generated state dict" in help_text and "--keep" in help_text
