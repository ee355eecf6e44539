"""vLLM's own Llama at tensor-parallel size 2, both ranks in this one process, driven over
stdin/stdout (one JSON command per line) by tests/test_vllm_tp.py. Runs in the cached vLLM
environment (``build.py``) with this checkout on PYTHONPATH::

    python tests/vllm_env/tp_worker.py MODEL_DIR

Each rank is a ``LlamaForCausalLM`` of vLLM 0.32 built while vLLM's tensor-parallel group
reports size 2 and that rank (``GroupCoordinator.world_size``/``rank_in_group`` of a real
single-process gloo group): its ``QKVParallelLinear``/``MergedColumnParallelLinear`` rows,
``RowParallelLinear`` columns and ``VocabParallelEmbedding``/``ParallelLMHead`` rows are the
rank's slices, filled by vLLM's real weight loaders. Nothing runs forward (no collective is
needed); vLLM's CPU GEMM dispatch never runs either, so the parameters are plain, as on GPU.

Commands (answers are one JSON line each):

* ``{"op": "load", "dir": CKPT}``: every rank's ``InEngineLoader.reload_checkpoint`` (the first
  one is a full load: every tensor through ``load_weights``, as vLLM's reload does).
* ``{"op": "apply", "stage": DIR}``: every rank's ``receiver.plugins.vllm_loader.apply_stage``
  (the worker extension's code): ``{"messages": [...], "ok": [...]}``.
* ``{"op": "check", "file": SAFETENSORS}``: every rank's parameters against a second model of
  the same rank loaded in full from that state dict: ``{"differ": [...]}`` (bit for bit).
"""

from __future__ import annotations

import json
import os
import socket
import sys
from typing import Any

import safetensors.torch
import torch

TP = 2


class Worker:
    """What the worker extension needs of vLLM's worker: the model and ``reload_weights``."""

    def __init__(self, rank: int, model: Any, select: Any):
        self.rank = rank
        self.model = model
        self.select = select
        self.parallel_config = type("P", (), {"tensor_parallel_size": TP})()

    def reload_weights(self, weights_path: str | None = None) -> None:
        from receiver.engines.checkpoint import LocalCheckpoint

        assert weights_path is not None
        self.select(self.rank)
        self.model.load_weights(LocalCheckpoint(weights_path).load_state_dict().items())


def main() -> None:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.llama import LlamaForCausalLM

    from receiver.plugins import vllm_loader

    model_dir = sys.argv[1]

    def config() -> Any:
        args = EngineArgs(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=512)
        return args.create_engine_config()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(config()):
        ps.init_distributed_environment(
            world_size=1, rank=0, local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo",
        )  # fmt: skip
        ps.initialize_model_parallel(1, 1)
    group = ps.get_tp_group()

    def select(rank: int) -> None:
        group.world_size, group.rank_in_group = TP, rank

    def build(rank: int) -> Any:
        select(rank)
        cfg = config()  # one config per model: attention layers register by name
        with set_current_vllm_config(cfg), torch.no_grad():
            return LlamaForCausalLM(vllm_config=cfg)

    workers = [Worker(r, build(r), select) for r in range(TP)]
    refs = [build(r) for r in range(TP)]
    shapes = {n: list(p.shape) for n, p in workers[0].model.named_parameters()}
    print(json.dumps({"ready": True, "shapes": shapes}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        out: dict[str, Any] = {}
        with torch.no_grad():
            if cmd["op"] in ("load", "apply"):
                answers = []
                for w in workers:
                    select(w.rank)
                    if cmd["op"] == "load":
                        a = vllm_loader.load_checkpoint(w, w.model, cmd["dir"], False)
                    else:
                        a = vllm_loader.apply_stage(w, w.model, cmd["stage"])
                    answers.append(a)
                out = {
                    "ok": [a["ok"] for a in answers],
                    "messages": [a["message"] for a in answers],
                }
            elif cmd["op"] == "check":
                sd = safetensors.torch.load_file(cmd["file"])
                differ = []
                for w, ref in zip(workers, refs, strict=True):
                    select(w.rank)
                    ref.load_weights(sd.items())
                    want = dict(ref.named_parameters())
                    for n, p in w.model.named_parameters():
                        if not torch.equal(p.view(torch.int32), want[n].view(torch.int32)):
                            differ.append(f"rank {w.rank} {n}")
                out = {"differ": differ}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    main()
