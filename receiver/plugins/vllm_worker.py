"""vLLM worker extension: read back what a vLLM worker *serves*, per Hugging Face tensor.

Start vLLM with ``--worker-extension-cls
receiver.plugins.vllm_worker.AsyncSyncWorkerExtension`` (asyncsync installed in vLLM's
environment) and call its methods through ``POST /collective_rpc`` (``VLLM_SERVER_DEV_MODE=1``).
:class:`~receiver.engines.vllm.VLLM` does, for the served-bytes audit (``receiver.audit``).

Why not vLLM's own ``/weight_checker``: it hashes each *parameter* (SHA-256, fused names such
as ``qkv_proj``), and on vLLM's CPU build every unquantized linear layer keeps its weight in a
oneDNN (or AMX) packed handle after loading and replaces the parameter with an empty tensor
(``dispatch_cpu_unquantized_gemm(remove_weight=True)``): ``/weight_checker`` then reports the
digest of zero bytes for every linear layer, whatever is served. This extension instead:

* maps each HF tensor name to the parameter that serves it, and the rows of it that are its
  own (``packed_modules_mapping``: ``q_proj``/``k_proj``/``v_proj`` are consecutive row
  blocks of ``qkv_proj``, ``gate_proj``/``up_proj`` of ``gate_up_proj``, in that order);
* reads a parameter that still holds its bytes directly, and reconstructs a packed CPU linear
  layer's weight by running the layer's own kernel on identity rows (``I @ W.T = W.T``: what
  the kernel multiplies by is exactly what it serves). Products by 1 and sums with zeros are
  exact, except the sign of a zero (``-0.0 + 0.0 = +0.0``): such tensors are hashed with
  every zero made ``+0.0`` and named in ``zero_sign_canonical``, and the caller compares them
  with the expected bytes treated the same way;
* hashes each HF tensor's served bytes with the project's checksum (XXH3-128, the manifest's).

Tensor parallelism: each worker sees only its slice, so the audit needs tensor-parallel size 1
(a larger size is reported as ``unsupported``). This module imports without vLLM installed.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch

from asyncsync.format.checksum import checksum_tensor
from receiver.plugins import vllm_loader

__all__ = ["AsyncSyncWorkerExtension", "audit_spec", "canonical_zeros", "served_tensors"]

logger = logging.getLogger(__name__)

#: identity rows fed to a packed layer at once (bounds the scratch memory of a read-back)
_ROWS = 1024
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _fused_name(name: str, packed: dict[str, list[str]]) -> tuple[str, str, list[str]] | None:
    """``model.layers.0.self_attn.k_proj.weight`` -> (``...qkv_proj.weight``, k_proj, parts)."""
    parts = name.split(".")
    for i, p in enumerate(parts):
        for fused, members in packed.items():
            if p in members:
                return ".".join([*parts[:i], fused, *parts[i + 1 :]]), p, list(members)
    return None


def _read_back(module: torch.nn.Module, param: torch.Tensor, shape: tuple[int, int]) -> Any:
    """A packed CPU linear layer's weight (N, K), through its own kernel on identity rows."""
    linear = getattr(module, "cpu_linear", None)
    if linear is None:
        return None
    n, k = shape
    out = torch.empty((k, n), dtype=param.dtype)
    with torch.no_grad():
        for r0 in range(0, k, _ROWS):
            r1 = min(k, r0 + _ROWS)
            eye = torch.zeros((r1 - r0, k), dtype=param.dtype)
            eye[:, r0:r1].fill_diagonal_(1)
            out[r0:r1] = linear(eye, param, None)
    return out.t().contiguous()


