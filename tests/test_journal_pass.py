"""journal_pass (asyncsync.codec.patch_hash): the checked pass a progressive apply makes, and
the NumPy views a decoded Patch keeps (Patch.arrays), against the per-tensor path they replace.

A patch decoded from an xef delta is checked once by :func:`journal_pass` and passed on with
the NumPy arrays the decoder made it from (issue 26: the checks and ``.numpy()`` calls repeated
per tensor cost more than a 4 KiB tensor's patch). The pass must leave the tensor, its digest
and the journal file byte for byte as the same patch made up by hand (no blob, no kept
arrays: every position checked, new views) through ``patch_and_checksum(journal=...)``, and as
``apply_patch`` followed by the checksum: over dtypes (bf16, fp8, ints), 0-element and
one-element tensors, sizes around the small-planes threshold and a chunk, both layouts.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncsync import codec
from asyncsync.codec import Patch, apply_patch, journal_pass, patch_and_checksum
from asyncsync.codec.delta import _SMALL_PLANES
from asyncsync.codec.patch_hash import CHUNK_BYTES
from asyncsync.format.checksum import layout_checksum, tensor_bytes

needs_kernel = pytest.mark.skipif(
    not codec.NATIVE, reason="asyncsync.codec._native is not built (or ASYNCSYNC_NATIVE=0)"
)

DTYPES = (torch.bfloat16, torch.float8_e4m3fn, torch.uint8, torch.int16, torch.int32, torch.int64)


def _numels(dtype: torch.dtype) -> st.SearchStrategy[int]:
    w = dtype.itemsize
    edges = [0, 1, 2, 2048, _SMALL_PLANES // w - 1, _SMALL_PLANES // w, CHUNK_BYTES // w + 1]
    return st.sampled_from(edges) | st.integers(0, 5000)


@st.composite
def _cases(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, bool, int]:
    dtype = draw(st.sampled_from(DTYPES))
    numel = draw(_numels(dtype))
    seed = draw(st.integers(0, 2**31))
    g = torch.Generator().manual_seed(seed)
    idt = codec.int_dtype(dtype)
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=g)
    old = raw.view(idt).clone()
    new = old.clone()
    if numel:
        every = draw(st.sampled_from([1, 2, 31, 997, numel]))
        new[draw(st.integers(0, numel - 1)) :: every] ^= 1  # the low bit: never a no-op
    parts = draw(st.booleans()) and numel > 1
    return old, new, parts, draw(st.integers(1, max(1, numel - 1)))


def _decoded(old: torch.Tensor, new: torch.Tensor) -> Patch:
    """The patch the receiver decodes from the publisher's xef delta of old -> new."""
    positions = torch.nonzero(old != new).reshape(-1)
    enc = codec.encode_delta(old, new, positions, "xef")
    return codec.decode_delta(
        "xef", enc.mode, enc.positions, enc.values,
        changed=enc.changed, numel=old.numel(), dtype=old.dtype,
    )  # fmt: skip


@needs_kernel
@given(_cases())
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_a_decoded_patchs_journal_pass_is_the_per_tensor_paths(
    case: tuple[torch.Tensor, torch.Tensor, bool, int],
) -> None:
    old, new, in_parts, cut = case
    layout = [(0, cut), (cut, old.numel() - cut)] if in_parts else None
    patch = _decoded(old, new)
    plain = Patch(
        patch.op,
        None if patch.positions is None else patch.positions.clone(),
        patch.values.clone(),
    )  # made up by hand: no blob vouched for, no arrays kept
    assert plain.decoded_xef() is None and plain._arrays is None
    want = old.clone()
    apply_patch(want, plain)
    assert torch.equal(want, new)
    digest = layout_checksum(tensor_bytes(want), want.element_size(), layout, "xxh3-128")
    got: dict[str, tuple[torch.Tensor, str | None, bytes]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for how in ("pass", "per tensor"):
            flat = old.clone()
            path = os.path.join(tmp, how)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                if how == "pass":
                    one = journal_pass(flat, patch, "xxh3-128", layout)
                    assert one is not None
                    d = one.run((fd, 64, 8))
                else:
                    d = patch_and_checksum(flat, plain, "xxh3-128", layout, journal=(fd, 64, 8))
            finally:
                os.close(fd)
            with open(path, "rb") as f:
                got[how] = (flat, d, f.read())
    for flat, d, _ in got.values():
        assert torch.equal(flat, new) and d == digest
    assert got["pass"][2] == got["per tensor"][2]  # the journal, byte for byte
    unhashed = journal_pass(old.clone(), patch, None)  # journal_patch's pass: no digest
    assert unhashed is not None and unhashed.algorithm is None


def test_a_patchs_kept_arrays_are_its_tensors_or_none_at_all() -> None:
    """Patch.arrays() gives the decoder's arrays only while the patch's tensors are still those
    over the same memory: a replaced tensor, or one pointed at other memory (set_), gets views
    of what the patch holds now."""
    old = torch.arange(3000, dtype=torch.int16)
    new = old.clone()
    new[::7] += 1
    patch = _decoded(old, new)
    pos, vals = patch.arrays()
    assert pos is patch._arrays[2] and vals is patch._arrays[3]  # type: ignore[index]
    assert (pos == patch.positions.numpy()).all() and (vals == patch.values.numpy()).all()  # type: ignore[union-attr]
    moved = dataclasses.replace(patch, positions=patch.positions + 1)  # type: ignore[operator]
    assert (moved.arrays()[0] == patch.positions.numpy() + 1).all()  # type: ignore[union-attr]
    other = torch.zeros_like(patch.values)
    patch.values.set_(other.untyped_storage(), 0, other.shape, other.stride())
    assert not patch.arrays()[1].any()  # the values now over other's zeros


def test_a_patch_resized_in_place_gets_views_of_its_new_length() -> None:
    """A patch's tensors shrunk in place (``resize_`` keeps the address): its kept arrays
    would overrun them, so Patch.arrays() takes new views of the lengths they have now."""
    old = torch.arange(3000, dtype=torch.int16)
    new = old.clone()
    new[::7] += 1
    patch = _decoded(old, new)
    n = patch.values.numel()
    patch.values.resize_(n - 1)
    assert patch.arrays()[1].size == n - 1
    patch.positions.resize_(n - 2)  # type: ignore[union-attr]
    pos, vals = patch.arrays()
    assert pos is not None and pos.size == n - 2 and vals.size == n - 1


@needs_kernel
def test_a_decoded_patchs_positions_reshaped_are_still_checked_flat() -> None:
    """The decoder's positions as a 2-D view of the same memory (vouched for: the same
    elements, unwritten): check_patch reads the flat positions it checks, not the patch's
    2-D ones, and the patch applies as the decoded one does."""
    from receiver.rules import check_patch

    old = torch.arange(4096, dtype=torch.int16)
    new = old.clone()
    new[::7] += 1
    patch = _decoded(old, new)
    n = patch.values.numel()
    assert n % 2 == 0
    odd = dataclasses.replace(patch, positions=patch.positions.view(2, n // 2))  # type: ignore[union-attr]
    assert odd.decoded_xef() is not None
    checked = check_patch(odd, old.clone(), "w", kernels_check=True)
    assert checked.positions is not None and checked.positions.dim() == 1
    target = old.clone()
    apply_patch(target, checked)
    assert torch.equal(target, new)
