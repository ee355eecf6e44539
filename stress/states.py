"""A state dict that is a pure function of (seed, version), so a checker can recompute any version.

A restarted publisher has no snapshot: it re-seeds at the next version number. With
``state(v)`` depending only on ``v``, every committed version, whichever process wrote it and
however many times the publisher was killed on the way, must hold exactly ``state(v)``.

Each element ``i`` of a changing tensor has a period ``p_i`` and a phase ``q_i``; at version
``v`` its bytes are ``base_i XOR (((v + q_i) // p_i) & 0x7F)`` on the tensor's int view, so it
changes exactly when ``p_i`` divides ``v + q_i``: about ``1/p`` of the elements per version,
scattered, in the low bits (like a bf16 Adam step). One tensor changes entirely every version
(the xef dense path), one never changes (entries with ``changed == 0``), and there are bool,
fp8, int8, 0-d and empty tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["VersionedState"]

_INT_BY_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class _Spec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    period: tuple[int, int] | None  # per-element change period range (inclusive); None: frozen


@dataclass(frozen=True)
class _Tensor:
    spec: _Spec
    base: torch.Tensor  # flat int view of the version-independent bytes
    period: torch.Tensor | None  # int32, one per element
    phase: torch.Tensor | None  # int32, one per element, in [0, period)


class VersionedState:
    """``state(v)``: the model at version ``v`` (see the module docstring).

    ``elements`` sets the approximate total element count (at least 10,000).
    """

    def __init__(self, seed: int, elements: int) -> None:
        if elements < 10_000:
            raise ValueError(f"elements must be >= 10000, got {elements}")
        self.seed = seed
        self.elements = elements
        g = torch.Generator().manual_seed(seed)
        self._tensors: list[_Tensor] = []
        for spec in self._specs(elements):
            numel = math.prod(spec.shape)
            width = torch.empty((), dtype=spec.dtype).element_size()
            int_dtype = _INT_BY_WIDTH[width]
            raw = torch.randint(0, 256, (numel * width,), dtype=torch.uint8, generator=g)
            if spec.dtype == torch.bool:
                raw &= 1
            base = raw.view(int_dtype)
            period = phase = None
            if spec.period is not None:
                lo, hi = spec.period
                period = torch.randint(lo, hi + 1, (numel,), dtype=torch.int32, generator=g)
                phase = torch.randint(0, 1 << 20, (numel,), dtype=torch.int32, generator=g)
                phase %= period
            self._tensors.append(_Tensor(spec, base, period, phase))

    @staticmethod
    def _specs(elements: int) -> list[_Spec]:
        """Transformer-shaped: 12 layers of 4 small matrices plus extras, ~55 tensors in all, so
        a publish with small buckets writes one shard per tensor (buckets never split one)."""
        rows = max(1, elements // 64)
        bf16 = torch.bfloat16

        def matrix(
            name: str, frac: float, dtype: torch.dtype, period: tuple[int, int] | None
        ) -> _Spec:
            return _Spec(name, (max(1, int(rows * frac)), 64), dtype, period)

        specs = [matrix("model.embed_tokens.weight", 0.1, bf16, (16, 64))]
        for i in range(12):
            for part in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up", "mlp.down"):
                specs.append(matrix(f"model.layers.{i}.{part}.weight", 0.015, bf16, (16, 64)))
        specs += [
            _Spec("model.norm.weight", (256,), torch.float32, (1, 1)),  # dense every version
            matrix("model.frozen.weight", 0.05, bf16, None),
            matrix("model.prune_mask", 0.02, torch.bool, (8, 32)),
            matrix("model.o_proj.weight_fp8", 0.05, torch.float8_e4m3fn, (32, 128)),
            _Spec("model.counts", (1000,), torch.int8, (4, 16)),
            _Spec("model.empty", (0, 8), bf16, (16, 64)),
        ]
        return specs

    def state(self, version: int) -> dict[str, torch.Tensor]:
        """The state dict of ``version``: fresh contiguous tensors, bit-for-bit reproducible."""
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        out: dict[str, torch.Tensor] = {}
        for t in self._tensors:
            spec = t.spec
            if t.period is None or t.phase is None:
                flat = t.base.clone()
            else:
                k = torch.div(t.phase + version, t.period, rounding_mode="floor")
                if spec.dtype == torch.bool:
                    flat = (k & 1).to(torch.uint8)
                else:
                    flat = t.base ^ (k & 0x7F).to(t.base.dtype)
            out[spec.name] = flat.view(spec.dtype).reshape(spec.shape)
        out["model.step"] = torch.tensor(version, dtype=torch.int64)
        return out

    def __repr__(self) -> str:
        return f"<VersionedState seed={self.seed} elements~{self.elements}>"
