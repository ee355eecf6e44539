"""The real-SGLang test environment's builder (tests/sglang_env/build.py): where it lives, what
names it, and that a missing or unbuildable environment is a failure with the reason, never a
skip. (Building it for real is `make sglang-env`, which `make test` runs first.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.sglang_env import build
from tests.sglang_env.fixtures import require_env


def test_the_cache_dir_follows_xdg_and_the_override(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ASYNCSYNC_SGLANG_ENV_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert build.env_dir() == tmp_path / "xdg" / "asyncsync" / f"sglang-{build.env_hash()}"
    monkeypatch.setenv("ASYNCSYNC_SGLANG_ENV_CACHE", str(tmp_path / "mine"))
    assert build.env_dir().parent == tmp_path / "mine"


def test_the_hash_covers_the_pinned_list_and_the_project_dependencies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    h = build.env_hash()
    assert h == build.env_hash() and len(h) == 16
    monkeypatch.setattr(build, "project_dependencies", lambda: ["torch>=2.4", "numpy>=9"])
    assert build.env_hash() != h
    monkeypatch.undo()
    monkeypatch.setattr(build, "RECIPE", build.RECIPE + 1)
    assert build.env_hash() != h
    pins = (build.HERE / "requirements.txt").read_text().splitlines()
    assert "sglang==0.5.23" in pins and not any(p.startswith("triton") for p in pins)
    # never a CUDA package (nvidia-ml-py is a pure-Python NVML binding sglang imports)
    assert not any(p.startswith(("torch==", "nvidia-cu", "cuda", "flashinfer")) for p in pins)
    assert build.TORCH_PIN == "torch==2.13.0+cpu"


def test_missing_environment_fails_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASYNCSYNC_SGLANG_ENV_CACHE", str(tmp_path))
    with pytest.raises(pytest.fail.Exception, match="not built: run `make sglang-env`"):
        require_env()
    out = subprocess.run(
        [sys.executable, str(build.HERE / "build.py"), "--check"],
        capture_output=True,
        text=True,
        env={**build.server_env(tmp_path), "ASYNCSYNC_SGLANG_ENV_CACHE": str(tmp_path)},
        check=False,
    )
    assert out.returncode == 1 and "make sglang-env" in out.stdout


def test_a_failing_step_names_itself_and_its_log(tmp_path: Path) -> None:
    log = tmp_path / "build.log"
    cmd = [sys.executable, "-c", "import sys; print('no such wheel: sglang'); sys.exit(3)"]
    with pytest.raises(build.BuildError) as ei:
        build._run(cmd, log, "sglang 0.5.23")
    msg = str(ei.value)
    assert "failed at: sglang 0.5.23 (exit 3)" in msg and str(log) in msg
    assert "no such wheel: sglang" in msg  # the log's tail: the reason
