"""Routing a sparse XOR delta through a model's own ``load_weights``, with nothing written.

An inference engine keeps its weights fused and sliced (``qkv_proj``, ``gate_up_proj``, per
tensor-parallel rank slices, padded vocabularies, tied embeddings); only the model's own
``load_weights`` knows where each element of an HF-named tensor lands. :func:`route` runs that
code on one HF tensor under a thread-local :class:`torch.overrides.TorchFunctionMode` that
*records* every write into the model's parameters and executes none of them:

* ``param_view.copy_(src)`` where ``src`` holds only elements of the routed tensor (views,
  slices, ``contiguous``/``clone``/``cat`` copies, zero padding: values moved, never changed),
  with the same dtype and shape: an **xor** write. Routing a dense tensor that holds the XOR
  delta at the changed positions and zeros elsewhere, then executing the xor writes as
  ``dst.view(int) ^= src.view(int)``, changes exactly the changed bytes of every parameter
  slice (``b ^ 0 == b``), on every rank, whatever the fusing and slicing
  (:func:`apply_xor`). Routing the complete new tensor instead and *comparing* gives an exact
  audit of what the engine serves (:func:`compare`).
* ``param_view.copy_(other_param_view)`` (a loader that copies one parameter into another,
  e.g. a tied ``lm_head`` after the embedding): a **copy** write, executed in order.
* ``param_view.fill_(constant)`` / ``zero_()`` (padding rows): a **keep** write; the constant
  is already there since the last full load, so nothing is done.

Everything else is a *problem*, and the routing stops before anything is written: a copy
that converts dtype or broadcasts, a value computed from the delta (arithmetic, scaling,
quantization), a value that passed through Python (``.item()``: SGLang's
``default_weight_loader`` fills one-element parameters that way), any other in-place op on a
parameter, a rebinding of ``param.data``, overlapping writes (a region written twice in a
full load holds the last value, an XOR of both is wrong). The caller then loads that tensor
whole, as the engine always did. A ``guard`` (the engine's rule for parameters whose loaded
bytes are transformed afterwards, e.g. ``process_weights_after_loading`` packing) refuses
writes into the parameters it names.

Routes are pure functions of names, shapes and dtypes for the loaders this accepts, so a
route computed once on a zero tensor (:func:`probe_tensor`: an expanded scalar, no memory)
predicts the writes of every later route of that name (:meth:`Route.footprint`).

Engine-agnostic: it needs only ``load_weights(iterable of (name, tensor))``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch.overrides import TorchFunctionMode, resolve_name

from asyncsync.codec import int_view

__all__ = [
    "Guard",
    "ModelParams",
    "Route",
    "Write",
    "apply_xor",
    "compare",
    "probe_tensor",
    "route",
]

logger = logging.getLogger(__name__)

#: the engine's veto: (parameter name, owning module) -> why writes into it are no copies
Guard = Callable[[str, Any], "str | None"]
LoadWeights = Callable[[Iterable[tuple[str, torch.Tensor]]], Any]
StorageKey = tuple[str, int]

T = torch.Tensor
# ops whose result holds only elements of their tensor inputs, moved or copied, never changed
# (a dtype-changing result is refused separately)
_MOVES = {
    T.narrow, T.view, T.view_as, T.reshape, T.reshape_as, T.t, T.transpose, T.permute, T.select,
    T.__getitem__, T.unsqueeze, T.squeeze, T.flatten, T.unflatten, T.expand, T.expand_as,
    T.chunk, T.split, T.split_with_sizes, T.unbind, T.tensor_split, T.contiguous, T.clone,
    T.detach, T.cpu, T.cuda, T.movedim, T.swapaxes, T.swapdims, T.index_select, T.flip, T.roll,
    T.repeat, T.narrow_copy, T.to, T.float, T.half, T.bfloat16, T.double, T.type_as,
    T.pin_memory, T.data.__get__, T.T.__get__, T.mT.__get__,  # type: ignore[attr-defined]
    torch.cat, torch.concat, torch.concatenate, torch.stack, torch.narrow, torch.transpose,
    torch.chunk, torch.split, torch.reshape, torch.flatten, torch.squeeze, torch.unsqueeze,
    torch.index_select, torch.t, torch.permute, torch.select, torch.flip, torch.roll,
    torch.tensor_split, torch.unbind, torch.movedim, torch.clone,
}  # fmt: skip
_ZEROS = {torch.zeros, torch.zeros_like, T.new_zeros}
# answers about shape, layout or identity, not about values
_METADATA = {
    T.size, T.dim, T.numel, T.stride, T.storage_offset, T.is_contiguous, T.element_size,
    T.nelement, T.ndimension, T.data_ptr, T.untyped_storage, T.is_floating_point, T.is_complex,
    T.get_device, T.__len__, T.__repr__, T.__format__, T.__hash__,
    T.shape.__get__, T.dtype.__get__, T.device.__get__, T.ndim.__get__,  # type: ignore[attr-defined]
    T.is_cuda.__get__, T.requires_grad.__get__, T.is_leaf.__get__,  # type: ignore[attr-defined]
    T.is_meta.__get__, T.layout.__get__,  # type: ignore[attr-defined]
}  # fmt: skip
_KEEPS = {T.fill_, T.zero_}
_NOT_INPLACE = ("__index__", "__int__", "__invert__", "__iter__")


@dataclass
class Write:
    """One recorded write into a parameter: ``xor`` (``dst ^= src`` bitwise, or for an audit
    ``dst == src``), ``copy`` (``dst.copy_(src)``, another parameter's view) or ``keep``
    (a constant the last full load wrote; nothing to do)."""

    kind: Literal["xor", "copy", "keep"]
    param: str
    dst: torch.Tensor
    src: torch.Tensor | None
    span: tuple[StorageKey, int, int]  # storage, first and last+1 byte written


@dataclass
class Route:
    """What ``load_weights`` would write for one HF tensor (see the module docstring)."""

    name: str
    writes: list[Write] = field(default_factory=list)
    problem: str | None = None
    #: the loader changed the model outside the recorded writes (a rebound parameter): the
    #: model is no longer what it held, only a full reload is safe
    altered: bool = False
    #: the problem is an exception the loader raised (may not happen again: not a property of
    #: the loader's routing)
    raised: bool = False

    @property
    def ok(self) -> bool:
        return self.problem is None and not self.altered

    def footprint(self) -> tuple[tuple[str, str, int, int], ...]:
        """(kind, parameter, first byte, last byte + 1) of each write, in order."""
        return tuple((w.kind, w.param, w.span[1], w.span[2]) for w in self.writes)

    def params(self) -> set[str]:
        return {w.param for w in self.writes}


class ModelParams:
    """The storages of a model's parameters and buffers, by storage, with their owners."""

    def __init__(self, model: Any):
        self.model = model
        self.by_storage: dict[StorageKey, tuple[str, Any]] = {}
        for mname, module in _named_modules(model):
            tensors = [
                *getattr(module, "_parameters", {}).items(),
                *getattr(module, "_buffers", {}).items(),
            ]
            for pname, t in tensors:
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    full = f"{mname}.{pname}" if mname else pname
                    self.by_storage.setdefault(storage_key(t), (full, module))
        self.signature = self._signature()

    def _signature(self) -> tuple[tuple[Any, ...], ...]:
        return tuple(
            (name, storage_key(p), tuple(p.shape), p.stride(), p.dtype)
            for name, p in _named_tensors(self.model)
        )

    def unchanged(self) -> bool:
        """Every parameter still has the storage, shape, strides and dtype it had."""
        return self._signature() == self.signature

    def owner(self, t: torch.Tensor) -> tuple[str, Any] | None:
        if t.device.type == "meta":
            return None
        return self.by_storage.get(storage_key(t))


def storage_key(t: torch.Tensor) -> StorageKey:
    return (str(t.device), t.untyped_storage().data_ptr())


def span(t: torch.Tensor) -> tuple[int, int]:
    """First and last+1 byte of ``t``'s elements in its storage (a conservative hull)."""
    e = t.element_size()
    start = int(t.storage_offset()) * e
    if t.numel() == 0:
        return start, start
    extent = sum((int(s) - 1) * int(st) for s, st in zip(t.shape, t.stride(), strict=True))
    return start, start + (extent + 1) * e


def probe_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: Any = "cpu") -> torch.Tensor:
    """A zero tensor of ``shape`` that costs one element (an expanded scalar), for probing."""
    return torch.zeros((), dtype=dtype, device=device).expand(shape)


