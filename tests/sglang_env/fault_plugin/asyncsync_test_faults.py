"""Test-only SGLang plugin: faults inside the real server, on demand.

Not installed anywhere: the real-server tests put this folder on the server's PYTHONPATH
(SGLang finds the entry point in the dist-info next to it). It wraps the model's
``load_weights`` (which SGLang's reloads, the asyncsync plugin's in-place applies and its
audit all go through):

* ``$ASYNCSYNC_TEST_FAIL_LOAD_WEIGHTS`` names a file; when it exists and holds N, the N-th
  ``load_weights`` call (or per-tensor ``apply_plan`` of an in-place apply) from then on
  raises, and the file is removed: an error midway through a reload or an in-place apply,
  without changing the project's code. The asyncsync audit's own calls (its background
  threads, ``asyncsync-audit-rank*``, may route a tensor at any moment) are not counted, so
  the N-th call is the reload's whatever the audit does meanwhile.
* ``$ASYNCSYNC_TEST_CORRUPT_PARAM`` names a file; when it exists and holds a parameter name,
  the next ``load_weights`` call first flips the lowest bit of that parameter's first element
  (through NumPy, below torch: nothing of the project sees the write), and the file is
  removed: memory that no longer holds what was loaded, for the audit to find.
* ``$ASYNCSYNC_TEST_HOLD_AFTER_BASELINE`` names a file prefix P; right after the scheduler
  takes its memory baseline (the free memory its KV-cache check later compares against), it
  writes ``P.baseline`` and waits until ``P.go`` exists: another process (``tests.sglang_env.
  memhog``) allocates exactly between the baseline and the check, as one that happened to
  allocate during a start did.
"""

import os
import threading
import time
from pathlib import Path

MARKER_ENV = "ASYNCSYNC_TEST_FAIL_LOAD_WEIGHTS"
CORRUPT_ENV = "ASYNCSYNC_TEST_CORRUPT_PARAM"
HOLD_ENV = "ASYNCSYNC_TEST_HOLD_AFTER_BASELINE"
TARGET = "sglang.srt.models.llama.LlamaForCausalLM.load_weights"
BASELINE = "sglang.srt.distributed.bootstrap.measure_pre_model_load_memory"
HOLD_TIMEOUT = 300.0


def _corrupt(model):
    marker = os.environ.get(CORRUPT_ENV)
    if not marker or not os.path.exists(marker):
        return
    p = Path(marker)
    name = p.read_text().strip()
    p.unlink()
    param = dict(model.named_parameters())[name]
    arr = param.data.numpy()  # a view of the parameter's memory
    arr.reshape(-1).view("u1")[0] ^= 1
    print(f"asyncsync test fault plugin: corrupted {name}", flush=True)


_counting = threading.Lock()  # the in-place apply runs tensors on a pool: one count at a time


def _count_down(what):
    if threading.current_thread().name.startswith("asyncsync-audit"):
        return  # the audit's routing, not the reload or apply under test
    with _counting:
        _count_down_locked(what)


def _count_down_locked(what):
    marker = os.environ.get(MARKER_ENV)
    if marker and os.path.exists(marker):
        p = Path(marker)
        n = int(p.read_text().strip() or "1")
        if n <= 1:
            p.unlink()
            raise RuntimeError(f"injected failure in {what} (asyncsync test fault plugin)")
        p.write_text(str(n - 1))


def _around(original, self, weights, *args, **kwargs):
    _corrupt(self)
    _count_down("load_weights")
    return original(self, weights, *args, **kwargs)


def _hold_after_baseline(original, *args, **kwargs):
    baseline = original(*args, **kwargs)
    prefix = os.environ.get(HOLD_ENV)
    if prefix:
        Path(prefix + ".baseline").write_text(str(baseline))
        end = time.monotonic() + HOLD_TIMEOUT
        while not os.path.exists(prefix + ".go"):
            if time.monotonic() > end:
                raise RuntimeError(f"{prefix}.go did not appear (asyncsync test fault plugin)")
            time.sleep(0.05)
        print(f"asyncsync test fault plugin: held after the memory baseline {baseline}", flush=True)
    return baseline


def register():
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, _around, HookType.AROUND)
    HookRegistry.register(BASELINE, _hold_after_baseline, HookType.AROUND)
    # the in-place apply of a planned tensor calls no load_weights (receiver.plugins.scatter):
    # its per-tensor apply_plan counts toward the same N-th call
    try:
        import receiver.plugins.inplace as inplace
    except ImportError:  # a server without the asyncsync plugin
        return
    original = inplace.apply_plan

    def apply_plan(plan, positions, values):
        _count_down("apply_plan")
        return original(plan, positions, values)

    inplace.apply_plan = apply_plan
