"""A sparse in-place apply: the changed positions of an HF tensor mapped straight into the
engine's parameters, through the views its ``load_weights`` takes.

:func:`receiver.plugins.routing.route` records, for one HF tensor, each write ``dst.copy_(src)``
its loader would make. When the routed tensor is a plain contiguous tensor and every ``src`` is
a *view* of it (``narrow``, ``select``, ``transpose``, ``view``: what SGLang's linear and
embedding loaders take), each write is an affine map from HF element indices to parameter
element indices: ``src`` covers the HF elements ``off + sum(i_k * s_k)`` and ``dst`` the
parameter elements ``off' + sum(i_k * s'_k)`` for the same multi-index ``i``.
:func:`make_plan` keeps those maps (a :class:`Plan`); :func:`apply_plan` then XORs a delta's
values into the parameters at exactly the mapped positions: O(changed elements), no dense
tensor, no routing, on the parameters' device. A write whose ``src`` is a copy (the loader
called ``contiguous`` on a non-contiguous slice, concatenated, padded) has no such map: no plan,
and the caller routes the dense XOR instead. XOR is its own inverse, so applying a plan twice
restores the bytes (the undo).

Engine-agnostic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncsync.codec import Patch, apply_patch, int_view, native
from receiver.plugins.routing import Route, storage_key

__all__ = [
    "CopyStep",
    "Plan",
    "Probe",
    "XorStep",
    "apply_plan",
    "conflicts",
    "independent",
    "make_plan",
]


@dataclass(frozen=True)
class XorStep:
    """XOR values into one parameter view: HF index ``src_offset + sum(i_k * src_strides[k])``
    goes to element ``dst_offset + sum(i_k * dst_strides[k])`` of ``flat`` (the whole storage
    of the parameter as its integer dtype); dims sorted by ``src_strides``, descending."""

    param: str
    flat: torch.Tensor
    dst_offset: int
    dst_strides: tuple[int, ...]
    src_offset: int
    src_strides: tuple[int, ...]
    sizes: tuple[int, ...]
    #: both views are one contiguous block (a row range: a fused shard, a TP row slice, a
    #: whole tensor): HF index ``i`` lands at ``i - src_offset + dst_offset``
    block: bool = False

    @property
    def extent(self) -> int:
        """One past the last HF index the view covers."""
        return self.src_offset + sum((n - 1) * s for n, s in zip(self.sizes, self.src_strides,
                                                                  strict=True)) + 1  # fmt: skip


@dataclass(frozen=True)
class CopyStep:
    """A copy from another parameter, replayed in order (a tied ``lm_head`` after the
    embedding)."""

    dst: torch.Tensor
    src: torch.Tensor


@dataclass(frozen=True)
class Plan:
    """How one HF tensor's changed positions land in the parameters (see the module)."""

    name: str
    steps: tuple[XorStep | CopyStep, ...]


@dataclass(frozen=True)
class Probe:
    """How one HF tensor routes into the model (on a zero tensor): its writes, or why not."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    footprint: tuple[tuple[str, str, int, int], ...] = ()
    problem: str | None = None
    plan: Plan | None = None  # the sparse map of its positions (None: route the dense XOR)


def make_plan(route: Route, routed: torch.Tensor) -> Plan | None:
    """The plan of ``route`` (a route of ``routed``, a contiguous tensor), or None when a write
    takes anything but a view of ``routed``."""
    if not route.ok or not routed.is_contiguous() or routed.storage_offset() != 0:
        return None
    key, item = storage_key(routed), routed.element_size()
    steps: list[XorStep | CopyStep] = []
    flats: dict[tuple[str, int], torch.Tensor] = {}
    for w in route.writes:
        if w.kind == "keep":
            continue
        assert w.src is not None
        if w.kind == "copy":
            steps.append(CopyStep(w.dst, w.src))
            continue
        src, dst = w.src, w.dst
        if storage_key(src) != key or src.element_size() != item or dst.element_size() != item:
            return None  # a copy of the routed tensor, or a reinterpretation: no affine map
        dims = [d for d in range(src.dim()) if src.shape[d] != 1]
        if any(src.stride(d) <= 0 for d in dims):
            return None  # broadcast (stride 0): one HF element, several destinations
        dims.sort(key=lambda d: src.stride(d), reverse=True)
        sizes = tuple(int(src.shape[d]) for d in dims)
        s_str = tuple(int(src.stride(d)) for d in dims)
        if not _nested(sizes, s_str):
            return None
        dkey = storage_key(dst)
        flat = flats.get(dkey)
        if flat is None:
            flat = flats[dkey] = _storage_ints(dst)
        d_str = tuple(int(dst.stride(d)) for d in dims)
        steps.append(
            XorStep(
                param=w.param,
                flat=flat,
                dst_offset=int(dst.storage_offset()),
                dst_strides=d_str,
                src_offset=int(src.storage_offset()),
                src_strides=s_str,
                sizes=sizes,
                block=s_str == d_str == _contiguous(sizes),
            )
        )
    return Plan(route.name, tuple(steps))


def _contiguous(sizes: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(sizes):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def _nested(sizes: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Each stride exceeds the largest offset the smaller dims reach: the multi-index of an HF
    index is then found by successive division (an injective view)."""
    reach = 0
    for n, s in zip(reversed(sizes), reversed(strides), strict=True):
        if s <= reach:
            return False
        reach += (n - 1) * s
    return True


