"""What the real-vLLM test modules share: the built environment (or a failure saying why)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.sglang_env.build import is_complete
from tests.vllm_env import build


def require_env() -> Path:
    """The cached vLLM environment with this checkout installed for the servers. Missing is a
    failure, not a skip: ``make test`` builds it first (``make vllm-env``)."""
    env = build.env_dir()
    if not is_complete(env):
        pytest.fail(
            f"the real vLLM test environment {env} is not built: run `make vllm-env` "
            "(make test does; see tests/vllm_env/build.py)",
            pytrace=False,
        )
    if not (build.PLUGIN_DIR / "receiver" / "plugins" / "vllm_worker.py").is_file():
        pytest.fail(
            f"{build.PLUGIN_DIR} does not hold this checkout: run `make vllm-env`",
            pytrace=False,
        )
    return env
