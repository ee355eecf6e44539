"""What the real-SGLang test modules share: the built environment (or a failure saying why)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.sglang_env import build


def require_env() -> Path:
    """The cached SGLang environment with this checkout installed for the servers. Missing is
    a failure, not a skip: ``make test`` builds it first (``make sglang-env``)."""
    env = build.env_dir()
    if not build.is_complete(env):
        pytest.fail(
            f"the real SGLang test environment {env} is not built: run `make sglang-env` "
            "(make test does; see tests/sglang_env/build.py)",
            pytrace=False,
        )
    if not (build.PLUGIN_DIR / "receiver" / "plugins" / "sglang_loader.py").is_file():
        pytest.fail(
            f"{build.PLUGIN_DIR} does not hold this checkout: run `make sglang-env`",
            pytrace=False,
        )
    return env
