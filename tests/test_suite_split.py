"""How ``make test`` splits the suite over its pytest-xdist workers (``xdist_unit`` in
conftest.py): a module a unit, and every module that starts a real SGLang or vLLM server or a
Ray cluster in the one serial unit, so that no two of them run at once."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import SERIAL_MARKS, SERIAL_MODULES, SERIAL_UNIT, xdist_unit

HERE = Path(__file__).resolve().parent
# what starts a real server or cluster: the marks, the fixtures that serve, Ray itself
_MARKS = "|".join(sorted(SERIAL_MARKS))
_STARTS = re.compile(
    rf"mark\.(?:{_MARKS})\b|\bserving\(|\bray\.init\(|tests\.ray_cluster|RayCluster|import ray\b"
)


def test_every_module_that_starts_a_real_server_or_cluster_is_in_the_serial_unit() -> None:
    mine = Path(__file__).name
    starts = {
        p.name for p in HERE.glob("test_*.py") if p.name != mine and _STARTS.search(p.read_text())
    }
    assert starts, "the pattern no longer finds the real-server modules"
    assert starts - SERIAL_MODULES == set()


def test_the_serial_modules_exist() -> None:
    assert {name for name in SERIAL_MODULES if not (HERE / name).is_file()} == set()


def test_units_are_modules_and_the_serial_one() -> None:
    assert xdist_unit("tests/test_codec.py::test_x[a::b]") == "tests/test_codec.py"
    assert xdist_unit("tests/test_codec.py::TestA::test_y") == "tests/test_codec.py"
    assert xdist_unit("tests/test_sglang_real.py::test_z") == SERIAL_UNIT
    assert xdist_unit("tests/test_ray.py::test_z[p]") == SERIAL_UNIT


def test_the_suite_runs_without_xdist_too() -> None:
    """The scheduler hook is optional: ``pytest -p no:xdist`` (or a venv without it) runs the
    tests instead of stopping at an unknown hook."""
    import subprocess
    import sys

    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider"]
    out = subprocess.run(
        [*args, f"{Path(__file__).name}::test_the_serial_modules_exist"],
        cwd=HERE,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 passed" in out.stdout
