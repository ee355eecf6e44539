"""The one switch between the C kernels and the NumPy fallback, and the diff kernel's driver.

``kernels`` is the optional extension ``asyncsync.codec._native`` (``asyncsync/codec/_native.c``),
or None when it did not build or ``ASYNCSYNC_NATIVE=0`` is set. Every user (:mod:`asyncsync.codec`,
:mod:`asyncsync.codec.ef`) reads ``native.kernels`` at call time, so setting it to None (as the
tests do) sends all of them down the NumPy path, whose results are byte-identical.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from asyncsync.codec import scratch

__all__ = ["diff", "diff_many", "hash_bits", "hasher", "kernels", "load", "take"]


def load() -> Any:
    """``asyncsync.codec._native``, or None if disabled (``ASYNCSYNC_NATIVE=0``) or not built."""
    if os.environ.get("ASYNCSYNC_NATIVE", "1").strip() == "0":
        return None
    try:
        return importlib.import_module("asyncsync.codec._native")
    except ImportError:
        return None


kernels: Any = load()


_BITS = {"xxh3-128": 128, "xxh3-64": 64}


def hasher(algorithm: str) -> Any:
    """The C kernels' streaming XXH3 for ``algorithm`` (``xxh3-128``/``xxh3-64``: its digests are
    python-xxhash's), or None when the kernels are not loaded or predate it."""
    k = kernels
    bits = _BITS.get(algorithm)
    if k is None or bits is None or not hasattr(k, "Xxh3"):
        return None
    return k.Xxh3(bits)


def hash_bits(algorithm: str | None) -> int:
    """The XXH3 width :func:`diff_many` hashes for ``algorithm`` (64/128), or 0 for none."""
    return 0 if algorithm is None else _BITS.get(algorithm, 0)


def diff_many(
    olds: Sequence[NDArray[Any]],
    news: Sequence[NDArray[Any]],
    *,
    bits: int = 0,
    advance: bool = False,
) -> list[tuple[NDArray[Any], NDArray[Any], NDArray[Any], str | None]]:
    """:func:`diff` (with values) of many pairs of contiguous 1-D int arrays of one dtype in
    one call of the C kernel ``diff_many`` (which must be loaded): each pair's positions, new
    values, XORs and, with ``bits`` (64/128, :func:`hash_bits`), the hexdigest a
    :func:`hasher` fed in :func:`diff`'s pass would give; ``advance``: as :func:`diff`'s, and if
    this raises, every old is as it was.

    For small arrays (a MoE's thousands of experts): :func:`diff` costs ~8x its kernel's work
    in glue at 4 KiB. The outputs hold every element of the pairs (no pair stops short: keep
    the pairs' total small); the changes are copied out of them, one array each, and each
    pair's are views of those.
    """
    if not olds:
        return []
    dtype = olds[0].dtype
    total = sum(o.size for o in olds)
    pos, nv, xv = np.empty(total, np.int64), np.empty(total, dtype), np.empty(total, dtype)
    counts = np.empty(len(olds), np.int64)
    digests = np.empty(16 * len(olds) if bits else 0, np.uint8)
    got = kernels.diff_many(olds, news, dtype.itemsize, pos, nv, xv, counts, digests, bits, advance)
    try:
        pos, nv, xv = pos[:got].copy(), nv[:got].copy(), xv[:got].copy()
        hexes = digests.tobytes().hex()
        chars = bits // 4
        ends = np.cumsum(counts).tolist()
        out: list[tuple[NDArray[Any], NDArray[Any], NDArray[Any], str | None]] = []
        start = 0
        for j, end in enumerate(ends):
            digest = hexes[32 * j : 32 * j + chars] if bits else None
            out.append((pos[start:end], nv[start:end], xv[start:end], digest))
            start = end
        return out
    except BaseException:
        if advance:  # put back what the kernel advanced: old = new ^ (old ^ new)
            start = 0
            for old, end in zip(olds, np.cumsum(counts[: len(olds)]).tolist(), strict=True):
                old[pos[start:end]] = nv[start:end] ^ xv[start:end]
                start = end
        raise


