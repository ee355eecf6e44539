"""The multi-rank model (tests/multirank_model.py), short: a few seeds of a dozen steps each.

``make stress`` runs it long (``stress/multirank.py``); ``ASYNCSYNC_MODEL_SEED`` replays one seed.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.multirank_model import run_model

_SEED = os.environ.get("ASYNCSYNC_MODEL_SEED")
SEEDS = [int(_SEED)] if _SEED else [1, 2]


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.parametrize("seed", SEEDS)
def test_multirank_model(tmp_path: Path, seed: int) -> None:
    summary = run_model(tmp_path, seed=seed, steps=12, world=2, timeout=1.0)
    assert summary["committed"] >= 2, summary
    print(summary)