class _Stop(Exception):
    """Raised inside load_weights to end a routing at its first problem."""


class _Recorder(TorchFunctionMode):
    """The mode behind :func:`route` (thread-local: other threads run untouched)."""

    def __init__(self, params: ModelParams, routed: torch.Tensor, guard: Guard | None):
        super().__init__()
        self.params = params
        self.guard = guard
        self.pure: set[StorageKey] = {storage_key(routed)}
        self.keep_alive: list[torch.Tensor] = [routed]  # so storage pointers are not reused
        self.writes: list[Write] = []
        self.tainted: str | None = None

    # -- helpers -----------------------------------------------------------------------------
    def is_pure(self, t: Any) -> bool:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return False
        return storage_key(t) in self.pure

    def mark_pure(self, out: Any) -> None:
        for t in _tensors(out):
            if t.device.type != "meta":
                self.pure.add(storage_key(t))
                self.keep_alive.append(t)

    def stop(self, why: str) -> None:
        raise _Stop(why)

    def record(self, kind: Literal["xor", "copy", "keep"], dst: T, src: T | None) -> None:
        owner = self.params.owner(dst)
        assert owner is not None
        pname, module = owner
        if self.guard is not None and (why := self.guard(pname, module)) is not None:
            self.stop(f"parameter {pname}: {why}")
        start, end = span(dst)
        w = Write(kind, pname, dst, src, (storage_key(dst), start, end))
        for prev in self.writes:
            overlap = prev.span[0] == w.span[0] and start < prev.span[2] and prev.span[1] < end
            # a constant written before a copy is overwritten by it in a full load too (the
            # padding-then-rows pattern); any other overlap is order-dependent
            if overlap and prev.kind != "keep":
                self.stop(f"parameter {pname}: bytes {start}..{end} are written twice")
        self.writes.append(w)

    # -- the mode ----------------------------------------------------------------------------
    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA:
            return func(*args, **kwargs)
        fname = _name(func)
        target = self._written(func, fname, args, kwargs)
        if target is not None:
            return self._in_place(func, fname, target, args, kwargs)
        out = func(*args, **kwargs)
        if func in _ZEROS:
            self.mark_pure(out)
        elif func in _MOVES:
            inputs = _data_inputs(func, args, kwargs)
            if (
                inputs
                and all(self.is_pure(t) for t in inputs)
                and all(o.dtype == inputs[0].dtype for o in _tensors(out))
            ):
                self.mark_pure(out)
        elif func is torch.nn.functional.pad and self.is_pure(args[0]):
            mode = kwargs.get("mode", args[2] if len(args) > 2 else "constant")
            value = kwargs.get("value", args[3] if len(args) > 3 else None)
            if mode == "constant" and not value:
                self.mark_pure(out)
        elif not _tensors(out) and any(self.is_pure(t) for t in _tensors((args, kwargs))):
            # a value of the delta left torch (.item(), .tolist(), bool(...)): whatever the
            # loader does with it cannot be followed
            self.tainted = self.tainted or fname
        return out

    def _written(
        self, func: Any, fname: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> torch.Tensor | None:
        """The tensor an op writes in place (None: it writes nothing we track)."""
        out = kwargs.get("out")
        if isinstance(out, torch.Tensor):
            return out
        leaf = fname.rsplit(".", 1)[-1]
        inplace = (
            (leaf.endswith("_") and not leaf.endswith("__"))
            or leaf in ("__setitem__", "__set__")
            or (leaf.startswith("__i") and leaf.endswith("__") and leaf not in _NOT_INPLACE)
        )
        schema = getattr(func, "_schema", None)
        if schema is not None and getattr(schema, "is_mutable", False):
            for a in args:
                if isinstance(a, torch.Tensor) and self.params.owner(a) is not None:
                    return a
        if inplace and args and isinstance(args[0], torch.Tensor):
            return args[0]
        return None

    def _in_place(
        self,
        func: Any,
        fname: str,
        dst: torch.Tensor,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        owner = self.params.owner(dst)
        if owner is not None:
            pname = owner[0]
            if func is T.copy_:
                self._param_copy(pname, dst, args[1])
                return dst
            if func in _KEEPS:
                value = args[1] if len(args) > 1 else kwargs.get("value", 0)
                if self.tainted:
                    self.stop(
                        f"parameter {pname}: {fname} of a value that left torch "
                        f"({self.tainted}): not a copy"
                    )
                if isinstance(value, torch.Tensor) and self.is_pure(value):
                    self.stop(f"parameter {pname}: {fname} of a value of the delta")
                self.record("keep", dst, None)
                return dst
            self.stop(f"parameter {pname}: written by {fname}, not a copy")
        if self.is_pure(dst):
            src = args[1] if len(args) > 1 else None
            same = isinstance(src, T) and self.is_pure(src) and _same_layout(dst, src)
            if func is T.copy_ and same:
                return func(*args, **kwargs)
            if func is T.zero_ or (func is T.fill_ and not (src if src is not None else 0)):
                return func(*args, **kwargs)
            self.stop(f"the loader changes the routed values in place ({fname})")
        return func(*args, **kwargs)  # a buffer of the loader's own

    def _param_copy(self, pname: str, dst: torch.Tensor, src: Any) -> None:
        if not isinstance(src, torch.Tensor):
            self.stop(f"parameter {pname}: copy_ of a {type(src).__name__}")
        if self.is_pure(src):
            if src.dtype != dst.dtype:
                self.stop(f"parameter {pname}: copy_ converts {src.dtype} to {dst.dtype}")
            if tuple(src.shape) != tuple(dst.shape):
                shapes = f"{tuple(src.shape)} into {tuple(dst.shape)}"
                self.stop(f"parameter {pname}: copy_ broadcasts {shapes}")
            self.record("xor", dst, src)
            return
        if self.params.owner(src) is not None:
            if _same_view(src, dst):
                return  # a parameter copied onto itself (tied): nothing happens
            if src.dtype != dst.dtype or tuple(src.shape) != tuple(dst.shape):
                self.stop(f"parameter {pname}: copy_ from another parameter converts or broadcasts")
            self.record("copy", dst, src)
            return
        self.stop(
            f"parameter {pname}: the value copied in is computed from the delta (a conversion, "
            "scaling or quantization), not a copy of its elements"
        )


_NAMES: dict[Any, str] = {}


def _name(func: Any) -> str:
    """``resolve_name(func)``, cached (it is asked for every op under the mode)."""
    try:
        return _NAMES[func]
    except KeyError:
        name = _NAMES[func] = resolve_name(func) or repr(func)
        return name
    except TypeError:  # an unhashable callable
        return resolve_name(func) or repr(func)


def _tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors in ``obj`` (a tensor, or nested tuples, lists and dict values)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, tuple | list):
        return [t for x in obj for t in _tensors(x)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in _tensors(x)]
    return []


def _data_inputs(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors whose values an op of :data:`_MOVES` moves (not its index arguments)."""
    if func in (torch.cat, torch.concat, torch.concatenate, torch.stack):
        seq = args[0] if args else kwargs.get("tensors", ())
        return [t for t in seq if isinstance(t, torch.Tensor)]
    first = args[0] if args else kwargs.get("input")
    return [first] if isinstance(first, torch.Tensor) else []


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        storage_key(a) == storage_key(b)
        and a.storage_offset() == b.storage_offset()
        and a.stride() == b.stride()
        and tuple(a.shape) == tuple(b.shape)
        and a.dtype == b.dtype
    )


def _named_modules(model: Any) -> Iterator[tuple[str, Any]]:
    named = getattr(model, "named_modules", None)
    if callable(named):
        yield from named(remove_duplicate=False)
    else:
        yield "", model


def _named_tensors(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    for mname, module in _named_modules(model):
        for kind in ("_parameters", "_buffers"):
            for pname, t in getattr(module, kind, {}).items():
                if isinstance(t, torch.Tensor):
                    yield (f"{mname}.{pname}" if mname else pname), t


_local = threading.local()


def route(
    load_weights: LoadWeights,
    name: str,
    tensor: torch.Tensor,
    params: ModelParams,
    *,
    guard: Guard | None = None,
) -> Route:
    """Run ``load_weights([(name, tensor)])`` recording, not executing, its parameter writes.

    Never writes a parameter. Returns the :class:`Route`; ``route.problem`` says why the
    tensor's loader is not a pure copy (then ``writes`` is incomplete and must not be used).
    An exception inside ``load_weights`` is a problem too (its message kept).
    """
    if getattr(_local, "active", False):
        raise RuntimeError("route() is not re-entrant")
    rec = _Recorder(params, tensor, guard)
    result = Route(name)
    _local.active = True
    try:
        with rec:
            load_weights([(name, tensor)])
        if rec.tainted and not rec.writes:
            pass  # a value read, nothing written from it
    except _Stop as exc:
        result.problem = str(exc)
    except Exception as exc:  # the loader failed on this input: not routable
        result.problem = f"load_weights raised {type(exc).__name__}: {exc}"
        result.raised = True
    finally:
        _local.active = False
    if not params.unchanged():
        result.altered = True
        result.problem = result.problem or "the loader rebound or replaced a parameter"
    if result.problem is None:
        result.writes = rec.writes
    return result


def apply_xor(r: Route) -> int:
    """Execute a route's writes (xor in place on int views, copies in order); returns the bytes
    XORed. Only for a route without a problem."""
    if not r.ok:
        raise ValueError(f"route of {r.name} has a problem: {r.problem}")
    done = 0
    for w in r.writes:
        if w.kind == "xor":
            assert w.src is not None
            src = w.src if w.src.device == w.dst.device else w.src.to(w.dst.device)
            _ints(w.dst).bitwise_xor_(_ints(src))
            done += w.dst.numel() * w.dst.element_size()
        elif w.kind == "copy":
            assert w.src is not None
            w.dst.copy_(w.src)
    return done


def compare(r: Route) -> str | None:
    """For a route of a tensor's complete bytes: None when every parameter slice it writes
    holds exactly those bytes, else a description of the first that does not."""
    if not r.ok:
        raise ValueError(f"route of {r.name} has a problem: {r.problem}")
    for w in r.writes:
        if w.kind == "keep":
            continue
        assert w.src is not None
        src = w.src if w.src.device == w.dst.device else w.src.to(w.dst.device)
        if not torch.equal(_ints(w.dst), _ints(src)):
            diff = int((_ints(w.dst) != _ints(src)).sum())
            return f"{w.param} (bytes {w.span[1]}..{w.span[2]}): {diff} element(s) differ"
    return None


def _ints(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as the same-width integer dtype, keeping its shape and strides."""
    want = int_view(torch.empty(0, dtype=t.dtype)).dtype
    return t if t.dtype == want else t.view(want)