def diff(
    old: NDArray[Any],
    new: NDArray[Any],
    values: bool,
    *,
    hasher: Any = None,
    advance: bool = False,
) -> list[NDArray[Any]]:
    """Where 1-D int arrays ``old`` and ``new`` differ, by the C kernel (which must be loaded):
    [positions (int64), new values there, ``old ^ new`` there], or [positions] only.

    ``hasher`` (from :func:`hasher`) is fed, in the same pass, the bytes the outputs make
    (``old`` with the changed elements of ``new`` put in: ``new`` as this pass read it, each
    element once, whatever another thread writes to it meanwhile); ``advance`` (needs
    ``values``) copies each changed element of ``new`` into ``old`` as the pass goes. Should
    anything fail midway, the elements already copied are put back, so ``old`` is unchanged.

    The outputs start at ``max(1024, numel // 16)`` elements (room for 6 % changed) and grow
    from where the kernel stopped, by the rate seen so far; they come from the scratch pool
    (:mod:`asyncsync.codec.scratch`: views of buffers whose pages are already faulted in) or,
    when it is full, are plain arrays trimmed in place at the end.
    """
    if advance and not values:
        raise ValueError("advance needs the values (they undo it)")
    cap = _initial_capacity(old.size)
    outs = [scratch.empty(cap, np.int64)]
    if values:
        outs += [scratch.empty(cap, old.dtype), scratch.empty(cap, old.dtype)]
    extra = () if hasher is None and not advance else (hasher, advance)
    tails = outs + ([] if values else [None, None])
    count, start = 0, 0
    try:
        if old.size:  # the first call on the outputs themselves (no tail views to make)
            count, start = kernels.diff_extract(old, new, old.itemsize, 0, *tails, *extra)
        del tails
        while start < old.size:
            if count == cap:  # full before the end: grow by the rate of change seen so far
                guess = count + int((old.size - start) * count / max(1, start) * 1.25)
                cap = min(old.size, max(2 * cap, 1, guess))
                outs = [_grown(a, count, cap) for a in outs]
            tails = [a[count:] for a in outs] + ([] if values else [None, None])
            got, start = kernels.diff_extract(old, new, old.itemsize, start, *tails, *extra)
            del tails  # no views may remain when the arrays are resized below
            count += got
    except BaseException:
        if advance:  # put back what the kernel advanced: old = new ^ (old ^ new)
            pos = outs[0][:count]
            old[pos] = outs[1][:count] ^ outs[2][:count]
        raise
    for a in outs:
        if a.base is None:  # a plain array (the scratch pool is full or off)
            a.resize(count, refcheck=False)  # realloc in place: frees the unused capacity
    return [a if a.base is None else a[:count] for a in outs]


def _grown(a: NDArray[Any], count: int, cap: int) -> NDArray[Any]:
    """A buffer of ``cap`` elements holding ``a``'s first ``count``."""
    out = scratch.empty(cap, a.dtype)
    out[:count] = a[:count]
    return out


def take(src: NDArray[Any], idx: NDArray[Any], out: NDArray[Any]) -> None:
    """``out[:] = src[idx]`` for a 1-D ``src`` and int64 ``idx``: the C kernel's ``gather``
    (bounds-checked, the GIL released, ~2x NumPy's ``take``) when loaded and the arrays suit
    it, else ``np.take`` (also for positions the kernel refuses, so errors and negative
    positions behave as NumPy's)."""
    k = kernels
    if (
        k is not None
        and src.ndim == 1
        and src.flags.c_contiguous
        and out.flags.c_contiguous
        and out.dtype == src.dtype
        and src.itemsize in (1, 2, 4, 8)
        and idx.dtype == np.int64
        and idx.flags.c_contiguous
        and out.shape == idx.shape
    ):
        try:
            k.gather(src, src.itemsize, idx, out)
            return
        except IndexError:
            pass
    np.take(src, idx, out=out)


def _initial_capacity(numel: int) -> int:
    """Output slots :func:`diff` starts with (tests shrink it to exercise the growth)."""
    return min(numel, max(1024, numel // 16))
