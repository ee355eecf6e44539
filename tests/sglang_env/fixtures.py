"""What the real-SGLang test modules share: the built environment (or a failure saying why),
a server of one of its models started for a module."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.sglang_env import build
from tests.sglang_env.server import SGLangServer


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


@contextlib.contextmanager
def serving(d: Path, model: str = "llama", **kw: Any) -> Iterator[SGLangServer]:
    """A real SGLang server of the built ``model`` (``build.model_dir``), started (its log
    ``d/sglang.log``; ``kw``: :class:`SGLangServer`'s options), stopped at the end."""
    env = require_env()
    srv = SGLangServer(env, build.model_dir(env, model), d / "sglang.log", **kw)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()
