"""patch_and_checksum (asyncsync.codec.patch_hash) against apply_patch followed by the checksum.

Bit-exact on the C kernel and on the NumPy fallback, for every int width, both ops, both
algorithms: empty and one-element tensors, lengths that are not a whole chunk (a partial last
chunk), chunk edges hit exactly, ~3 % and every-element sparse patches, empty patches, dense
patches, tensors in parts (gaps, empty parts, parts not given in order), and the inputs the one
pass leaves to the two-pass path (positions not increasing, overlapping parts, strided views).
"""

from __future__ import annotations

import pytest
import torch

from asyncsync import codec
from asyncsync.codec import Patch, apply_patch, native, patch_and_checksum
from asyncsync.codec import patch_hash as ph
from asyncsync.errors import ConfigError
from asyncsync.format.checksum import ALGORITHMS, layout_checksum, tensor_bytes

DTYPES = (torch.uint8, torch.int16, torch.int32, torch.int64)


@pytest.fixture(params=["native", "numpy"])
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "native" and not codec.NATIVE:
        pytest.skip("asyncsync.codec._native is not built (or ASYNCSYNC_NATIVE=0)")
    if request.param == "numpy":
        monkeypatch.setattr(native, "kernels", None)
    return str(request.param)


def _random(n: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g).view(dtype)


def _check(
    flat: torch.Tensor, patch: Patch, layout: list[tuple[int, int]] | None, algo: str
) -> None:
    want = flat.clone()
    apply_patch(want, patch)
    digest = layout_checksum(tensor_bytes(want), want.element_size(), layout, algo)
    got = flat.clone()
    assert patch_and_checksum(got, patch, algo, layout) == digest
    assert torch.equal(got, want)
    # with old_out: the same, and the overwritten values saved as apply_patch saves them
    n = flat.numel() if patch.positions is None else patch.positions.numel()
    want, want_old = flat.clone(), torch.full((n,), 5, dtype=flat.dtype)
    apply_patch(want, patch, old_out=want_old)
    got, got_old = flat.clone(), torch.full((n,), 9, dtype=flat.dtype)
    assert patch_and_checksum(got, patch, algo, layout, old_out=got_old) == digest
    assert torch.equal(got, want) and torch.equal(got_old, want_old)


def _patches(n: int, dtype: torch.dtype, op: str, g: torch.Generator) -> list[Patch]:
    some = torch.randperm(n, generator=g)[: max(1, n * 3 // 100)].sort().values if n else None
    out = [
        Patch(op, torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=dtype)),  # nothing
        Patch(op, None, _random(n, dtype, g)),  # dense
        Patch(op, torch.arange(n), _random(n, dtype, g)),  # every element, sparse
    ]
    if some is not None:
        out.append(Patch(op, some, _random(some.numel(), dtype, g)))  # ~3 %
        out.append(Patch(op, torch.tensor([n - 1]), _random(1, dtype, g)))  # the last only
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["xor", "set"])
def test_single_pass_matches_patch_then_checksum(
    kernel: str, dtype: torch.dtype, op: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ph, "CHUNK_BYTES", 64)  # many chunks in a small tensor
    g = torch.Generator().manual_seed(dtype.itemsize * 10 + len(op))
    step = 64 // dtype.itemsize
    for n in (0, 1, 7, step - 1, step, step + 1, 3 * step, 5 * step + 3, 1001):
        flat = _random(n, dtype, g)
        third = n // 3
        layouts = [None, [(0, n)]]
        if n >= 3:
            layouts += [
                [(third, n - third), (0, third)],  # in parts, given out of order
                [(0, third), (third + 1, n - third - 1)],  # a gap left out of the digest
                [(0, 0), (0, n)],  # an empty part
            ]
        for patch in _patches(n, dtype, op, g):
            for layout in layouts:
                for algo in ALGORITHMS:
                    _check(flat, patch, layout, algo)


