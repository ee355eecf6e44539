"""Patch a tensor and checksum its complete new bytes in one pass over its pages.

A receiver that patches a tensor in place must then verify the tensor's complete bytes against
the manifest (docs/FORMAT.md, section 8). Done one after the other, that is two passes over
every page of the tensor: at ~3 % density every 4 KiB page of a bf16 tensor is patched, so the
pages have left the caches when the hash reads them again (at 1 GiB: patch 0.17 s, then
XXH3 over 1 GiB 0.10 s). :func:`patch_and_checksum` walks the tensor in chunks of
:data:`CHUNK_BYTES` instead: it patches the positions inside a chunk (the native kernel, or
NumPy), then feeds the same chunk to the streaming hash while it is still in cache. The digest
is that of :func:`asyncsync.format.checksum.layout_checksum` over the patched bytes, by
construction: a streaming hash over the tensor in order, or one per part for a tensor
published in parts, combined as :func:`~asyncsync.format.checksum.parts_checksum` does.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from asyncsync.codec import native
from asyncsync.codec.patch import Patch, apply_patch
from asyncsync.errors import ConfigError
from asyncsync.format.checksum import layout_checksum, new_hasher, parts_checksum, tensor_bytes

__all__ = [
    "CHUNK_BYTES",
    "Journal",
    "JournalPass",
    "can_journal_in_pass",
    "journal_pass",
    "journal_patch",
    "patch_and_checksum",
]

#: Where the patch kernel saves what it overwrites (see ``journal`` of
#: :func:`patch_and_checksum`): an open file, the offset of this tensor's old values in it, and
#: the offset of its int64 count of values saved.
Journal = tuple[int, int, int]

#: Bytes patched and then hashed at a time: well inside a core's L2 (512 KiB here).
CHUNK_BYTES = 256 << 10


def patch_and_checksum(
    flat: torch.Tensor,
    patch: Patch,
    algorithm: str,
    layout: Sequence[tuple[int, int]] | None = None,
    *,
    old_out: torch.Tensor | None = None,
    journal: Journal | None = None,
) -> str:
    """:func:`~asyncsync.codec.apply_patch` ``patch`` to ``flat`` (a 1-D int view), and return the
    checksum of ``flat``'s complete new bytes as a manifest entry records it (``layout``: the
    ``(offset, numel)`` of its parts, or None), in one pass where it can.

    ``old_out``: as :func:`~asyncsync.codec.apply_patch`'s, the values the patch overwrites
    (``flat[positions]``, or all of ``flat`` for a dense patch), saved in the same pass.

    ``journal``: ``(fd, values_at, progress_at)``: the C kernel saves the values the patch
    overwrites into that file as it goes, a chunk's worth before the chunk is written (the k-th
    position's at ``values_at + k * itemsize``, a dense patch's element i's at ``values_at + i *
    itemsize``) and, after each chunk's, the count saved so far as an int64 at ``progress_at``;
    ConfigError unless :func:`can_journal_in_pass` (then nothing is written).

    Identical in effect and result to ``apply_patch(flat, patch, old_out=old_out)`` followed by
    ``layout_checksum(bytes of flat, itemsize, layout, algorithm)``, which is what it does for
    what the single pass does not take: a tensor off the CPU or not contiguous, positions not
    known to be strictly increasing, parts that overlap or leave the tensor.
    """
    if flat.dim() != 1 or flat.dtype != patch.values.dtype:
        raise ConfigError(
            f"patch of {patch.values.dtype} cannot apply to {flat.dtype}{list(flat.shape)}"
        )
    if patch.op not in ("set", "xor"):
        raise ConfigError(f"unknown patch op {patch.op!r}")
    parts = _parts(layout, flat.numel())
    pos = patch.positions
    want = flat.numel() if pos is None else pos.numel()
    if old_out is not None and (old_out.dtype != flat.dtype or old_out.shape != (want,)):
        raise ConfigError(
            f"old_out must be {flat.dtype}[{want}], got {old_out.dtype}{old_out.shape}"
        )
    if journal is not None:  # (journal_pass: the single pass, every count checked)
        if old_out is not None:
            raise ConfigError("old_out and journal: the old values go to one or the other")
        digest = _need_pass(journal_pass(flat, patch, algorithm, layout)).run(journal)
        assert digest is not None
        return digest
    if not _one_pass(flat, patch, parts, old_out):
        apply_patch(flat, patch, old_out=old_out)
        return layout_checksum(tensor_bytes(flat), flat.element_size(), layout, algorithm)
    assert parts is not None
    if patch.values.numel() != want:
        what = "dense patch of" if pos is None else f"{want} positions but"
        raise ConfigError(f"{what} {patch.values.numel()} values for {flat.numel()}")
    old: Any = None if old_out is None else old_out.numpy()
    return _single_pass(flat, patch, algorithm, parts, layout is not None, old)


def journal_patch(flat: torch.Tensor, patch: Patch, journal: Journal) -> None:
    """:func:`patch_and_checksum` with ``journal``, without the checksum: ``patch`` applied to
    ``flat``, the values it overwrites saved into the journal as it goes (at the same offsets),
    no hash taken (a pass over a tensor that a later patch changes again, whose digest would
    be thrown away). ConfigError unless ``can_journal_in_pass(flat, patch, None)`` (then nothing
    is written)."""
    _need_pass(journal_pass(flat, patch, None)).run(journal)


def can_journal_in_pass(
    flat: torch.Tensor,
    patch: Patch,
    algorithm: str | None,
    layout: Sequence[tuple[int, int]] | None = None,
) -> bool:
    """Whether :func:`patch_and_checksum` can take ``journal`` for this patch (``algorithm``
    None: :func:`journal_patch`, no hash): the C kernels are loaded, hash ``algorithm`` and the
    patch takes the single pass (a contiguous CPU tensor of the patch's dtype, positions
    strictly increasing, parts that neither overlap nor leave it). A caller that then makes
    the pass takes :func:`journal_pass` instead (the checks made once)."""
    return journal_pass(flat, patch, algorithm, layout) is not None


@dataclass(frozen=True, slots=True, eq=False)
class JournalPass:
    """One patch checked to save its old values in its own pass (:func:`journal_pass` makes
    it): :meth:`run` makes the pass with the checks and the NumPy views already taken. Checking
    and then passing through :func:`patch_and_checksum` checked twice, which cost more than the
    patch itself at a MoE model's tens of thousands of tensors of a few KiB."""

    patch: Patch
    algorithm: str | None
    parts: list[tuple[int, int]]
    composite: bool  # a tensor published in parts: the digest combines the parts'
    arr: Any  # the NumPy views of the target, the values and the positions (None: dense)
    vals: Any
    pos: Any

    def run(self, journal: Journal) -> str | None:
        """The pass of :func:`patch_and_checksum` with ``journal`` (of :func:`journal_patch`
        where ``algorithm`` is None: then None is returned)."""
        return _native_pass(
            self.arr, self.vals, self.pos, self.patch.op == "xor", self.algorithm, self.parts,
            self.composite, None, journal,
        )  # fmt: skip


