"""A real SGLang 0.5.23 server starts while another process takes memory during its start.

On CPU, SGLang measures the host's available memory before it loads the weights (its baseline)
and again before it sizes the KV cache, and refuses to start ("Loaded weights leave no GPU
memory for the KV cache") when the second is below ``(1 - mem_fraction_static)`` times the
first: any other process allocating more than that fraction of the free memory meanwhile
makes the start fail. The tests' flags (``server.CPU_FLAGS``) leave 90% of it; the KV pool
itself stays bounded by ``--max-total-tokens``. Here a helper process allocates exactly in
that window (the test fault plugin holds the server after its baseline until the memory is
taken), and the server must still start and serve.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.sglang_env import build
from tests.sglang_env.fixtures import require_env
from tests.sglang_env.server import Process, SGLangServer

pytestmark = [pytest.mark.sglang_real, pytest.mark.timeout(600)]

FAULTS = build.HERE / "fault_plugin"
HOG_MAX = 2 << 30


def available_bytes() -> int:
    """``MemAvailable`` (what SGLang's psutil reads on CPU)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemAvailable in /proc/meminfo")


def test_a_server_starts_while_another_process_allocates_memory(tmp_path: Path) -> None:
    env = require_env()
    # 2 GiB (a bench's tensors), or a quarter of what is free on a small host: more than the
    # 5% the old flags left, well within the 90% the flags leave now
    nbytes = min(HOG_MAX, available_bytes() // 4)
    prefix = str(tmp_path / "hog")
    hog = Process(
        [sys.executable, str(build.HERE / "memhog.py"), prefix, str(nbytes)],
        tmp_path / "memhog.log",
        dict(os.environ),
    )
    srv = SGLangServer(
        env, build.model_dir(env, "llama"), tmp_path / "sglang.log", plugin=False,
        extra_path=[FAULTS], extra_env={"ASYNCSYNC_TEST_HOLD_AFTER_BASELINE": prefix},
    )  # fmt: skip
    hog.start()
    try:
        srv.start()
        assert "memhog: holding" in hog.text()
        assert "held after the memory baseline" in srv.text()
        assert srv.generate([24, 978, 642], 4)["output_ids"]
    finally:
        Path(prefix + ".release").touch()
        srv.stop()
        hog.stop()
