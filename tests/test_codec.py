"""Tests of asyncsync.codec: lossless round trips, one-nonzero extraction, hostile blobs, sizes."""

from __future__ import annotations

import contextlib
import importlib
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncsync import codec
from asyncsync.codec import (
    DEFAULT_ENCODING,
    ENCODINGS,
    EncodedDelta,
    Patch,
    apply_patch,
    changed_positions,
    decode_delta,
    ef,
    encode_delta,
    encoded_size,
    int_view,
    native,
    zstdlib,
)
from asyncsync.codec import delta as codec_delta
from asyncsync.codec.diff import _changed_positions_torch
from asyncsync.codec.shards import BucketItem, encode_bucket
from asyncsync.errors import ConfigError, FormatError
from asyncsync.format.checksum import DEFAULT_ALGORITHM
from tests.conftest import ALL_DTYPES, mixed_state, mutate
from tests.test_ef import reference_payload

DTYPES = ALL_DTYPES
INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
BASELINES = ("indices", "deltas", "deltas_zstd")


def _examples(n: int) -> settings:
    return settings(max_examples=n, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _width(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _from_bytes(raw: np.ndarray, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(raw).reshape(-1)).view(dtype).reshape(shape)


def _make_pair(
    seed: int, dtype: torch.dtype, shape: tuple[int, ...], density: float, special: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """old = random bytes; new = old with a random subset of elements changed (bytewise)."""
    rng = np.random.default_rng(seed)
    numel, width = math.prod(shape), _width(dtype)
    if dtype == torch.bool:
        old_b = rng.integers(0, 2, numel, dtype=np.uint8).reshape(numel, 1)
        flip = np.ones((numel, 1), dtype=np.uint8)
    else:
        old_b = rng.integers(0, 256, (numel, width), dtype=np.uint8)
        flip = rng.integers(0, 256, (numel, width), dtype=np.uint8)
        flip[~flip.any(axis=1), 0] = 1  # every masked element really changes
    mask = rng.random(numel) < density
    new_b = old_b.copy()
    new_b[mask] ^= flip[mask]
    if special and dtype != torch.bool:
        # NaN payloads (all-ones bytes and a quiet NaN) and -0.0 / +0.0 bit patterns
        pool = np.array([[0xFF] * width, [0x00] * (width - 1) + [0x80], [0x00] * width])
        if width >= 2:
            pool = np.vstack([pool, [0x00] * (width - 2) + [0xC0, 0x7F]])
        pick = rng.random(numel) < 0.3
        new_b[mask & pick] = pool[rng.integers(0, len(pool), int((mask & pick).sum()))]
        old_pick = rng.random(numel) < 0.1
        old_b[old_pick] = pool[rng.integers(0, len(pool), int(old_pick.sum()))]
        new_b[old_pick & ~mask] = old_b[old_pick & ~mask]
        same = mask & (new_b == old_b).all(axis=1)
        new_b[same] ^= flip[same]
    return _from_bytes(old_b, shape, dtype), _from_bytes(new_b, shape, dtype)


def _noncontiguous(t: torch.Tensor, how: str) -> torch.Tensor:
    """The same logical tensor with a non-contiguous layout (copies done on the int view)."""
    idt = INT_VIEW[t.element_size()]
    ti = t.view(idt)
    if how == "transpose" and t.dim() >= 2:
        return ti.transpose(0, -1).contiguous().transpose(0, -1).view(t.dtype)
    if how == "slice" and t.dim() >= 1:
        big = torch.zeros((*t.shape[:-1], 2 * t.shape[-1]), dtype=idt)
        big[..., ::2] = ti
        return big.view(t.dtype)[..., ::2]
    return t


def _roundtrip(old: torch.Tensor, new: torch.Tensor, encoding: str) -> EncodedDelta:
    [pos] = changed_positions([old], [new])
    o, n = int_view(old), int_view(new)
    enc = encode_delta(o, n, pos, encoding)
    assert enc.changed == pos.numel()
    patch = decode_delta(
        enc.encoding,
        enc.mode,
        enc.positions,
        enc.values,
        changed=enc.changed,
        numel=o.numel(),
        dtype=o.dtype,
    )
    target = o.clone()
    apply_patch(target, patch)
    assert target.numpy().tobytes() == n.numpy().tobytes()
    return enc


# ----------------------------------------------------------------------------------- int_view


@pytest.mark.parametrize("dtype", DTYPES)
def test_int_view_dtypes_shapes_and_sharing(dtype: torch.dtype) -> None:
    old, _ = _make_pair(1, dtype, (3, 5), 0.0, special=False)
    v = int_view(old)
    assert v.dtype == INT_VIEW[_width(dtype)] and v.shape == (15,) and v.is_contiguous()
    assert v.data_ptr() == old.data_ptr()  # contiguous: a view, no copy
    assert int_view(old[1, 2]).shape == (1,)  # 0-d
    assert int_view(old[:0]).shape == (0,)
    for how in ("transpose", "slice"):
        nc = _noncontiguous(old, how)
        assert not nc.is_contiguous()
        assert int_view(nc).numpy().tobytes() == v.numpy().tobytes()


def test_int_view_rejects_unsupported_width() -> None:
    with pytest.raises(ConfigError):
        int_view(torch.zeros(2, dtype=torch.complex128))


# -------------------------------------------------------------------------------- round trips

dims = st.lists(st.integers(1, 12), min_size=1, max_size=3)
shapes = st.one_of(dims, dims, st.lists(st.integers(0, 3), max_size=3)).map(tuple)  # 0-d, empty
densities = st.sampled_from([0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 0.7, 0.8, 0.9, 0.99, 1.0])


@_examples(800)
@given(
    seed=st.integers(0, 2**32 - 1),
    dtype=st.sampled_from(DTYPES),
    shape=shapes,
    density=densities,
    special=st.booleans(),
    layout=st.sampled_from(["contiguous", "transpose", "slice"]),
    encoding=st.sampled_from(ENCODINGS),
)
def test_roundtrip_lossless(
    seed: int,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    density: float,
    special: bool,
    layout: str,
    encoding: str,
) -> None:
    old, new = _make_pair(seed, dtype, shape, density, special)
    old, new = _noncontiguous(old, layout), _noncontiguous(new, layout)
    enc = _roundtrip(old, new, encoding)
    if density == 0.0:
        assert enc.changed == 0
    if density == 1.0:
        assert enc.changed == old.numel()
    assert enc.mode == "sparse" or encoding == "xef"


@_examples(60)
@given(
    seed=st.integers(0, 2**32 - 1),
    dtype=st.sampled_from(DTYPES),
    numel=st.integers(1, 40_000),
    changed=st.integers(0, 40),
    encoding=st.sampled_from(ENCODINGS),
)
def test_roundtrip_few_changes_in_large_tensor(
    seed: int, dtype: torch.dtype, numel: int, changed: int, encoding: str
) -> None:
    """Low densities: large Elias-Fano L, wide gaps (uint32 deltas), long zstd runs."""
    old, _ = _make_pair(seed, dtype, (numel,), 0.0, special=False)
    new = old.clone()
    rng = np.random.default_rng(seed)
    pos = torch.from_numpy(rng.choice(numel, size=min(changed, numel), replace=False))
    nv = int_view(new)
    nv[pos] = nv[pos] ^ 1
    _roundtrip(old, new, encoding)


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
@pytest.mark.parametrize(
    "density",
    [0.0, 0.001, 0.2, codec.DENSE_THRESHOLD - 0.01, codec.DENSE_THRESHOLD + 0.01, 0.999, 1.0],
)
def test_roundtrip_across_dense_threshold(
    encoding: str, dtype: torch.dtype, density: float
) -> None:
    old, new = _make_pair(7, dtype, (5000,), density, special=True)
    enc = _roundtrip(old, new, encoding)
    dense = encoding == "xef" and enc.changed > codec.DENSE_THRESHOLD * old.numel()
    assert enc.mode == ("dense" if dense else "sparse")
    assert enc.raw_bytes >= 0 and encoded_size(enc) == len(enc.positions) + len(enc.values)


def test_zero_changes_and_empty_tensors() -> None:
    for encoding in ENCODINGS:
        for shape in [(0,), (4, 0), (), (17,)]:
            old = torch.zeros(shape, dtype=torch.bfloat16)
            enc = _roundtrip(old, old.clone(), encoding)
            assert (enc.changed, enc.positions, enc.values, enc.mode) == (0, b"", b"", "sparse")


@_examples(150)
@given(
    numel=st.integers(1, 2**62),
    data=st.data(),
)
def test_elias_fano_roundtrip_any_universe(numel: int, data: st.DataObject) -> None:
    """EF over universes up to 2**62 (L up to 61) without allocating such tensors."""
    n = data.draw(st.integers(1, min(numel, 300)))
    seed = data.draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    if numel <= 10 * n:
        idx = np.sort(rng.choice(numel, size=n, replace=False)).astype(np.int64)
    else:
        idx = np.unique(rng.integers(0, numel, size=n, dtype=np.int64))
    blob, raw = codec_delta._ef_encode(idx, numel)
    assert raw >= len(blob) - 1 - 32  # header + zstd frame overhead at worst
    assert np.array_equal(codec_delta._ef_decode(blob, idx.size, numel), idx)


def test_xef_positions_are_compressed_only_where_zstd_shrinks_them() -> None:
    """A large payload of scattered positions (an optimizer step's) is stored raw without
    compressing all of it (a sample says zstd cannot shrink it); dense, strided and clustered
    positions still get the zstd frame, and every blob decodes to its positions."""
    rng = np.random.default_rng(5)
    rows = [np.arange(r * 4096, r * 4096 + 4096) for r in range(0, 1000, 7)]
    cases = {
        "scattered 3 %": (np.sort(rng.choice(10**7, 3 * 10**5, replace=False)), 10**7, False),
        "scattered 30 %": (np.sort(rng.choice(10**6, 3 * 10**5, replace=False)), 10**6, True),
        "strided": (np.arange(0, 4 * 10**6, 4), 4 * 10**6, True),
        "clustered rows": (np.concatenate(rows), 4096 * 1000, True),
    }
    for name, (idx, numel, packed) in cases.items():
        idx = idx.astype(np.int64)
        blob, raw = codec_delta._ef_encode(idx, numel)
        assert raw > 2 * codec_delta._EF_SAMPLE, name  # the sampled path
        assert bool(blob[0] & 0x80) == packed, name
        assert np.array_equal(codec_delta._ef_decode(blob, idx.size, numel), idx), name


def test_large_universe_baseline_positions_decode() -> None:
    numel = 2**33
    idx = np.array([3, 2**31 + 5, 2**33 - 1], dtype=np.int64)
    vals = np.array([1, 2, 3], dtype=np.uint8).tobytes()
    for blob, encoding in [
        (idx.astype("<i8").tobytes(), "indices"),
        ((np.diff(idx, prepend=-1) - 1).astype("<u8").tobytes(), "deltas"),
    ]:
        patch = decode_delta(
            encoding, "sparse", blob, vals, changed=3, numel=numel, dtype=torch.uint8
        )
        assert patch.positions is not None and patch.positions.tolist() == idx.tolist()


def test_baseline_layouts_exact() -> None:
    """The generation-1 layouts byte for byte: int32 indices, uint16/uint32 gaps."""
    o = torch.zeros(100_000, dtype=torch.int16)
    n = o.clone()
    pos = torch.tensor([2, 3, 10, 80_000])
    n[pos] = torch.tensor([5, 6, 7, 8], dtype=torch.int16)
    enc = encode_delta(o, n, pos, "indices")
    assert enc.positions == np.array([2, 3, 10, 80_000], "<i4").tobytes()
    assert enc.values == np.array([5, 6, 7, 8], "<i2").tobytes()
    enc = encode_delta(o, n, pos, "deltas")
    assert enc.positions == np.array([2, 0, 6, 79_989], "<u4").tobytes()
    enc = encode_delta(o, n, pos[:3], "deltas")
    assert enc.positions == np.array([2, 0, 6], "<u2").tobytes()
    zenc = encode_delta(o, n, pos[:3], "deltas_zstd")
    assert zstandard.ZstdDecompressor().decompress(zenc.positions) == enc.positions
    assert zenc.raw_bytes == len(enc.positions) + len(enc.values)


def test_apply_patch_ops_and_devices_checks() -> None:
    flat = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    apply_patch(flat, Patch("set", torch.tensor([1, 3]), torch.tensor([9, 9], dtype=torch.int32)))
    assert flat.tolist() == [1, 9, 3, 9]
    apply_patch(flat, Patch("xor", torch.tensor([0]), torch.tensor([3], dtype=torch.int32)))
    assert flat.tolist() == [2, 9, 3, 9]
    apply_patch(flat, Patch("xor", None, torch.tensor([1, 1, 1, 1], dtype=torch.int32)))
    assert flat.tolist() == [3, 8, 2, 8]
    apply_patch(flat, Patch("set", None, torch.zeros(4, dtype=torch.int32)))
    assert flat.tolist() == [0, 0, 0, 0]
    with pytest.raises(ConfigError):
        apply_patch(flat, Patch("set", None, torch.zeros(4, dtype=torch.int16)))
    with pytest.raises(ConfigError):
        apply_patch(flat, Patch("set", torch.tensor([4]), torch.zeros(1, dtype=torch.int32)))
    with pytest.raises(ConfigError):
        apply_patch(flat, Patch("set", None, torch.zeros(3, dtype=torch.int32)))


def test_encode_rejects_bad_arguments() -> None:
    o = torch.zeros(10, dtype=torch.int16)
    pos = torch.tensor([1, 2])
    with pytest.raises(ConfigError):
        encode_delta(o, o, pos, "gzip")
    with pytest.raises(ConfigError):
        encode_delta(o, o.to(torch.int32), pos)
    with pytest.raises(ConfigError):
        encode_delta(o.view(torch.bfloat16), o.view(torch.bfloat16), pos)
    with pytest.raises(ConfigError):
        encode_delta(o, o, torch.tensor([2, 1]), "indices")
    with pytest.raises(ConfigError):
        encode_delta(o, o, torch.tensor([1, 10]), "xef")
    with pytest.raises(ConfigError):
        decode_delta("gzip", "sparse", b"", b"", changed=0, numel=1, dtype=torch.int16)
    with pytest.raises(ConfigError):
        decode_delta("xef", "sparse", b"", b"", changed=0, numel=1, dtype=torch.bfloat16)
    assert DEFAULT_ENCODING == "xef" and ENCODINGS[0] == "xef"


# -------------------------------------------------------------------------- changed_positions


def test_changed_positions_matches_per_tensor_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    pairs = [
        _make_pair(s, dt, sh, d, special=True)
        for s, (dt, sh, d) in enumerate(
            [
                (torch.bfloat16, (30, 7), 0.05),
                (torch.float32, (0,), 0.5),
                (torch.uint8, (), 1.0),
                (torch.float8_e5m2, (11, 3, 2), 0.3),
                (torch.float64, (64,), 0.0),
                (torch.bool, (40,), 0.5),
                (torch.int64, (5, 5), 1.0),
            ]
        )
    ]
    olds = [_noncontiguous(o, "transpose") for o, _ in pairs]
    news = [_noncontiguous(n, "transpose") for _, n in pairs]
    reference = [
        torch.nonzero(int_view(o) != int_view(n)).view(-1) for o, n in zip(olds, news, strict=True)
    ]
    calls: list[str] = []
    real_nonzero: Callable[..., Any] = torch.nonzero
    real_flatnonzero: Callable[..., Any] = np.flatnonzero

    def counting_nonzero(*args: Any, **kwargs: Any) -> Any:
        calls.append("torch.nonzero")
        return real_nonzero(*args, **kwargs)

    def counting_flatnonzero(*args: Any, **kwargs: Any) -> Any:
        calls.append("np.flatnonzero")
        return real_flatnonzero(*args, **kwargs)

    got_native = changed_positions(olds, news)  # CPU: the C kernel when built
    monkeypatch.setattr(native, "kernels", None)
    monkeypatch.setattr(torch, "nonzero", counting_nonzero)
    monkeypatch.setattr(np, "flatnonzero", counting_flatnonzero)
    got = changed_positions(olds, news)  # CPU without the kernel: the NumPy path
    assert calls == ["np.flatnonzero"]
    calls.clear()
    numels = [o.numel() for o in olds]
    got_torch = _changed_positions_torch(olds, news, numels)  # the accelerator path, on CPU
    assert calls == ["torch.nonzero"]
    monkeypatch.undo()
    assert len(got) == len(got_torch) == len(got_native) == len(reference)
    for g, gt, gn, r in zip(got, got_torch, got_native, reference, strict=True):
        assert g.dtype == gt.dtype == gn.dtype == torch.int64
        assert g.tolist() == gt.tolist() == gn.tolist() == r.tolist()
    assert changed_positions([], []) == []


def test_changed_positions_rejects_mismatch() -> None:
    a = torch.zeros(4, dtype=torch.float32)
    with pytest.raises(ConfigError):
        changed_positions([a], [a.to(torch.float16)])
    with pytest.raises(ConfigError):
        changed_positions([a], [a.view(2, 2)])
    with pytest.raises(ConfigError):
        changed_positions([a, a], [a])


# ------------------------------------------------------------- native kernel vs NumPy fallback

needs_native = pytest.mark.skipif(
    not codec.NATIVE, reason="asyncsync.codec._native is not built (or ASYNCSYNC_NATIVE=0)"
)


@pytest.fixture(params=["native", "numpy"])
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test on the C kernel and again on the NumPy fallback (``kernels`` set to None)."""
    if request.param == "native" and not codec.NATIVE:
        pytest.skip("asyncsync.codec._native is not built (or ASYNCSYNC_NATIVE=0)")
    if request.param == "numpy":
        monkeypatch.setattr(native, "kernels", None)
    return str(request.param)


def _native_and_numpy(fn: Callable[[], Any]) -> list[Any]:
    """``fn()`` on the native path (when built), then on the fallback."""
    out = [fn()] if codec.NATIVE else []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native, "kernels", None)
        out.append(fn())
    return out


def _check_change(change: codec.Change, old: torch.Tensor, new: torch.Tensor) -> None:
    o, n = int_view(old), int_view(new)
    pos = torch.nonzero(o != n).view(-1)
    assert change.positions.dtype == torch.int64 and torch.equal(change.positions, pos)
    assert change.values.dtype == change.xor.dtype == o.dtype
    assert torch.equal(change.values, n[pos]) and torch.equal(change.xor, o[pos] ^ n[pos])


def test_native_loader_and_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    assert (native.kernels is not None) == codec.NATIVE
    monkeypatch.setenv("ASYNCSYNC_NATIVE", "0")
    assert native.load() is None
    monkeypatch.setenv("ASYNCSYNC_NATIVE", "1")
    try:
        built = importlib.import_module("asyncsync.codec._native") is not None
    except ImportError:
        built = False
    assert (native.load() is not None) == built

    def missing(name: str) -> None:
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(importlib, "import_module", missing)  # as when the build failed
    assert native.load() is None


def test_diff_tensors_matches_reference(kernel: str) -> None:
    cases = [(dt, (37, 5), d) for dt in DTYPES for d in (0.0, 0.03, 0.5, 1.0)]
    cases += [(torch.bfloat16, (), 1.0), (torch.float32, (0, 3), 0.5), (torch.int64, (9,), 0.3)]
    pairs = [_make_pair(i, dt, sh, d, special=True) for i, (dt, sh, d) in enumerate(cases)]
    olds = [_noncontiguous(o, "transpose") for o, _ in pairs]
    news = [_noncontiguous(n, "slice") for _, n in pairs]
    changes = codec.diff_tensors(olds, news)
    assert len(changes) == len(pairs)
    for change, old, new in zip(changes, olds, news, strict=True):
        _check_change(change, old, new)
    assert codec.diff_tensors([], []) == []
    with pytest.raises(ConfigError):
        codec.diff_tensors([olds[0]], [news[-1]])
    with pytest.raises(ConfigError):
        codec.diff_tensors(olds, news[:-1])


@_examples(200)
@given(
    seed=st.integers(0, 2**32 - 1),
    dtype=st.sampled_from(DTYPES),
    shape=shapes,
    density=densities,
)
def test_diff_tensors_native_equals_fallback(
    seed: int, dtype: torch.dtype, shape: tuple[int, ...], density: float
) -> None:
    old, new = _make_pair(seed, dtype, shape, density, special=True)
    results = _native_and_numpy(lambda: codec.diff_tensors([old], [new])[0])
    for change in results:
        _check_change(change, old, new)


@needs_native
@pytest.mark.parametrize("initial", [1, 3, 1024])
def test_diff_tensors_capacity_grows_and_resumes(
    initial: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sparse then dense: the rate seen early underestimates the rest, so it grows repeatedly."""
    n = 60_000
    old = torch.zeros(n, dtype=torch.int16)
    new = old.clone()
    new[: n // 2 : 97] = 1
    new[n // 2 :: 2] = 2
    new[-1] = 3
    calls: list[int] = []
    real = native.kernels.diff_extract

    def counting(*args: Any) -> Any:
        calls.append(len(args[4]))
        return real(*args)

    monkeypatch.setattr(native, "_initial_capacity", lambda numel: min(numel, initial))
    monkeypatch.setattr(native.kernels, "diff_extract", counting)
    [change] = codec.diff_tensors([old], [new])
    _check_change(change, old, new)
    assert len(calls) >= 3 and calls[0] == initial
    [pos] = changed_positions([old], [new])
    assert torch.equal(pos, change.positions)


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("density", [0.01, 0.3, codec.DENSE_THRESHOLD + 0.05, 1.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.bool, torch.float64])
def test_encode_delta_with_precomputed_values_is_identical(
    encoding: str, density: float, dtype: torch.dtype
) -> None:
    old, new = _make_pair(3, dtype, (3001,), density, special=True)
    o, n = int_view(old), int_view(new)
    [pos] = changed_positions([old], [new])
    plain = encode_delta(o, n, pos, encoding)
    for change in _native_and_numpy(lambda: codec.diff_tensors([old], [new])[0]):
        fused = encode_delta(o, n, change.positions, encoding, values=change.values, xor=change.xor)
        assert fused == plain


def test_encode_delta_rejects_bad_precomputed_values() -> None:
    o = torch.arange(10, dtype=torch.int16)
    n = o ^ 1
    pos = torch.arange(10)
    with pytest.raises(ConfigError, match="values"):
        encode_delta(o, n, pos, "indices", values=n[:9])
    with pytest.raises(ConfigError, match="xor"):
        encode_delta(o, n, pos, "xef", xor=(o ^ n).to(torch.int32))


@pytest.mark.parametrize("op", ["set", "xor"])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32, torch.int64])
def test_apply_patch_saves_old_values(kernel: str, op: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(5)
    flat = torch.randint(0, 100, (1000,), generator=g).to(dtype)
    pos = torch.unique(torch.randint(0, 1000, (300,), generator=g))
    values = torch.randint(1, 100, (pos.numel(),), generator=g).to(dtype)
    for patch in (Patch(op, pos, values), Patch(op, None, torch.randint(0, 9, (1000,)).to(dtype))):
        want = flat.clone()
        apply_patch(want, patch)
        target = flat.clone()
        old = torch.full(((pos if patch.positions is not None else flat).numel(),), 7, dtype=dtype)
        apply_patch(target, patch, old_out=old)
        assert torch.equal(target, want)
        assert torch.equal(old, flat if patch.positions is None else flat[pos])
    strided = torch.zeros(2000, dtype=dtype)[::2]  # not contiguous: the NumPy fallback
    old = torch.empty(pos.numel(), dtype=dtype)
    apply_patch(strided, Patch(op, pos, values), old_out=old)
    assert torch.equal(strided[pos], values) and not old.any()


@pytest.mark.parametrize("op", ["set", "xor"])
@pytest.mark.parametrize("device", ["cpu", *(["cuda"] if torch.cuda.is_available() else [])])
def test_the_device_patch_matches_the_host_patch(op: str, device: str) -> None:
    """The device branch of apply_patch (one copy of the positions, one gather, one scatter):
    run here on the CPU by calling it directly, and on a GPU through apply_patch itself."""
    from asyncsync.codec.patch import _device_patch

    g = torch.Generator().manual_seed(9)
    for dtype in (torch.uint8, torch.int16, torch.int32, torch.int64):
        flat = torch.randint(0, 100, (5000,), generator=g).to(dtype)
        pos = torch.unique(torch.randint(0, 5000, (700,), generator=g))
        values = torch.randint(1, 100, (pos.numel(),), generator=g).to(dtype)
        want, want_old = flat.clone(), torch.empty(pos.numel(), dtype=dtype)
        apply_patch(want, Patch(op, pos, values), old_out=want_old)
        for save in (True, False):
            got = flat.clone().to(device)
            old = torch.full((pos.numel(),), 7, dtype=dtype, device=device) if save else None
            if device == "cpu":
                _device_patch(got, op, pos, values, old)
            else:
                apply_patch(got, Patch(op, pos, values), old_out=old)
            assert torch.equal(got.cpu(), want), (dtype, save)
            assert old is None or torch.equal(old.cpu(), want_old), dtype


def test_apply_patch_old_out_and_bounds_checks(kernel: str) -> None:
    flat = torch.arange(8, dtype=torch.int32)
    patch = Patch("xor", torch.tensor([1, 3]), torch.tensor([5, 5], dtype=torch.int32))
    for bad in (torch.empty(3, dtype=torch.int32), torch.empty(2, dtype=torch.int64)):
        with pytest.raises(ConfigError, match="old_out"):
            apply_patch(flat, patch, old_out=bad)
    with pytest.raises(ConfigError, match="old_out"):
        apply_patch(
            flat, Patch("set", None, flat.clone()), old_out=torch.empty(2, dtype=flat.dtype)
        )
    # unsorted, so the last-position check passes: the kernel (or NumPy) refuses before writing
    for pos in ([9, 1], [-20, 1]):
        old = torch.zeros(2, dtype=torch.int32)
        bad = Patch("set", torch.tensor(pos), torch.tensor([5, 5], dtype=torch.int32))
        with pytest.raises(IndexError):
            apply_patch(flat, bad, old_out=old)
        assert torch.equal(flat, torch.arange(8, dtype=torch.int32)) and not old.any()
    assert flat.tolist() == list(range(8))


def test_encode_bucket_same_bytes_native_and_numpy() -> None:
    old = mixed_state(seed=3, scale=4)
    new = mutate(old, 0.1, seed=4)
    items = [BucketItem(i, k, new[k], old[k]) for i, k in enumerate(old)]

    def run() -> Any:
        return encode_bucket(
            items,
            version=2,
            run_id="r",
            delta=True,
            full=False,
            encoding="xef",
            level=3,
            algorithm=DEFAULT_ALGORITHM,
        )

    results = _native_and_numpy(run)
    for got in results[1:]:
        assert got.items == results[0].items and got.raw_bytes == results[0].raw_bytes
        assert got.delta_blobs == results[0].delta_blobs
        for a, b in zip(got.pending, results[0].pending, strict=True):
            assert a.name == b.name and torch.equal(a.values, b.values)
            assert (a.positions is None) == (b.positions is None)
            assert a.positions is None or torch.equal(a.positions, b.positions)


def _xef_reference(positions: torch.Tensor, xor: torch.Tensor, numel: int, level: int) -> Any:
    """The sparse xef blobs of a change as the publisher wrote them at badf3dc (the positions'
    payload, then its header byte prepended; the XORs' planes in one zstd frame)."""
    idx = positions.numpy()
    payload, bits = codec.ef.encode(idx, numel)
    blob = bytes([bits]) + payload
    sample_size = codec_delta._EF_SAMPLE
    if len(payload) > 2 * sample_size:
        low, half = codec.ef.sizes(idx.size, numel, bits)[0], sample_size // 2
        sample = payload[: min(half, low)] + payload[low : low + half]
        if len(codec_delta._zstd(sample, 1)) > (1 - codec_delta._EF_SAMPLE_GAIN) * len(sample):
            return blob, codec_delta._zstd(codec_delta._planes(xor), level, values=True)
    packed = codec_delta._zstd(payload, 1)
    if len(packed) < len(payload):
        blob = bytes([bits | 0x80]) + packed
    return blob, codec_delta._zstd(codec_delta._planes(xor), level, values=True)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32, torch.float64])
def test_xef_encode_is_the_old_paths_bytes(dtype: torch.dtype, kernel: str) -> None:
    """encode_change of a diff's change: the same blobs as the old path (:func:`_xef_reference`)
    for every width, at 0, 1 and every changed element, either side of the dense threshold,
    below and above the positions' zstd sample (raw and compressed), and for tensors small
    enough for the NumPy planes."""
    rng = np.random.default_rng(dtype.itemsize)
    width, sampled = dtype.itemsize, set()
    for numel in (1, 5, 300, 20_000, 2_000_000):
        edge = int(codec_delta.DENSE_THRESHOLD * numel)
        for changed, runs in {(0, False), (1, False), (numel // 30, False), (numel // 3, False),
                              (numel // 3, True), (edge, False), (edge + 1, False),
                              (numel, False)}:  # fmt: skip
            changed = min(changed, numel)
            old = torch.from_numpy(rng.integers(0, 256, numel * width, dtype=np.uint8))
            new = old.clone()
            # scattered positions (a payload zstd cannot shrink) or one run (one it can)
            at = np.arange(changed) if runs else rng.choice(numel, changed, replace=False)
            flips = torch.from_numpy(rng.integers(1, 256, changed, dtype=np.uint8))
            new.view(-1, width)[torch.from_numpy(at), 0] ^= flips
            ov, nv = int_view(old.view(dtype)), int_view(new.view(dtype))
            (change,) = codec.diff_tensors([ov], [nv])
            enc = codec.encode_change(
                change.positions, change.values, change.xor, numel, "xef", level=1
            )
            assert enc.changed == changed
            if enc.mode == "dense" or not changed:
                continue
            want = _xef_reference(change.positions, change.xor, numel, 1)
            assert (enc.positions, enc.values) == want, (numel, changed, runs)
            if enc.raw_bytes - changed * width > 2 * codec_delta._EF_SAMPLE:
                sampled.add(bool(enc.positions[0] & 0x80))
    assert sampled == {False, True}  # the sample said raw, and said zstd


# ------------------------------------------------------------------------------ hostile input


def _valid(encoding: str, density: float = 0.05) -> tuple[EncodedDelta, int, torch.dtype]:
    old, new = _make_pair(3, torch.bfloat16, (4000,), density, special=False)
    enc = _roundtrip(old, new, encoding)
    return enc, old.numel(), torch.int16


def _decode(enc: EncodedDelta, size: int, view: torch.dtype, **override: Any) -> Patch:
    """decode_delta of ``enc`` (numel ``size``, int-view dtype ``view``), arguments overridden."""
    args: dict[str, Any] = {
        "encoding": enc.encoding,
        "mode": enc.mode,
        "positions": enc.positions,
        "values": enc.values,
        "changed": enc.changed,
        "numel": size,
        "dtype": view,
    }
    args.update(override)
    return decode_delta(
        args["encoding"],
        args["mode"],
        args["positions"],
        args["values"],
        changed=args["changed"],
        numel=args["numel"],
        dtype=args["dtype"],
    )


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("density", [0.05, 0.9])
def test_corrupt_blobs_raise_format_error(encoding: str, density: float) -> None:
    enc, numel, dtype = _valid(encoding, density)
    bad: list[dict[str, Any]] = [
        {"values": enc.values[:-1]},
        {"values": enc.values[: len(enc.values) // 2]},
        {"values": b""},
        {"values": bytes(range(256)) * 3},
        {"changed": enc.changed + 1},
        {"changed": enc.changed - 1},
        {"changed": numel + 1},
        {"numel": -1},
        {"mode": "bogus"},
    ]
    if enc.mode == "sparse":
        bad += [
            {"positions": enc.positions[:-1]},
            {"positions": enc.positions[: len(enc.positions) // 2]},
            {"positions": b""},
            {"numel": enc.changed - 1},
            {"mode": "dense"},
        ]
        bad.append({"positions": enc.positions + b"\x00" * 4})  # zstd'ed or not
    else:
        bad += [{"positions": b"\x00"}, {"numel": numel * 2}, {"numel": numel - 1}]
    for override in bad:
        with pytest.raises(FormatError):
            _decode(enc, numel, dtype, **override)


def test_positions_out_of_range_or_not_increasing() -> None:
    vals = np.zeros(3, "<i2").tobytes()

    def dec(encoding: str, blob: bytes, numel: int = 100) -> Patch:
        return decode_delta(
            encoding, "sparse", blob, vals, changed=3, numel=numel, dtype=torch.int16
        )

    dec("indices", np.array([1, 2, 99], "<i4").tobytes())  # valid
    for idx in ([1, 2, 100], [1, 1, 2], [5, 2, 9], [-1, 2, 3]):
        with pytest.raises(FormatError):
            dec("indices", np.array(idx, "<i4").tobytes())
    with pytest.raises(FormatError):
        dec("deltas", np.array([50, 30, 20], "<u2").tobytes())  # 50, 81, 102 >= 100
    with pytest.raises(FormatError):
        dec("deltas", np.array([0, 2**64 - 1, 3], "<u8").tobytes())  # uint64 wrap
    with pytest.raises(FormatError):
        dec("deltas", np.array([2**64 - 1, 0, 0], "<u8").tobytes())
    for idx in ([1, 1, 2], [3, 2, 9]):  # the encoder refuses these: write the bits by hand
        blob = bytes([ef.low_bits(3, 100)]) + reference_payload(idx, 100)
        with pytest.raises(FormatError, match="not strictly increasing"):
            decode_delta("xef", "sparse", blob, b"", changed=3, numel=100, dtype=torch.int16)
    blob, _ = codec_delta._ef_encode(np.array([1, 2, 99], dtype=np.int64), 100)
    with pytest.raises(FormatError, match="header"):  # L is 4 for numel 90, not 5
        codec_delta._ef_decode(blob, 3, 90)
    blob = bytes([ef.low_bits(3, 90)]) + reference_payload([1, 2, 99], 90)
    with pytest.raises(FormatError, match="not strictly increasing"):  # 99 >= 90
        codec_delta._ef_decode(blob, 3, 90)
    with pytest.raises(ConfigError, match=r"positions\[1\] = 1: .*strictly increasing"):
        encode_delta(
            torch.zeros(100, dtype=torch.int16),
            torch.ones(100, dtype=torch.int16),
            torch.tensor([1, 1, 2]),
            "xef",
        )


@pytest.mark.parametrize("encoding", ["xef", "deltas_zstd"])
@pytest.mark.parametrize("density", [0.05, 0.9])
def test_bytes_after_the_zstd_frame_are_refused(encoding: str, density: float) -> None:
    """Issue 22, finding 10: a blob is one zstd frame (FORMAT.md 4.2); bytes after it (junk,
    or a second frame) were ignored, now refused."""
    enc, numel, dtype = _valid(encoding, density)
    _decode(enc, numel, dtype)  # the blob as written decodes
    framed = ["values"] if encoding == "xef" else []
    if encoding == "deltas_zstd" or (enc.positions and enc.positions[0] & 0x80):
        framed.append("positions")  # deltas_zstd, and xef positions that zstd made smaller
    assert framed
    extra = [b"\x00", b"trailing junk", zstandard.ZstdCompressor().compress(b"")]
    for key in framed:
        blob = enc.values if key == "values" else enc.positions
        if key == "positions" and encoding == "xef":
            blob = blob[1:]  # after the header byte
        for tail in extra:
            damaged = enc.positions[:1] if key == "positions" and encoding == "xef" else b""
            damaged += blob + tail
            with pytest.raises(FormatError, match="unused data"):
                _decode(enc, numel, dtype, **{key: damaged})


def test_a_listed_position_whose_xor_is_zero_is_refused() -> None:
    """FORMAT.md 4.2 (issue 22): a sparse xef delta lists only positions that change, so each
    XOR value is non-zero (a zero one means ``changed`` counts an element that did not)."""
    old = torch.zeros(100, dtype=torch.int16)
    new = old.clone()
    new[5] = 1
    enc = encode_delta(old, new, torch.tensor([5, 7]), "xef")  # 7 did not change
    assert enc.mode == "sparse"
    with pytest.raises(FormatError, match="zero XOR"):
        decode_delta("xef", "sparse", enc.positions, enc.values, changed=2, numel=100,
                     dtype=torch.int16)  # fmt: skip


def test_hostile_zstd_frames() -> None:
    enc, numel, dtype = _valid("xef")
    size = enc.changed * 2
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * size)
    with pytest.raises(FormatError):  # unknown content size: refused, never unbounded
        _decode(enc, numel, dtype, values=unsized)
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (64 << 20))
    with pytest.raises(FormatError):  # declares far more than the known size
        _decode(enc, numel, dtype, values=bomb)
    with pytest.raises(FormatError):
        _decode(enc, numel, dtype, values=enc.values[:-3])
    flipped = bytearray(enc.values)
    flipped[len(flipped) // 2] ^= 0xFF
    with contextlib.suppress(FormatError):
        _decode(enc, numel, dtype, values=bytes(flipped))


def _check_patch(patch: Patch, numel: int, dtype: torch.dtype) -> None:
    assert patch.values.dtype == dtype
    if patch.positions is None:
        assert patch.values.numel() == numel
    else:
        p = patch.positions
        assert p.dtype == torch.int64 and p.numel() == patch.values.numel()
        if p.numel():
            assert int(p[0]) >= 0 and int(p[-1]) < numel and bool((p[1:] > p[:-1]).all())


@_examples(400)
@given(
    encoding=st.sampled_from(ENCODINGS),
    mode=st.sampled_from(["sparse", "dense", "x"]),
    positions=st.binary(max_size=64),
    values=st.binary(max_size=64),
    changed=st.integers(-2, 40),
    numel=st.integers(-1, 2000),
    dtype=st.sampled_from(list(INT_VIEW.values())),
)
def test_fuzz_random_blobs_only_format_error(
    encoding: str,
    mode: str,
    positions: bytes,
    values: bytes,
    changed: int,
    numel: int,
    dtype: torch.dtype,
) -> None:
    try:
        patch = decode_delta(
            encoding, mode, positions, values, changed=changed, numel=numel, dtype=dtype
        )
    except FormatError:
        return
    _check_patch(patch, numel, dtype)


@_examples(300)
@given(
    encoding=st.sampled_from(ENCODINGS),
    density=st.sampled_from([0.01, 0.3, 0.9]),
    target=st.sampled_from(["positions", "values"]),
    data=st.data(),
)
def test_fuzz_mutated_valid_blobs_only_format_error(
    encoding: str, density: float, target: str, data: st.DataObject
) -> None:
    enc, numel, dtype = _valid(encoding, density)
    blob = bytearray(getattr(enc, target))
    if blob:
        for _ in range(data.draw(st.integers(1, 4))):
            i = data.draw(st.integers(0, len(blob) - 1))
            blob[i] = data.draw(st.integers(0, 255))
        cut = data.draw(st.integers(0, len(blob)))
        if data.draw(st.booleans()):
            blob = blob[:cut]
    try:
        patch = _decode(enc, numel, dtype, **{target: bytes(blob)})
    except FormatError:
        return
    _check_patch(patch, numel, dtype)


# ---------------------------------------------------------------------- realistic workloads

N_REAL = 1 << 20


def _adam_step(w: torch.Tensor, lr: float, seed: int, frac: float = 1.0) -> torch.Tensor:
    """An Adam-like update: about +-lr per element (sign of a gradient, magnitude 0.5-1.5)."""
    g = torch.Generator().manual_seed(seed)
    dw = lr * torch.randn(w.shape, generator=g).sign() * (0.5 + torch.rand(w.shape, generator=g))
    if frac < 1.0:
        dw *= torch.rand(w.shape, generator=g) < frac  # only a fraction of weights move
    return w + dw


def _bf16_lr_for(w: torch.Tensor, density: float) -> float:
    """Learning rate at which about ``density`` of the bf16 weights change (bisection in log)."""
    lo, hi = math.log(1e-9), math.log(1e-2)
    for _ in range(20):
        mid = (lo + hi) / 2
        d = (_adam_step(w, math.exp(mid), 0).bfloat16() != w.bfloat16()).float().mean().item()
        lo, hi = (mid, hi) if d < density else (lo, mid)
    return math.exp((lo + hi) / 2)


def _bytes_per_changed(old: torch.Tensor, new: torch.Tensor) -> tuple[float, dict[str, float]]:
    [pos] = changed_positions([old], [new])
    sizes = {}
    for encoding in ENCODINGS:
        enc = _roundtrip(old, new, encoding)
        sizes[encoding] = encoded_size(enc) / max(1, pos.numel())
        if encoding == "xef":
            sizes["xef_mode"] = 1.0 if enc.mode == "dense" else 0.0
    return pos.numel() / old.numel(), sizes


def test_realistic_bf16_xef_beats_baselines() -> None:
    w = torch.randn(N_REAL, generator=torch.Generator().manual_seed(0)) * 0.02
    for target in (0.01, 0.03, 0.05):
        lr = _bf16_lr_for(w, target)
        density, sizes = _bytes_per_changed(w.bfloat16(), _adam_step(w, lr, 1).bfloat16())
        assert 0.005 < density < 0.08
        best = min(sizes[e] for e in BASELINES)
        assert sizes["xef"] < 0.7 * best, (density, sizes)


@pytest.mark.slow
def test_report_bytes_per_changed_table() -> None:
    """Print the bytes/changed table recorded in docs/CODEC.md (run with -s to see it)."""
    w = torch.randn(N_REAL, generator=torch.Generator().manual_seed(0)) * 0.02
    rows = []
    for target in (0.005, 0.01, 0.03, 0.10):
        lr = _bf16_lr_for(w, target)
        rows.append(
            (
                f"bf16 lr={lr:.2g}",
                *_bytes_per_changed(w.bfloat16(), _adam_step(w, lr, 1).bfloat16()),
            )
        )
    for frac in (0.005, 0.01, 0.03, 0.10, 1.0):
        rows.append(
            (f"fp32 lr=1e-05 moved={frac:g}", *_bytes_per_changed(w, _adam_step(w, 1e-5, 1, frac)))
        )
    print(f"\n{'workload':28} {'changed':>8} " + " ".join(f"{e:>12}" for e in ENCODINGS))
    for name, density, sizes in rows:
        mode = "dense" if sizes["xef_mode"] else "sparse"
        cells = " ".join(f"{sizes[e]:12.3f}" for e in ENCODINGS)
        print(f"{name:28} {density:8.2%} {cells}  (xef {mode})")
        if density < codec.DENSE_THRESHOLD:
            assert sizes["xef"] < min(sizes[e] for e in BASELINES)


def test_native_take_is_numpys_take(kernel: str) -> None:
    """``native.take`` (the C gather when built) matches ``np.take``, negative positions and
    errors included (the kernel refuses those and NumPy then decides), for every width."""
    rng = np.random.default_rng(11)
    for dtype in (np.uint8, np.int16, np.int32, np.int64):
        src = rng.integers(0, 100, 500).astype(dtype)
        for idx in (np.arange(500), rng.integers(0, 500, 77), np.array([], np.int64)):
            out = np.empty(idx.size, dtype)
            native.take(src, idx.astype(np.int64), out)
            assert np.array_equal(out, np.take(src, idx))
        out = np.empty(2, dtype)
        native.take(src, np.array([-1, 3], np.int64), out)  # NumPy wraps a negative position
        assert out.tolist() == [src[-1], src[3]]
        with pytest.raises(IndexError):
            native.take(src, np.array([500], np.int64), np.empty(1, dtype))
    t = torch.arange(10, dtype=torch.int16)
    assert torch.equal(codec.gather(t, torch.tensor([9, 0, 4])), torch.tensor([9, 0, 4]).short())


def test_int64_indices_are_read_for_any_numel() -> None:
    """FORMAT.md 11.6: readers take int32 or int64 ``indices`` positions whatever numel (the
    width is len / n); writers write int32 up to numel 2^31 - 1."""
    vals = np.array([7, 8, 9], "<i2").tobytes()
    for width in ("<i4", "<i8"):
        patch = decode_delta(
            "indices", "sparse", np.array([1, 2, 99], width).tobytes(), vals,
            changed=3, numel=100, dtype=torch.int16,
        )  # fmt: skip
        assert patch.positions is not None and patch.positions.tolist() == [1, 2, 99]


def test_a_corrupt_frame_does_not_spoil_the_threads_zstd_contexts() -> None:
    """The zstd contexts are kept per thread (delta._zstd, delta._decompressor): a frame that
    fails half-way leaves the next decode of a good one exact."""
    from asyncsync.codec import delta

    data = bytes(range(256)) * 4000
    good = delta._zstd(data, 1)
    bad = good[: len(good) // 2] + bytes(len(good) - len(good) // 2)
    for _ in range(3):
        with pytest.raises(FormatError):
            delta._unzstd(bad, (len(data),), "values")
        assert delta._unzstd(good, (len(data),), "values") == data
        assert delta._zstd(data, 1) == good and delta._zstd(data, 3) != good


@pytest.mark.parametrize("libzstd", [True, False])
def test_xef_values_at_level_1_leave_out_chance_matches(
    libzstd: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At level 1 (the publisher's default) the xef values' planes are compressed with zstd's
    smallest match table (delta._VALUES_LEVEL1) and, through the system's libzstd where it
    loads, zstd's acceleration with the literals still Huffman-coded (delta._VALUES_LIBZSTD):
    at ~3 % of a bf16 tensor changed, by an Adam-like step or by the bench's one-ulp moves,
    the frame is no larger than level 1's own of the same planes (acceleration alone, without
    the literals coded, made it 2-3x larger), and it is one frame of declared size that any
    zstd reader decodes. A dense xef's values keep level 1's own parameters."""
    if libzstd and zstdlib.compressor(codec_delta._VALUES_LIBZSTD) is None:
        pytest.skip("no libzstd.so.1 here")
    if not libzstd:
        monkeypatch.setattr(zstdlib, "compressor", lambda params: None)
    w = torch.randn(N_REAL, generator=torch.Generator().manual_seed(0)) * 0.02
    old = w.bfloat16()
    ulp = int_view(old.clone())
    ulp[torch.randperm(N_REAL, generator=torch.Generator().manual_seed(1))[: N_REAL // 33]] += 1
    for new in (_adam_step(w, _bf16_lr_for(w, 0.03), 1).bfloat16(), ulp.view(torch.bfloat16)):
        [pos] = changed_positions([old], [new])
        o, n = int_view(old), int_view(new)
        enc = encode_delta(o, n, pos, "xef", level=1)
        planes = bytes(codec_delta._planes(n[pos] ^ o[pos]))
        assert zstandard.frame_content_size(enc.values) == len(planes)
        assert zstandard.ZstdDecompressor().decompress(enc.values) == planes
        plain = zstandard.ZstdCompressor(level=1).compress(planes)
        assert len(enc.values) < len(plain), (len(enc.values), len(plain))  # 0.84-0.96x
        python_zstandard = zstandard.ZstdCompressor(
            compression_params=zstandard.ZstdCompressionParameters.from_level(1, hash_log=6)
        ).compress(planes)
        assert (enc.values == python_zstandard) is not libzstd  # (the frames of the path taken)
        assert encode_delta(o, n, pos, "xef", level=3).values == (
            zstandard.ZstdCompressor(level=3).compress(planes)
        )  # (another level: zstd's own parameters)
    dense_new = _adam_step(w, 1e-3, 2).bfloat16()  # (dense: level 1's own, its decode cheaper)
    [pos] = changed_positions([old], [dense_new])
    o, n = int_view(old), int_view(dense_new)
    enc = encode_delta(o, n, pos, "xef", level=1)
    assert enc.mode == "dense"
    plain = zstandard.ZstdCompressor(level=1).compress(bytes(codec_delta._planes(o ^ n)))
    assert enc.values == plain