def journal_pass(
    flat: torch.Tensor,
    patch: Patch,
    algorithm: str | None,
    layout: Sequence[tuple[int, int]] | None = None,
) -> JournalPass | None:
    """The checked pass of ``patch`` over ``flat`` that saves its old values into a journal
    as it goes (``algorithm``: as :func:`patch_and_checksum`'s, None for no hash), or None
    where :func:`can_journal_in_pass` says it cannot."""
    k = native.kernels
    if (
        k is None
        or not hasattr(k, "journal_patch_hash")
        or (algorithm is not None and native.hasher(algorithm) is None)
        or flat.dim() != 1
        or flat.dtype != patch.values.dtype
        or patch.op not in ("set", "xor")
    ):
        return None
    pos, numel = patch.positions, flat.numel()
    if patch.values.numel() != (numel if pos is None else pos.numel()):
        return None
    parts = _parts(layout, numel)
    if parts is None or not _one_pass(flat, patch, parts, None):
        return None
    pos_arr, vals_arr = patch.arrays()
    return JournalPass(
        patch, algorithm, parts, layout is not None, flat.numpy(), vals_arr, pos_arr
    )  # fmt: skip


def _need_pass(p: JournalPass | None) -> JournalPass:
    if p is None:
        raise ConfigError("this patch cannot save its old values in its own pass")
    return p