def test_default_chunk_with_a_partial_last_chunk(kernel: str) -> None:
    g = torch.Generator().manual_seed(3)
    n = 3 * (ph.CHUNK_BYTES // 2) + 12_345  # bf16-wide, not a whole number of chunks or pages
    flat = _random(n, torch.int16, g)
    for patch in _patches(n, torch.int16, "xor", g):
        _check(flat, patch, None, "xxh3-128")
        _check(flat, patch, [(0, 70_000), (70_000, n - 70_000)], "xxh3-128")


def test_what_one_pass_does_not_take_goes_the_two_pass_way(kernel: str) -> None:
    g = torch.Generator().manual_seed(4)
    flat = _random(500, torch.int16, g)
    unsorted = Patch("set", torch.tensor([9, 3, 400]), _random(3, torch.int16, g))
    sorted_ = Patch("xor", torch.tensor([3, 9, 400]), _random(3, torch.int16, g))
    _check(flat, unsorted, None, "xxh3-128")
    _check(flat, sorted_, [(0, 300), (200, 300)], "xxh3-128")  # overlapping parts
    _check(flat, sorted_, [(0, 300), (300, 201)], "xxh3-128")  # past the end: two passes
    big = _random(1000, torch.int16, g)
    strided, want = big.clone()[::2], big.clone()[::2]
    got = patch_and_checksum(strided, sorted_, "xxh3-64")
    apply_patch(want, sorted_)
    assert torch.equal(strided, want)
    assert got == layout_checksum(tensor_bytes(want), 2, None, "xxh3-64")


def test_old_out_of_the_wrong_shape_or_dtype_is_refused_before_any_write(kernel: str) -> None:
    flat = torch.arange(100, dtype=torch.int16)
    patch = Patch("xor", torch.tensor([3, 50]), torch.tensor([1, 1], dtype=torch.int16))
    for bad in (torch.empty(3, dtype=torch.int16), torch.empty(2, dtype=torch.int32)):
        with pytest.raises(ConfigError, match="old_out"):
            patch_and_checksum(flat, patch, "xxh3-128", old_out=bad)
    assert torch.equal(flat, torch.arange(100, dtype=torch.int16))
    if kernel == "native":  # the C kernel checks its own arguments too
        with pytest.raises(ValueError, match="old_out"):
            native.kernels.patch_hash(
                flat.numpy(), 2, patch.positions.numpy(), patch.values.numpy(), True, 0, 100,
                None, torch.empty(3, dtype=torch.int16).numpy(),
            )  # fmt: skip


def test_a_blob_that_lies_about_its_positions_never_leaves_half_a_patch(kernel: str) -> None:
    """A Patch that carries an xef blob but positions out of order (made up, not decoded): the
    blob is not vouched for (:meth:`Patch.decoded_xef` is None), so every position is checked
    first and the patch takes the two-pass way, whole (found by an attack: the kernel patched
    part 0, then refused part 1, and the caller had no old values to undo with)."""
    flat = torch.zeros(64, dtype=torch.int16)
    lying = Patch(
        "set", torch.tensor([5, 50, 40]), torch.tensor([1, 2, 3], dtype=torch.int16),
        positions_xef=b"not these",
    )  # fmt: skip
    _check(flat, lying, [(0, 32), (32, 32)], "xxh3-128")  # old_out included (see _check)
    _check(flat, lying, [(8, 48)], "xxh3-128")  # one part, but three ranges of the kernel
    got = flat.clone()
    patch_and_checksum(got, lying, "xxh3-128", [(8, 48)])  # no old values: still all checked
    assert got.nonzero().view(-1).tolist() == [5, 40, 50]
    got = flat.clone()
    old = torch.full((3,), 7, dtype=torch.int16)
    want_old = torch.zeros(3, dtype=torch.int16)
    patch_and_checksum(got, lying, "xxh3-128", old_out=old)  # one range, old values: checked
    assert torch.equal(old, want_old) and got.nonzero().view(-1).tolist() == [5, 40, 50]
    got = flat.clone()  # one range, nothing to save: the blob is not trusted either
    patch_and_checksum(got, lying, "xxh3-128")
    assert lying.decoded_xef() is None and got.nonzero().view(-1).tolist() == [5, 40, 50]


def test_xef_decoded_positions_and_bad_patches(kernel: str) -> None:
    g = torch.Generator().manual_seed(5)
    old = _random(20_000, torch.int16, g)
    new = old.clone()
    pos = torch.randperm(20_000, generator=g)[:600].sort().values
    new[pos] ^= 3
    enc = codec.encode_delta(old, new, pos, "xef")
    patch = codec.decode_delta(
        "xef", enc.mode, enc.positions, enc.values, changed=600, numel=20_000, dtype=torch.int16
    )
    assert patch.positions_xef is not None and patch.decoded_xef() is patch.positions_xef
    got = old.clone()
    assert patch_and_checksum(got, patch, "xxh3-128") == layout_checksum(
        tensor_bytes(new), 2, None, "xxh3-128"
    )
    assert torch.equal(got, new)
    flat = torch.zeros(10, dtype=torch.int16)
    with pytest.raises(ConfigError, match="cannot apply"):
        patch_and_checksum(flat, Patch("xor", None, torch.zeros(10, dtype=torch.int32)), "xxh3-64")
    with pytest.raises(ConfigError, match="values"):
        patch_and_checksum(flat, Patch("xor", torch.tensor([1, 2]), flat[:1]), "xxh3-64")
    with pytest.raises(ConfigError, match="values"):
        patch_and_checksum(flat, Patch("xor", None, flat[:9]), "xxh3-64")
    with pytest.raises(ConfigError, match="outside"):  # out of bounds: apply_patch refuses
        patch_and_checksum(flat, Patch("xor", torch.tensor([3, 10]), flat[:2]), "xxh3-64")
    assert torch.equal(flat, torch.zeros(10, dtype=torch.int16))