def _storage_ints(t: torch.Tensor) -> torch.Tensor:
    """The whole storage of ``t`` as a 1-D tensor of the integer dtype of its element width."""
    idt = int_view(torch.empty(0, dtype=t.dtype)).dtype
    storage = t.untyped_storage()
    n = storage.nbytes() // t.element_size()
    return torch.empty(0, dtype=idt, device=t.device).set_(storage, 0, (n,), (1,))


def apply_plan(plan: Plan, positions: torch.Tensor, values: torch.Tensor) -> int:
    """XOR ``values`` (the int dtype of the tensor's width) at the sorted flat HF ``positions``
    (int32 or int64, on the parameters' device) into the parameters, as ``plan`` maps them;
    copies in order. Returns the elements XORed (a rank holds only its slice: fewer than
    positions)."""
    done = 0
    for step in plan.steps:
        if isinstance(step, CopyStep):
            step.dst.copy_(step.src)
            continue
        lo = int(torch.searchsorted(positions, step.src_offset))
        hi = int(torch.searchsorted(positions, step.extent))
        if lo >= hi:
            continue
        if step.block:  # the common case: one slice
            _xor_block(step, positions[lo:hi], values[lo:hi])
            done += hi - lo
            continue
        rem = positions[lo:hi].long() - step.src_offset
        vals = values[lo:hi]
        dst = torch.full_like(rem, step.dst_offset)
        ok: torch.Tensor | None = None
        for n, s, ds in zip(step.sizes, step.src_strides, step.dst_strides, strict=True):
            q = torch.div(rem, s, rounding_mode="floor")
            rem = rem - q * s
            inside = q < n
            ok = inside if ok is None else ok & inside
            dst += q * ds
        if step.src_strides and step.src_strides[-1] > 1:  # gaps between the view's elements
            ok = rem == 0 if ok is None else ok & (rem == 0)
        if ok is not None and not bool(ok.all()):
            dst, vals = dst[ok], vals[ok]
        if dst.numel():
            step.flat[dst] = step.flat[dst] ^ vals
            done += int(dst.numel())
    return done


def _xor_block(step: XorStep, positions: torch.Tensor, values: torch.Tensor) -> None:
    """HF index ``i`` of ``positions`` XORs element ``i - src_offset + dst_offset`` of the
    parameter's storage: one C pass over the positions as they are (int32 or int64, no
    shifted copy) on CPU, else the codec's patch."""
    k = native.kernels
    flat = step.flat
    if (
        k is not None
        and hasattr(k, "xor_shifted")
        and flat.device.type == "cpu"
        and positions.device.type == "cpu"
        and positions.is_contiguous()
        and values.is_contiguous()
    ):
        k.xor_shifted(flat.numpy(), flat.element_size(), positions.numpy(),
                      positions.element_size(), step.dst_offset - step.src_offset,
                      values.numpy())  # fmt: skip
        return
    n = step.extent - step.src_offset
    block = flat[step.dst_offset : step.dst_offset + n]
    apply_patch(block, Patch("xor", positions.long() - step.src_offset, values))


def independent(probe: Probe) -> bool:
    """A plan of XORs only (a copy step reads another parameter: it keeps its place in order)."""
    return probe.plan is not None and all(isinstance(s, XorStep) for s in probe.plan.steps)


def conflicts(probes: dict[str, Probe]) -> dict[str, str]:
    """Names whose writes overlap another name's (a full load's order decides those bytes)."""
    spans = sorted(
        (param, start, end, name)
        for name, p in probes.items()
        for kind, param, start, end in p.footprint
        if kind != "keep" and end > start
    )
    out: dict[str, str] = {}
    cur: tuple[str, int, str] | None = None  # (param, furthest end so far, its name)
    for param, start, end, name in spans:
        if cur is not None and cur[0] == param and start < cur[1] and cur[2] != name:
            why = f"tensors {cur[2]} and {name} write the same bytes of {param}"
            out.setdefault(cur[2], why)
            out.setdefault(name, why)
        if cur is None or cur[0] != param or end > cur[1]:
            cur = (param, end, name)
    return out