def _one_pass(
    flat: torch.Tensor,
    patch: Patch,
    parts: list[tuple[int, int]] | None,
    old_out: torch.Tensor | None,
) -> bool:
    """The patch and its hash fit one pass over ``flat`` (else: patch, then hash)."""
    pos = patch.positions
    trust = old_out is None and parts == [(0, flat.numel())]  # one kernel call: checked first
    return not (
        parts is None
        or flat.device.type != "cpu"
        or not flat.is_contiguous()
        or patch.values.device.type != "cpu"
        or not patch.values.is_contiguous()
        or (old_out is not None and (old_out.device.type != "cpu" or not old_out.is_contiguous()))
        # the blob's word is taken only where a bad position cannot half-apply the tensor: the
        # whole tensor one range (patch_hash checks every position first; journal_patch_hash
        # checks each chunk's before the chunk writes, the chunks before it journaled), no
        # old values to fill
        or (pos is not None and not _increasing(patch, pos, flat.numel(), trust=trust))
    )


def _parts(layout: Sequence[tuple[int, int]] | None, numel: int) -> list[tuple[int, int]] | None:
    """The parts sorted, or None where they overlap or leave ``[0, numel)`` (the two-pass path
    then hashes exactly what layout_checksum would)."""
    if layout is None:
        return [(0, numel)]
    parts = sorted((int(o), int(n)) for o, n in layout)
    end = 0
    for o, n in parts:
        if o < end or n < 0 or o + n > numel:
            return None
        end = o + n
    return parts


def _increasing(patch: Patch, pos: torch.Tensor, numel: int, *, trust: bool) -> bool:
    """Positions strictly increasing within ``[0, numel)`` (each chunk finds its own by
    bisection). With ``trust``, those decoded from an xef blob (checked so by the decoder) have
    only their ends checked; were they not (a Patch made up with a blob of other positions),
    the kernel refuses them before writing, or some are left out of their chunk and the digest,
    of the bytes as they are, says so. Without it (old values to save, a tensor in parts, where
    a bad position found midway would leave a half-written tensor or unsaved old values) every
    position is checked."""
    if pos.device.type != "cpu" or pos.dtype != torch.int64 or not pos.is_contiguous():
        return False
    if pos.numel() == 0:
        return True
    p = patch.arrays()[0]
    if int(p[0]) < 0 or int(p[-1]) >= numel:
        return False
    if trust and patch.decoded_xef() is not None:
        return True
    k = native.kernels
    if k is not None and hasattr(k, "increasing"):
        return bool(k.increasing(p, 8, numel))
    return bool(np.all(p[1:] > p[:-1]))


