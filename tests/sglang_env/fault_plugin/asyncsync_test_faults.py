"""Test-only SGLang plugin: make the model's ``load_weights`` fail once, on demand.

Not installed anywhere: tests/test_sglang_real_plugin.py puts this folder on the server's
PYTHONPATH (SGLang finds the entry point in the dist-info next to it). When the file named by
``$ASYNCSYNC_TEST_FAIL_LOAD_WEIGHTS`` exists and holds N, the N-th ``load_weights`` call from
then on raises, and the file is removed: an error midway through a reload, inside the real
server, without changing the project's code.
"""

import os
from pathlib import Path

MARKER_ENV = "ASYNCSYNC_TEST_FAIL_LOAD_WEIGHTS"
TARGET = "sglang.srt.models.llama.LlamaForCausalLM.load_weights"


def _around(original, self, weights, *args, **kwargs):
    marker = os.environ.get(MARKER_ENV)
    if marker and os.path.exists(marker):
        p = Path(marker)
        n = int(p.read_text().strip() or "1")
        if n <= 1:
            p.unlink()
            raise RuntimeError("injected failure in load_weights (asyncsync test fault plugin)")
        p.write_text(str(n - 1))
    return original(self, weights, *args, **kwargs)


def register():
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, _around, HookType.AROUND)