def served_tensors(
    model: torch.nn.Module, spec: dict[str, tuple[list[int], str]]
) -> tuple[dict[str, torch.Tensor], list[str], dict[str, str]]:
    """The served bytes of every HF tensor in ``spec`` (name -> (shape, dtype name)).

    Returns (tensors, the names read back through a kernel (zero signs lost), the names that
    cannot be compared -> why)."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    mapping = getattr(model, "packed_modules_mapping", None) or {}
    packed = {str(k): list(v) for k, v in mapping.items()}
    where: dict[str, tuple[str, int | None]] = {}  # HF name -> (parameter, first row or None)
    rows_of: dict[str, int] = {}  # fused parameter -> rows its members in spec add up to
    unmapped: dict[str, str] = {}
    for name in spec:
        if name in params:
            where[name] = (name, None)
            continue
        fused = _fused_name(name, packed)
        if fused is None or fused[0] not in params:
            unmapped[name] = "no parameter of the served model holds it"
            continue
        target, member, members = fused
        siblings = [name.replace(f".{member}.", f".{m}.") for m in members]
        if not all(s in spec for s in siblings):
            unmapped[name] = f"{target} fuses {members}: not all of them are published"
            continue
        i = members.index(member)
        where[name] = (target, sum(int(spec[s][0][0]) for s in siblings[:i]))
        rows_of[target] = sum(int(spec[s][0][0]) for s in siblings)
    whole: dict[str, torch.Tensor] = {}
    read_back: set[str] = set()
    out: dict[str, torch.Tensor] = {}
    for name, (target, first) in where.items():
        shape = [int(d) for d in spec[name][0]]
        if target not in whole:
            p = params[target].detach()
            if p.numel() == 0 and len(shape) == 2:  # emptied by the CPU GEMM dispatch
                n = rows_of.get(target, shape[0])
                got = _read_back(modules[target.rsplit(".", 1)[0]], p, (n, shape[1]))
                if got is not None:
                    p = got
                    read_back.add(target)
            whole[target] = p
        t = whole[target]
        if first is not None:
            t = t[first : first + shape[0]]
        if list(t.shape) != shape:
            unmapped[name] = f"served as {list(t.shape)} in {target}, published {shape}"
            continue
        if str(t.dtype).removeprefix("torch.") != spec[name][1]:
            unmapped[name] = f"served as {t.dtype}, published {spec[name][1]}"
            continue
        out[name] = t
    zero_sign = sorted(n for n in out if where[n][0] in read_back)
    return out, zero_sign, unmapped


def canonical_zeros(t: torch.Tensor) -> torch.Tensor:
    """``t`` with every ``-0.0`` made ``+0.0`` (floats; other dtypes unchanged)."""
    if t.dtype not in _FLOATS:
        return t
    return torch.where(t == 0, torch.zeros_like(t), t)


class AsyncSyncWorkerExtension:
    """Mixed into vLLM's worker class by ``--worker-extension-cls``; ``self`` is the worker.

    Methods (``POST /collective_rpc {"method": name, "args": [...]}``, run in every worker):
    ``asyncsync_served_checksums`` (the audit), ``asyncsync_capabilities``,
    ``asyncsync_apply_stage`` and ``asyncsync_load`` (the in-engine apply,
    :mod:`receiver.plugins.vllm_loader`)."""

    def asyncsync_capabilities(self) -> dict[str, Any]:
        """Whether this worker applies stages in place, and why not."""
        return vllm_loader.capabilities(self, self.model_runner.get_model())  # type: ignore[attr-defined]

    def asyncsync_apply_stage(self, stage_dir: str) -> dict[str, Any]:
        """Apply the stage in ``stage_dir`` (in place, or through the checkpoint)."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        with torch.no_grad():
            return vllm_loader.apply_stage(self, model, stage_dir)

    def asyncsync_load(self, checkpoint_dir: str, mode: str = "partial") -> dict[str, Any]:
        """Load the checkpoint in ``checkpoint_dir``: ``partial`` (the tensors that changed) or
        ``full`` (vLLM's ``reload_weights``). Arguments are strings, as ``/collective_rpc``
        passes them."""
        if mode not in ("partial", "full"):
            raise ValueError(f"asyncsync_load: mode must be 'partial' or 'full', got {mode!r}")
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        with torch.no_grad():
            return vllm_loader.load_checkpoint(self, model, checkpoint_dir, mode == "full")

    def asyncsync_served_checksums(self, spec_json: str) -> dict[str, Any]:
        """``/collective_rpc`` method: the checksum of the served bytes of each HF tensor.

        ``spec_json``: :func:`audit_spec` of the manifest. Answers ``{"checksums": {name: hex},
        "zero_sign_canonical": [...], "unmapped": {name: why}, "tp_size": n}``, or
        ``{"unsupported": why}`` where it cannot tell."""
        spec = json.loads(spec_json)
        tensors = {n: (e["shape"], e["dtype"]) for n, e in spec["tensors"].items()}
        tp = int(getattr(getattr(self, "parallel_config", None), "tensor_parallel_size", 1))
        if tp != 1:
            return {"unsupported": f"tensor-parallel size {tp}: each worker holds a slice"}
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        with torch.no_grad():
            served, zero_sign, unmapped = served_tensors(model, tensors)
            sums = {}
            for n, t in served.items():
                layout = spec["tensors"][n].get("layout")
                sums[n] = checksum_tensor(
                    canonical_zeros(t) if n in zero_sign else t,
                    spec["algorithm"],
                    None if layout is None else [tuple(x) for x in layout],
                )
        return {
            "checksums": sums,
            "zero_sign_canonical": zero_sign,
            "unmapped": unmapped,
            "tp_size": tp,
        }


def audit_spec(tensors: dict[str, Any], algorithm: str) -> str:
    """The argument of :meth:`AsyncSyncWorkerExtension.asyncsync_served_checksums` for a
    manifest's tensor entries (``Manifest.tensors``)."""
    return json.dumps(
        {
            "algorithm": algorithm,
            "tensors": {
                name: {
                    "shape": list(e.shape),
                    "dtype": e.dtype,
                    "layout": None if e.layout is None else [list(x) for x in e.layout],
                }
                for name, e in tensors.items()
            },
        }
    )