def _single_pass(
    flat: torch.Tensor,
    patch: Patch,
    algorithm: str,
    parts: list[tuple[int, int]],
    composite: bool,
    old: Any,
) -> str:
    k = native.kernels
    arr: Any = flat.numpy()
    pos, vals = patch.arrays()
    if k is not None and hasattr(k, "patch_hash") and native.hasher(algorithm) is not None:
        xor = patch.op == "xor"
        digest = _native_pass(arr, vals, pos, xor, algorithm, parts, composite, old)
        assert digest is not None
        return digest
    width, numel = flat.element_size(), flat.numel()
    step = max(1, CHUNK_BYTES // width)
    edges = sorted(
        {*range(0, numel, step), numel, *(o for o, _ in parts), *(o + n for o, n in parts)}
    )
    cuts = None if pos is None else np.searchsorted(pos, edges).tolist()
    kernel = None
    if native.kernels is not None:
        kernel = native.kernels.xor_patch if patch.op == "xor" else native.kernels.set_patch
    hashers = [new_hasher(algorithm) for _ in parts]
    starts = [o for o, _ in parts]
    raw = memoryview(arr.view(np.uint8)) if numel else memoryview(b"")
    for k in range(len(edges) - 1):
        lo, hi = edges[k], edges[k + 1]
        if pos is None:  # dense: every element of the chunk
            if old is not None:
                old[lo:hi] = arr[lo:hi]
            if patch.op == "xor":
                np.bitwise_xor(arr[lo:hi], vals[lo:hi], out=arr[lo:hi])
            else:
                arr[lo:hi] = vals[lo:hi]
        elif cuts is not None and cuts[k + 1] > cuts[k]:
            a, b = cuts[k], cuts[k + 1]
            if kernel is not None:
                kernel(arr, width, pos[a:b], vals[a:b], None if old is None else old[a:b])
            else:
                if old is not None:
                    old[a:b] = arr[pos[a:b]]
                if patch.op == "xor":
                    arr[pos[a:b]] ^= vals[a:b]
                else:
                    arr[pos[a:b]] = vals[a:b]
        j = bisect.bisect_right(starts, lo) - 1
        if j >= 0 and lo < parts[j][0] + parts[j][1]:
            hashers[j].update(raw[lo * width : hi * width])
    if not composite:
        return hashers[0].hexdigest()
    return parts_checksum(
        ((o, n, h.hexdigest()) for (o, n), h in zip(parts, hashers, strict=True)), algorithm
    )


def _native_pass(
    arr: Any,
    vals: Any,
    pos: Any,
    xor: bool,
    algorithm: str | None,
    parts: list[tuple[int, int]],
    composite: bool,
    old: Any,
    journal: Journal | None = None,
) -> str | None:
    """The C kernel's ``patch_hash`` over ``arr`` (the target's NumPy view; ``vals``, ``pos``:
    the patch's, ``pos`` None when dense): each part's range patched and hashed block by block
    in one call (the ranges between parts, if any, patched without hashing); with ``journal``,
    ``journal_patch_hash``, which saves the old values into the journal first. ``algorithm``
    None: nothing hashed, None returned."""
    width, numel = arr.itemsize, arr.size
    ranges: list[tuple[int, int, bool]] = []  # (lo, hi, hashed)
    end = 0
    for o, n in parts:
        if o > end:
            ranges.append((end, o, False))
        ranges.append((o, o + n, True))
        end = o + n
    if end < numel:
        ranges.append((end, numel, False))
    cuts: Any = None
    if pos is not None and len(ranges) == 1:  # the whole tensor (a tensor not in parts): all
        cuts = (0, pos.size)  # its positions, which the kernel checks lie within it
    elif pos is not None:  # (searchsorted's ~5 us was ~5 % of a 4 KiB tensor's apply)
        cuts = np.searchsorted(pos, [lo for lo, _, _ in ranges] + [numel])
    digests: list[str] = []
    for j, (lo, hi, hashed) in enumerate(ranges):
        h = native.hasher(algorithm) if hashed and algorithm is not None else None
        if journal is not None:
            fd, values_at, progress_at = journal
            a, b = (lo, hi) if cuts is None else (int(cuts[j]), int(cuts[j + 1]))
            p = None if pos is None else pos[a:b]
            native.kernels.journal_patch_hash(
                arr, width, p, vals[a:b], xor, lo, hi, h, fd, values_at, progress_at, a
            )
        elif cuts is None:
            saved = None if old is None else old[lo:hi]
            native.kernels.patch_hash(arr, width, None, vals[lo:hi], xor, lo, hi, h, saved)
        else:
            a, b = int(cuts[j]), int(cuts[j + 1])
            saved = None if old is None else old[a:b]
            native.kernels.patch_hash(arr, width, pos[a:b], vals[a:b], xor, lo, hi, h, saved)
        if h is not None:
            digests.append(h.hexdigest())
    if algorithm is None:
        return None
    if not composite:
        return digests[0]
    return parts_checksum(((o, n, d) for (o, n), d in zip(parts, digests, strict=True)), algorithm)
