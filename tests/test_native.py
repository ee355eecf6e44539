"""Tests of the C kernels in asyncsync.codec._native against NumPy references.

``diff_extract`` (positions, new values and XORs of the differing elements, resumable) and
``xor_patch``/``set_patch`` (save old values, then patch; bounds-checked before any write) and
``gather`` (``np.take`` of int64 positions, bounds-checked before any read), for
every element width, densities from 0 to 100 %, lengths whose tail is not a whole 8-byte word,
unaligned buffers, tiny capacities, and bad arguments; ``ef_encode``/``ef_decode`` for any L
against the spec's reference, with bad arguments and sizes that would overflow. The codec-level
equivalence of the native and NumPy paths is in test_codec.py and test_ef.py.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_ef import reference_payload

try:
    native: Any = importlib.import_module("asyncsync.codec._native")
except ImportError as exc:
    pytest.skip(
        f"the optional C extension asyncsync.codec._native is not built: {exc}",
        allow_module_level=True,
    )

WIDTHS = (1, 2, 4, 8)
DT = {w: np.dtype(f"<u{w}") for w in WIDTHS}


def _examples(n: int) -> settings:
    return settings(
        max_examples=n,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )


@pytest.fixture(params=["avx2", "words"])
def diff_loop(request: pytest.FixtureRequest) -> Any:
    """Each diff and hash test runs twice: with the AVX2 kernels (the diff's runs for 2-byte
    elements, XXH3's accumulate loop; skipped on a CPU without them) and without (the 8-byte
    word loop, XXH3's baseline loop); both must give the reference's outputs."""
    before = native.simd()
    try:
        native.simd(request.param == "avx2")
    except ValueError:
        pytest.skip("this CPU or build has no AVX2 diff")
    yield request.param
    native.simd(before)


def _unaligned(a: np.ndarray, offset: int) -> np.ndarray:
    """A writable copy of ``a`` whose data starts ``offset`` bytes into a fresh buffer."""
    raw = bytearray(a.nbytes + offset)
    out = np.frombuffer(raw, dtype=a.dtype, count=a.size, offset=offset)
    out[:] = a
    return out


def _pair(rng: np.random.Generator, width: int, n: int, density: float) -> tuple[np.ndarray, ...]:
    """old = random; new = old with about ``density`` of the elements changed (by one byte)."""
    old = rng.integers(0, 256, n * width, dtype=np.uint8).view(DT[width])
    new = old.copy()
    mask = rng.random(n) < density
    flip = np.zeros((n, width), dtype=np.uint8)
    flip[np.arange(n), rng.integers(0, width, n)] = rng.integers(1, 256, n, dtype=np.uint8)
    new[mask] ^= flip.view(DT[width]).reshape(-1)[mask]
    return old, new


def _reference(old: np.ndarray, new: np.ndarray, start: int = 0) -> tuple[np.ndarray, ...]:
    pos = np.flatnonzero(old[start:] != new[start:]) + start
    return pos, new[pos], old[pos] ^ new[pos]


def _extract_all(
    old: np.ndarray, new: np.ndarray, width: int, cap: int, start: int = 0, offset: int = 0
) -> tuple[np.ndarray, ...]:
    """Run diff_extract to the end with outputs of ``cap`` slots (unaligned by ``offset``)."""
    got: list[list[np.ndarray]] = [[], [], []]
    while True:
        pos = _unaligned(np.zeros(cap, np.int64), offset)
        vals = _unaligned(np.zeros(cap, DT[width]), offset)
        xor = _unaligned(np.zeros(cap, DT[width]), offset)
        count, nxt = native.diff_extract(old, new, width, start, pos, vals, xor)
        assert 0 <= count <= cap and start <= nxt <= old.size
        assert count == cap or nxt == old.size  # it stops early only when full
        for acc, arr in zip(got, (pos, vals, xor), strict=True):
            acc.append(arr[:count].copy())
        if nxt == old.size:
            return tuple(np.concatenate(a) for a in got)
        assert nxt > start or count > 0
        start = nxt


# ------------------------------------------------------------------------------ diff_extract


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("density", [0.0, 0.03, 0.5, 1.0])
@pytest.mark.parametrize("n", [0, 1, 7, 1001, 4099])
def test_diff_extract_matches_reference(width: int, density: float, n: int, diff_loop: str) -> None:
    old, new = _pair(np.random.default_rng(n + width), width, n, density)
    cap = max(1, n)
    for offset in (0, 3):  # aligned and unaligned inputs and outputs
        o, nw = _unaligned(old, offset), _unaligned(new, offset)
        got = _extract_all(o, nw, width, cap, offset=offset)
        for g, r in zip(got, _reference(old, new), strict=True):
            assert g.dtype == r.dtype and np.array_equal(g, r)


@_examples(300)
@given(
    width=st.sampled_from(WIDTHS),
    n=st.integers(0, 200),
    density=st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0]),
    cap=st.integers(1, 40),
    start_frac=st.floats(0, 1),
    offset=st.integers(0, 7),
    seed=st.integers(0, 2**32 - 1),
)
def test_diff_extract_resumes_from_any_start_and_capacity(
    width: int,
    n: int,
    density: float,
    cap: int,
    start_frac: float,
    offset: int,
    seed: int,
    diff_loop: str,
) -> None:
    old, new = _pair(np.random.default_rng(seed), width, n, density)
    start = int(start_frac * n)
    o, nw = _unaligned(old, offset), _unaligned(new, (offset * 5) % 8)
    got = _extract_all(o, nw, width, cap, start=start, offset=offset)
    for g, r in zip(got, _reference(old, new, start), strict=True):
        assert np.array_equal(g, r)


def test_diff_extract_every_byte_of_a_word_counts(diff_loop: str) -> None:
    """A change in any byte of any lane is found, including the last lane of the tail (nine
    whole words: two 16-lane steps of the AVX2 loop for 2-byte elements), with room for every
    lane and with 4 slots (the word loop only)."""
    for width in WIDTHS:
        n = 8 // width * 9 + 1  # nine whole words and a one-element tail
        for byte in range(n * width):
            old = np.zeros(n * width, np.uint8)
            new = old.copy()
            new[byte] = 0x80
            for cap in (n, 4):
                got = _extract_all(old.view(DT[width]), new.view(DT[width]), width, cap)
                assert got[0].tolist() == [byte // width]


@pytest.mark.parametrize("density", [0.001, 0.0039, 0.004, 0.03, 0.06, 0.2, 0.9, 1.0])
def test_diff_extract_long_runs_at_every_density(density: float, diff_loop: str) -> None:
    """Runs of 32768 2-byte lanes at densities either side of where the AVX2 pass lists a
    run's changed lanes before writing them (1 a word of 64 in 4), with lists that fill more
    than once a run (above ~12 %), and words of more than four changes: the reference's
    outputs, with room for all of them, with room that ends mid-run, and advanced in the pass."""
    n = 3 * 32768 + 77
    old, new = _pair(np.random.default_rng(int(density * 1e4)), 2, n, density)
    ref = _reference(old, new)
    for cap in (n, max(1, ref[0].size // 3 + 5)):
        got = _extract_all(old, new, 2, cap)
        for g, r in zip(got, ref, strict=True):
            assert np.array_equal(g, r)
    adv = old.copy()
    pos, vals, xor = np.empty(n, np.int64), np.empty(n, DT[2]), np.empty(n, DT[2])
    count, end = native.diff_extract(adv, new, 2, 0, pos, vals, xor, None, True)
    assert end == n and np.array_equal(pos[:count], ref[0]) and np.array_equal(adv, new)
    assert np.array_equal(xor[:count], ref[2])


def test_simd_switch() -> None:
    """simd() says whether the AVX2 diff is used; it switches; ASYNCSYNC_SIMD=0 turns it off at
    import."""
    import subprocess
    import sys

    before = native.simd()
    try:
        assert native.simd(False) is False and native.simd() is False
        try:
            assert native.simd(True) is True and native.simd() is True
        except ValueError as exc:  # a CPU or build without it says so
            assert "AVX2" in str(exc)
            assert native.simd() is False
    finally:
        native.simd(before)
    code = "import asyncsync.codec._native as n; print(n.simd())"
    for env, want in (("0", "False"), ("1", str(before))):
        out = subprocess.run(
            [sys.executable, "-c", code],
            env={**__import__("os").environ, "ASYNCSYNC_SIMD": env},
            capture_output=True,
            text=True,
            check=True,
        )
        assert out.stdout.strip() == want


def test_diff_extract_positions_only_and_views(diff_loop: str) -> None:
    old, new = _pair(np.random.default_rng(1), 2, 5000, 0.2)
    pos = np.empty(5000, np.int64)
    count, nxt = native.diff_extract(old, new, 2, 0, pos, None, None)
    assert nxt == 5000 and np.array_equal(pos[:count], np.flatnonzero(old != new))
    # any buffer works: bytes in, memoryview/bytearray out; widths reinterpret the same bytes
    raw_old, raw_new = old.tobytes(), new.tobytes()
    out = bytearray(8 * 10000)
    count8, _ = native.diff_extract(raw_old, raw_new, 1, 0, memoryview(out), None, None)
    ref = np.flatnonzero(old.view(np.uint8) != new.view(np.uint8))
    assert np.array_equal(np.frombuffer(out, np.int64)[:count8], ref)


def test_diff_extract_capacity_exactly_full_at_the_end(diff_loop: str) -> None:
    old, new = _pair(np.random.default_rng(2), 4, 100, 1.0)
    pos, vals, xor = np.empty(100, np.int64), np.empty(100, DT[4]), np.empty(100, DT[4])
    assert native.diff_extract(old, new, 4, 0, pos, vals, xor) == (100, 100)
    assert native.diff_extract(old, new, 4, 100, pos, vals, xor) == (0, 100)
    assert native.diff_extract(old, new, 4, 0, pos[:99], vals, xor) == (99, 99)


def test_diff_extract_rejects_bad_arguments() -> None:
    a = np.zeros(16, np.uint16)
    pos, vals = np.empty(16, np.int64), np.empty(16, np.uint16)
    ok = (a, a, 2, 0, pos, vals, vals.copy())

    def call(**kw: object) -> None:
        names = ("old", "new", "width", "start", "pos_out", "new_out", "xor_out")
        args = dict(zip(names, ok, strict=True)) | kw
        native.diff_extract(*args.values())

    call()
    for width in (0, 3, 16, -2):
        with pytest.raises(ValueError, match="width"):
            call(width=width)
    with pytest.raises(ValueError, match="old is 32 bytes but new is 30"):
        call(new=np.zeros(15, np.uint16))
    with pytest.raises(ValueError, match="whole number"):
        call(old=np.zeros(33, np.uint8), new=np.zeros(33, np.uint8), width=2)
    with pytest.raises(ValueError, match="start"):
        call(start=17)
    with pytest.raises(ValueError, match="start"):
        call(start=-1)
    with pytest.raises(TypeError, match="pos_out must be a writable"):
        call(pos_out=bytes(128))
    with pytest.raises(TypeError, match="xor_out must be a writable"):
        call(xor_out=bytes(32))
    with pytest.raises(TypeError, match="buffer protocol"):
        call(old=[0] * 16)
    with pytest.raises(ValueError, match="contiguous"):
        call(old=np.zeros(32, np.uint16)[::2])
    with pytest.raises(ValueError, match="int64"):
        call(pos_out=np.zeros(13, np.uint8))
    with pytest.raises(ValueError, match="must hold"):
        call(new_out=np.zeros(15, np.uint16))
    with pytest.raises(TypeError, match="both"):
        call(new_out=None)
    with pytest.raises(ValueError, match="capacity 0"):
        call(pos_out=np.zeros(0, np.int64))
    with pytest.raises(TypeError):
        native.diff_extract(a, a, 2, 0, pos)  # too few arguments


def test_diff_extract_runs_alongside_other_threads() -> None:
    """The GIL is released around the loop; concurrent calls on shared inputs agree."""
    old, new = _pair(np.random.default_rng(3), 2, 400_000, 0.03)
    ref = np.flatnonzero(old != new)
    results: list[bool] = []

    def work() -> None:
        pos = np.empty(old.size, np.int64)
        count, _ = native.diff_extract(old, new, 2, 0, pos, None, None)
        results.append(bool(np.array_equal(pos[:count], ref)))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * 4


# ------------------------------------------------------------------------- xor/set patches


def _patch_reference(flat: np.ndarray, pos: np.ndarray, vals: np.ndarray, op: str) -> np.ndarray:
    out = flat.copy()
    for p, v in zip(pos.tolist(), vals, strict=True):  # in order, repeats included
        out[p] = out[p] ^ v if op == "xor" else v
    return out


@pytest.mark.parametrize("op", ["xor", "set"])
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("offset", [0, 1, 5])
def test_patch_matches_reference(op: str, width: int, offset: int) -> None:
    rng = np.random.default_rng(width * 10 + offset)
    n = 1003
    flat = rng.integers(0, 256, n * width, dtype=np.uint8).view(DT[width])
    for k in (0, 1, 17, n, 3 * n):  # 3n: repeated positions, applied in order
        pos = np.sort(rng.choice(n, k, replace=False) if k <= n else rng.integers(0, n, k))
        vals = rng.integers(0, 256, k * width, dtype=np.uint8).view(DT[width])
        want = _patch_reference(flat, pos, vals, op)
        kernel = native.xor_patch if op == "xor" else native.set_patch
        target = _unaligned(flat, offset)
        kernel(target, width, _unaligned(pos, offset), _unaligned(vals, offset), None)
        assert np.array_equal(target, want)
        if k <= n:  # distinct positions: old_out holds exactly the overwritten values
            target, old = _unaligned(flat, offset), _unaligned(np.zeros(k, DT[width]), offset)
            kernel(target, width, pos, vals, old)
            assert np.array_equal(target, want) and np.array_equal(old, flat[pos])


@pytest.mark.parametrize("bad", [-1, 10, 2**40, -(2**63)])
@pytest.mark.parametrize("where", [0, 2, 4])
def test_patch_bounds_checked_before_any_write(bad: int, where: int) -> None:
    flat = np.arange(10, dtype=np.uint32)
    before = flat.copy()
    pos = np.array([1, 3, 5, 7, 9], dtype=np.int64)
    pos[where] = bad
    vals = np.full(5, 0xFFFF, np.uint32)
    old = np.zeros(5, np.uint32)
    for kernel in (native.xor_patch, native.set_patch):
        with pytest.raises(IndexError, match=rf"positions\[{where}\] = {bad} is outside"):
            kernel(flat, 4, pos, vals, old)
        assert np.array_equal(flat, before) and not old.any()


def test_patch_rejects_bad_arguments() -> None:
    flat = np.zeros(8, np.uint16)
    pos, vals = np.array([1, 2], np.int64), np.array([5, 6], np.uint16)
    native.set_patch(flat, 2, pos, vals, None)
    assert flat.tolist() == [0, 5, 6, 0, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="width"):
        native.xor_patch(flat, 5, pos, vals, None)
    with pytest.raises(ValueError, match="values is 6 bytes, want 4"):
        native.xor_patch(flat, 2, pos, np.zeros(3, np.uint16), None)
    with pytest.raises(ValueError, match="old_out is 2 bytes"):
        native.xor_patch(flat, 2, pos, vals, np.zeros(1, np.uint16))
    with pytest.raises(ValueError, match="int64"):
        native.xor_patch(flat, 2, np.zeros(3, np.int32), vals, None)
    with pytest.raises(ValueError, match="whole number"):
        native.xor_patch(np.zeros(3, np.uint8), 2, pos, vals, None)
    with pytest.raises(TypeError, match="flat must be a writable"):
        native.set_patch(flat.tobytes(), 2, pos, vals, None)
    with pytest.raises(TypeError, match="old_out must be a writable"):
        native.set_patch(flat, 2, pos, vals, bytes(4))
    with pytest.raises(ValueError, match="contiguous"):
        native.set_patch(np.zeros(16, np.uint16)[::2], 2, pos, vals, None)
    with pytest.raises(TypeError, match="buffer protocol"):
        native.set_patch(flat, 2, [1, 2], vals, None)
    assert flat.tolist() == [0, 5, 6, 0, 0, 0, 0, 0]


# ---------------------------------------------------------------------------- gather kernel


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("offset", [0, 1, 5])
def test_gather_matches_take(width: int, offset: int) -> None:
    rng = np.random.default_rng(width * 7 + offset)
    n = 1003
    flat = rng.integers(0, 256, n * width, dtype=np.uint8).view(DT[width])
    for k in (0, 1, 17, n, 3 * n):  # any order, repeats
        pos = rng.integers(0, n, k).astype(np.int64)
        if k == n:
            pos = np.arange(n, dtype=np.int64)  # every element, the last included
        out = _unaligned(np.full(k, 7, DT[width]), offset)
        native.gather(_unaligned(flat, offset), width, _unaligned(pos, offset), out)
        assert np.array_equal(out, np.take(flat, pos))


@pytest.mark.parametrize("bad", [-1, 10, 2**40, -(2**63)])
@pytest.mark.parametrize("where", [0, 2, 4])
def test_gather_bounds_checked_before_any_read(bad: int, where: int) -> None:
    flat = np.arange(10, dtype=np.uint32)
    pos = np.array([1, 3, 5, 7, 9], dtype=np.int64)
    pos[where] = bad
    out = np.zeros(5, np.uint32)
    with pytest.raises(IndexError, match=rf"positions\[{where}\] = {bad} is outside"):
        native.gather(flat, 4, pos, out)
    assert not out.any()


def test_gather_rejects_bad_arguments() -> None:
    flat, pos = np.arange(8, dtype=np.uint16), np.array([1, 2], np.int64)
    out = np.zeros(2, np.uint16)
    native.gather(flat.tobytes(), 2, pos, out)  # flat is only read
    assert out.tolist() == [1, 2]
    with pytest.raises(ValueError, match="width"):
        native.gather(flat, 3, pos, out)
    with pytest.raises(ValueError, match="out is 6 bytes, want 4"):
        native.gather(flat, 2, pos, np.zeros(3, np.uint16))
    with pytest.raises(ValueError, match="int64"):
        native.gather(flat, 2, np.zeros(3, np.int32), out)
    with pytest.raises(ValueError, match="whole number"):
        native.gather(np.zeros(3, np.uint8), 2, pos, out)
    with pytest.raises(TypeError, match="out must be a writable"):
        native.gather(flat, 2, pos, bytes(4))
    with pytest.raises(ValueError, match="contiguous"):
        native.gather(np.zeros(16, np.uint16)[::2], 2, pos, out)
    with pytest.raises(TypeError, match="buffer protocol"):
        native.gather(flat, 2, [1, 2], out)


# ------------------------------------------------------------------------ Elias-Fano kernels


def _ef_roundtrip(idx: np.ndarray, numel: int, low_bits: int, offset: int = 0) -> bytes:
    payload = native.ef_encode(_unaligned(idx, offset), numel, low_bits)
    assert isinstance(payload, bytes)
    assert payload == reference_payload(idx.tolist(), numel, low_bits)
    out = _unaligned(np.full(idx.size, -7, np.int64), offset)
    src = memoryview(bytes(offset) + payload)[offset:]
    assert native.ef_decode(src, idx.size, numel, low_bits, out) is None
    assert np.array_equal(out, idx)
    return payload


@pytest.mark.parametrize("low_bits", [0, 1, 3, 7, 8, 9, 31, 32, 33, 56, 57, 58, 63])
def test_ef_any_low_bits_matches_reference(low_bits: int) -> None:
    """Any L in [0, 63], not only the rule's: the field packing across 64-bit word edges."""
    rng = np.random.default_rng(low_bits)
    for numel in (1, 9, 1000, 2**40, 2**63 - 1):
        if numel >> low_bits > 2**20:
            continue  # a high part of millions of bits: the reference would be slow
        for n in (1, 2, 7, 8, 9, 65, 200):
            if n <= numel:
                idx = np.unique(rng.integers(0, numel, n, dtype=np.int64))
                for offset in (0, 3):
                    _ef_roundtrip(idx, numel, low_bits, offset)


def test_ef_empty_and_full() -> None:
    assert native.ef_encode(np.zeros(0, np.int64), 0, 0) == b"\x00"  # one high bit, zero
    assert native.ef_encode(b"", 17, 2) == bytes(1)  # 0 + (17 >> 2) + 1 = 5 bits
    native.ef_decode(b"\x00", 0, 0, 0, bytearray())
    _ef_roundtrip(np.arange(100, dtype=np.int64), 100, 0)


@pytest.mark.parametrize("where", [0, 1, 4])
@pytest.mark.parametrize("kind", ["negative", "repeat", "decrease", "numel"])
def test_ef_encode_names_the_first_bad_position(where: int, kind: str) -> None:
    idx = np.array([10, 20, 30, 40, 50], dtype=np.int64)
    bad = {"negative": -5, "repeat": idx[where - 1] if where else -1, "numel": 64}.get(kind, 1)
    idx[where] = bad
    if kind == "decrease" and where == 0:
        idx[1] = 0  # 10 > 0: the first bad one is index 1
    at = 1 if kind == "decrease" and where == 0 else where
    with pytest.raises(ValueError, match=rf"positions\[{at}\] = {idx[at]}: .*\[0, 64\)"):
        native.ef_encode(idx, 64, 3)


def test_ef_encode_rejects_bad_arguments() -> None:
    idx = np.array([1, 5], np.int64)
    with pytest.raises(ValueError, match="low_bits"):
        native.ef_encode(idx, 10, 64)
    with pytest.raises(ValueError, match="low_bits"):
        native.ef_encode(idx, 10, -1)
    with pytest.raises(ValueError, match="numel"):
        native.ef_encode(idx, -1, 0)
    with pytest.raises(ValueError, match="int64"):
        native.ef_encode(np.zeros(3, np.int32)[:1].tobytes() + b"x", 10, 0)
    with pytest.raises(TypeError, match="buffer protocol"):
        native.ef_encode([1, 5], 10, 0)
    with pytest.raises(ValueError, match="contiguous"):
        native.ef_encode(np.arange(10, dtype=np.int64)[::2], 10, 0)
    with pytest.raises(OverflowError):
        native.ef_encode(idx, 2**63, 0)
    for header in (-2, 256):
        with pytest.raises(ValueError, match="header"):
            native.ef_encode(idx, 10, 1, header)
    assert native.ef_encode(idx, 10, 1, 0x81) == b"\x81" + native.ef_encode(idx, 10, 1)


def test_ef_decode_rejects_bad_arguments() -> None:
    idx = np.array([1, 5, 9], np.int64)
    payload = native.ef_encode(idx, 10, 1)
    out = np.zeros(3, np.int64)
    native.ef_decode(payload, 3, 10, 1, out)
    assert out.tolist() == [1, 5, 9]
    with pytest.raises(ValueError, match=f"positions blob is {len(payload) - 1} bytes, want"):
        native.ef_decode(payload[:-1], 3, 10, 1, out)
    with pytest.raises(ValueError, match="out_positions is 16 bytes, want 3 int64"):
        native.ef_decode(payload, 3, 10, 1, np.zeros(2, np.int64))
    with pytest.raises(ValueError, match="out_positions is 25 bytes"):
        native.ef_decode(payload, 3, 10, 1, bytearray(25))
    with pytest.raises(TypeError, match="out_positions must be a writable"):
        native.ef_decode(payload, 3, 10, 1, bytes(24))
    with pytest.raises(ValueError, match="low_bits"):
        native.ef_decode(payload, 3, 10, 99, out)
    with pytest.raises(ValueError, match=">= 0"):
        native.ef_decode(payload, -3, 10, 1, out)
    # sizes that do not fit in memory: refused before anything is allocated or read
    with pytest.raises(OverflowError):
        native.ef_decode(payload, 2**62, 2**62, 63, out)
    with pytest.raises(ValueError, match="bytes, want"):
        native.ef_decode(payload, 2**62, 2**62, 0, out)
    with pytest.raises(ValueError, match="bytes, want"):
        native.ef_decode(payload, 3, 2**63 - 1, 0, out)
    assert out.tolist() == [1, 5, 9]


def test_ef_decode_errors() -> None:
    idx = [3, 17, 18, 60, 61, 62, 95]  # L = 3: 21 low bits, 20 high bits
    good = reference_payload(idx, 100, 3)
    out = np.zeros(7, np.int64)

    def dec(payload: bytes) -> None:
        native.ef_decode(payload, 7, 100, 3, out)

    dec(good)
    assert out.tolist() == idx
    for byte, bit, msg in (
        (2, 5, "low part has bits set past its 21 bits"),
        (5, 4, "high part has bits set past its 20 bits"),
        (3, 0, "high bits hold 6 positions, want 7"),
        (3, 1, "high bits hold 8 positions, want 7"),
    ):
        bad = bytearray(good)
        bad[byte] ^= 1 << bit
        with pytest.raises(ValueError, match=msg):
            dec(bytes(bad))
    for wrong in (
        [3, 3, 18, 60, 61, 62, 95],
        [3, 17, 18, 61, 60, 62, 95],
        [3, 17, 18, 60, 61, 62, 101],
    ):
        with pytest.raises(ValueError, match=r"not strictly increasing within \[0, 100\)"):
            dec(reference_payload(wrong, 100, 3))


@_examples(400)
@given(
    n=st.integers(0, 80),
    numel=st.one_of(st.integers(0, 400), st.integers(0, 2**63 - 1)),
    low_bits=st.integers(0, 63),
    data=st.data(),
)
def test_ef_decode_any_bytes_never_crashes(
    n: int, numel: int, low_bits: int, data: st.DataObject
) -> None:
    """Random bytes (mostly of the expected size) and arguments: positions that re-encode to
    the same bytes, or ValueError/OverflowError; never a crash or a write outside ``out``."""
    size = -(-n * low_bits // 8) + -(-(n + (numel >> low_bits) + 1) // 8)
    exact = size <= 64 and data.draw(st.integers(0, 3), label="exact") > 0
    payload = data.draw(
        st.binary(min_size=size, max_size=size) if exact else st.binary(max_size=64)
    )
    out = np.zeros(n + 2, np.int64)
    try:
        native.ef_decode(payload, n, numel, low_bits, out[1 : n + 1])
    except (ValueError, OverflowError):
        return
    assert out[0] == 0 and out[-1] == 0
    assert native.ef_encode(out[1 : n + 1], numel, low_bits) == payload


def test_ef_runs_alongside_other_threads() -> None:
    rng = np.random.default_rng(4)
    numel = 4_000_000
    idx = np.flatnonzero(rng.random(numel) < 0.03).astype(np.int64)
    want = native.ef_encode(idx, numel, 5)
    results: list[bool] = []

    def work() -> None:
        payload = native.ef_encode(idx, numel, 5)
        out = np.empty(idx.size, np.int64)
        native.ef_decode(payload, idx.size, numel, 5, out)
        results.append(payload == want and bool(np.array_equal(out, idx)))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * 4


# ------------------------------------------------------- Xxh3, diff + hash + advance, patch_hash


@pytest.mark.parametrize("bits", [64, 128])
def test_xxh3_digests_are_python_xxhash_ones(bits: int, diff_loop: str) -> None:
    import xxhash

    ref = xxhash.xxh3_64 if bits == 64 else xxhash.xxh3_128
    rng = np.random.default_rng(bits)
    for size in (0, 1, 15, 16, 17, 240, 241, 1024, 65535, 65536, 1 << 20 | 3):
        data = rng.integers(0, 256, size, dtype=np.uint8)
        h = native.Xxh3(bits)
        for piece in np.array_split(data, 5):  # streaming: any split gives the same digest
            h.update(piece)
        assert h.hexdigest() == ref(data.tobytes()).hexdigest(), size
    with pytest.raises(ValueError, match="bits"):
        native.Xxh3(32)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("cap", [7, 1000, None])
def test_diff_extract_hashes_and_advances_in_its_pass(
    width: int, cap: int | None, diff_loop: str
) -> None:
    import xxhash

    rng = np.random.default_rng(width)
    n = 200_003  # several 64 KiB blocks, a tail that is not a whole word
    old, new = _pair(rng, width, n, 0.03)
    ref = _reference(old, new)
    cap = cap or n
    adv, h = _unaligned(old, 3), native.Xxh3(128)
    pos, vals, xor = (np.empty(cap, np.int64), np.empty(cap, DT[width]), np.empty(cap, DT[width]))
    got: list[list[np.ndarray]] = [[], [], []]
    start = 0
    while start < n:  # resumed whenever the outputs fill: each element hashed exactly once
        count, start = native.diff_extract(adv, new, width, start, pos, vals, xor, h, True)
        for acc, a in zip(got, (pos, vals, xor), strict=True):
            acc.append(a[:count].copy())
    for acc, want in zip(got, ref, strict=True):
        assert np.array_equal(np.concatenate(acc), want)
    assert np.array_equal(adv, new)  # old became new
    assert h.hexdigest() == xxhash.xxh3_128(new.tobytes()).hexdigest()
    with pytest.raises(TypeError, match="writable"):
        native.diff_extract(old.tobytes(), new, width, 0, pos, vals, xor, None, True)
    with pytest.raises(TypeError, match="Xxh3"):
        native.diff_extract(old, new, width, 0, pos, vals, xor, "not a hasher", False)


@pytest.mark.parametrize("width", WIDTHS)
def test_patch_hash_patches_and_hashes_a_range(width: int, diff_loop: str) -> None:
    import xxhash

    rng = np.random.default_rng(10 + width)
    n = 150_001
    flat = rng.integers(0, 256, n * width, dtype=np.uint8).view(DT[width])
    lo, hi = 1000, n - 7
    pos = np.sort(rng.choice(np.arange(lo, hi), 4000, replace=False)).astype(np.int64)
    vals = rng.integers(1, 256, 4000 * width, dtype=np.uint8).view(DT[width])
    for is_xor in (True, False):
        want = flat.copy()
        want[pos] = (want[pos] ^ vals) if is_xor else vals
        got, h = _unaligned(flat, 5), native.Xxh3(64)
        native.patch_hash(got, width, pos, vals, is_xor, lo, hi, h)
        assert np.array_equal(got, want)
        assert h.hexdigest() == xxhash.xxh3_64(want[lo:hi].tobytes()).hexdigest()
        dense = rng.integers(0, 256, (hi - lo) * width, dtype=np.uint8).view(DT[width])
        want = flat.copy()
        want[lo:hi] = (want[lo:hi] ^ dense) if is_xor else dense
        got = flat.copy()
        native.patch_hash(got, width, None, dense, is_xor, lo, hi, None)
        assert np.array_equal(got, want)
    for bad in (pos[::-1].copy(), np.array([lo - 1], np.int64), np.array([hi], np.int64)):
        before = flat.copy()
        with pytest.raises(ValueError, match="strictly increasing"):
            native.patch_hash(flat, width, bad, vals[: bad.size], True, lo, hi, None)
        assert np.array_equal(flat, before)  # checked before any write
    with pytest.raises(ValueError, match="range"):
        native.patch_hash(flat, width, None, vals[:0], True, 5, n + 1, None)


@pytest.mark.parametrize("width", WIDTHS)
def test_planes_and_unplanes_transpose_bytes(width: int) -> None:
    rng = np.random.default_rng(20 + width)
    n = 10_007
    src = rng.integers(0, 256, n * width, dtype=np.uint8)
    out = np.empty_like(src)
    native.planes(src, width, out)
    assert np.array_equal(out, src.reshape(n, width).T.reshape(-1))
    back = np.empty_like(src)
    native.unplanes(out, width, back)
    assert np.array_equal(back, src)
    with pytest.raises(ValueError, match="out is"):
        native.planes(src, width, np.empty(n * width + 1, np.uint8))


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("zero_share", [0.0, 0.3, 1.0])
def test_unplanes_counts_the_zero_elements(width: int, zero_share: float) -> None:
    """decode_delta refuses a sparse xef blob with a zero XOR by this count (no pass of its
    own): an element is zero only when all its bytes are (a zero low byte alone is not)."""
    rng = np.random.default_rng(int(zero_share * 10) + width)
    n = 4099
    elems = rng.integers(1, 256, (n, width), dtype=np.uint8)  # no zero element
    zero = rng.random(n) < zero_share
    elems[zero] = 0
    if width > 1:  # elements with some zero bytes, not all: not zero
        some = ~zero & (rng.random(n) < 0.5)
        elems[some, : width - 1] = 0
    src = elems.reshape(-1)
    planes = np.empty_like(src)
    assert native.planes(src, width, planes) is None
    back = np.empty_like(src)
    assert native.unplanes(planes, width, back) == int(zero.sum())
    assert np.array_equal(back, src)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("pos_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("shift", [0, 7, -5])
def test_xor_shifted_matches_reference(width: int, pos_dtype: Any, shift: int) -> None:
    rng = np.random.default_rng(width * 100 + shift)
    n = 1003
    flat = rng.integers(0, 256, n * width, dtype=np.uint8).view(DT[width])
    lo, hi = max(0, -shift), min(n, n - shift)  # HF indices whose shifted place is in flat
    for k in (0, 1, 17, hi - lo):
        pos = np.sort(rng.choice(np.arange(lo, hi), k, replace=False)).astype(pos_dtype)
        vals = rng.integers(0, 256, k * width, dtype=np.uint8).view(DT[width])
        want = flat.copy()
        want[pos.astype(np.int64) + shift] ^= vals
        target = _unaligned(flat, 3)
        native.xor_shifted(target, width, _unaligned(pos, 1), pos.itemsize, shift, vals)
        assert np.array_equal(target, want)


@pytest.mark.parametrize("bad", [-1, 8, 2**31 - 1, -(2**31)])
@pytest.mark.parametrize("where", [0, 2, 4])
def test_xor_shifted_bounds_checked_before_any_write(bad: int, where: int) -> None:
    flat = np.arange(10, dtype=np.uint32)
    before = flat.copy()
    pos = np.array([0, 2, 4, 6, 7], dtype=np.int32)
    pos[where] = bad
    with pytest.raises(IndexError, match=rf"positions\[{where}\] = {bad} shifted by 2"):
        native.xor_shifted(flat, 4, pos, 4, 2, np.full(5, 0xFFFF, np.uint32))
    assert np.array_equal(flat, before)


def test_xor_shifted_rejects_bad_arguments() -> None:
    flat, pos, vals = np.zeros(8, np.uint16), np.array([1, 2], np.int64), np.ones(2, np.uint16)
    with pytest.raises(ValueError, match="width must be"):
        native.xor_shifted(flat, 3, pos, 8, 0, vals)
    with pytest.raises(ValueError, match="positions width must be 4 or 8"):
        native.xor_shifted(flat, 2, pos, 2, 0, vals)
    with pytest.raises(ValueError, match="values is 6 bytes, want 4"):
        native.xor_shifted(flat, 2, pos, 8, 0, np.zeros(3, np.uint16))
    with pytest.raises(ValueError, match="whole number"):
        native.xor_shifted(flat, 2, np.zeros(3, np.uint8), 8, 0, vals)
    with pytest.raises(ValueError, match="shift"):
        native.xor_shifted(flat, 2, pos, 8, 2**62, vals)
    with pytest.raises(TypeError, match="writable"):
        native.xor_shifted(bytes(16), 2, pos, 8, 0, vals)
    assert not flat.any()


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_increasing(dtype: Any) -> None:
    ok = np.array([0, 3, 9], dtype)
    assert native.increasing(ok, ok.itemsize, 10)
    assert native.increasing(np.zeros(0, dtype), ok.itemsize, 0)
    for bad, limit in (([0, 3, 10], 10), ([3, 3], 10), ([4, 3], 10), ([-1, 3], 10),
                       ([0, 1], 1)):  # fmt: skip
        assert not native.increasing(np.array(bad, dtype), ok.itemsize, limit), bad
    with pytest.raises(ValueError, match="positions width"):
        native.increasing(ok, 2, 10)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("n", [1, 7, 2048, 40_000])
def test_small_planes_match_the_kernel(width: int, n: int, monkeypatch: Any) -> None:
    """A tensor below delta._SMALL_PLANES bytes is planed by NumPy (a MoE's thousands of small
    experts: the kernel's call and scratch buffer cost more than the bytes), one below
    _SMALL_UNPLANES unplaned by NumPy (none, unless set); both paths give the same bytes, the
    same writable tensor and the same count of nonzero elements, whichever path a size takes."""
    import torch

    from asyncsync.codec import delta

    rng = np.random.default_rng(n + width)
    raw = rng.integers(0, 256, n * width, dtype=np.uint8)
    v = torch.from_numpy(raw.view(delta._NP_BY_WIDTH[width]).copy())
    v[::3] = 0
    got = [bytes(delta._planes(v))]
    back = [delta._unplanes(got[0], n, width)]
    for name in ("_SMALL_PLANES", "_SMALL_UNPLANES"):  # the other path
        monkeypatch.setattr(delta, name, 0 if n * width < getattr(delta, name) else 1 << 62)
    got.append(bytes(delta._planes(v)))
    back.append(delta._unplanes(got[0], n, width))
    assert got[0] == got[1] == raw_planes(v.numpy().view(np.uint8), width)
    for t, nonzero in back:
        assert t.dtype == v.dtype and t.shape == (n,) and t.is_contiguous()
        assert torch.equal(t, v) and nonzero == int(torch.count_nonzero(v))
        t[0] = 1  # writable, its own memory
        assert v[0].item() == 0


def raw_planes(u8: np.ndarray[Any, Any], width: int) -> bytes:
    return u8.reshape(-1, width).T.tobytes()


def _diff_one(
    old: np.ndarray, new: np.ndarray, bits: int, advance: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray, str | None]:
    """One pair through diff_extract (outputs with room for every element), as diff_many's
    reference: positions, new values, XORs and the hasher's hexdigest."""
    n, width = old.size, old.itemsize
    pos, nv, xv = np.empty(n, np.int64), np.empty(n, old.dtype), np.empty(n, old.dtype)
    h = native.Xxh3(bits) if bits else None
    count = 0
    if n:
        extra = (h, advance) if h is not None or advance else ()
        count, end = native.diff_extract(old, new, width, 0, pos, nv, xv, *extra)
        assert end == n
    return pos[:count], nv[:count], xv[:count], h.hexdigest() if h is not None else None


@_examples(120)
@given(
    width=st.sampled_from(WIDTHS),
    bits=st.sampled_from([0, 64, 128]),
    advance=st.booleans(),
    sizes=st.lists(
        st.one_of(st.integers(0, 300), st.sampled_from([2048, 40_000])), min_size=0, max_size=6
    ),
    density=st.sampled_from([0.0, 0.03, 0.5, 1.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_diff_many_is_diff_extract_of_each_pair(
    width: int,
    bits: int,
    advance: bool,
    sizes: list[int],
    density: float,
    seed: int,
    diff_loop: str,
) -> None:
    """diff_many (a MoE's small tensors, many to a call) gives each pair exactly what
    diff_extract gives it alone: positions relative to the pair, values, XORs, the digest of
    the bytes its outputs make (across 64 KiB hash blocks too) and, with advance, the olds."""
    rng = np.random.default_rng(seed)
    olds = [rng.integers(0, 256, n * width, dtype=np.uint8).view(DT[width]) for n in sizes]
    news = []
    for old in olds:
        new = old.copy()
        hit = rng.random(old.size) < density
        new[hit] ^= rng.integers(1, 255, int(hit.sum()), dtype=np.uint8).astype(DT[width])
        news.append(new)
    want = [_diff_one(o.copy(), n, bits, advance) for o, n in zip(olds, news, strict=True)]
    mine = [o.copy() for o in olds]
    total = sum(sizes)
    pos, nv, xv = np.empty(total, np.int64), np.empty(total, DT[width]), np.empty(total, DT[width])
    counts, digests = np.empty(len(olds), np.int64), np.empty(16 * len(olds), np.uint8)
    got = native.diff_many(mine, news, width, pos, nv, xv, counts, digests, bits, advance)
    assert got == sum(len(w[0]) for w in want) == counts.sum()
    start = 0
    for j, (wpos, wnv, wxv, wdigest) in enumerate(want):
        end = start + int(counts[j])
        assert np.array_equal(pos[start:end], wpos)
        assert np.array_equal(nv[start:end], wnv) and np.array_equal(xv[start:end], wxv)
        if bits:
            assert digests[16 * j : 16 * j + bits // 8].tobytes().hex() == wdigest
        assert np.array_equal(mine[j], news[j] if advance else olds[j])
        start = end


def test_diff_many_rejects_bad_arguments_before_any_pair() -> None:
    """Every argument is checked before the first pair is diffed: an error leaves every old
    as it was (the caller's advance is all or nothing)."""
    olds = [np.zeros(8, np.uint16), np.zeros(8, np.uint16)]
    news = [np.ones(8, np.uint16), np.ones(8, np.uint16)]
    pos, nv, xv = np.empty(16, np.int64), np.empty(16, np.uint16), np.empty(16, np.uint16)
    counts, digests = np.empty(2, np.int64), np.empty(32, np.uint8)
    ok = (pos, nv, xv, counts, digests)
    readonly = np.zeros(8, np.uint16)
    readonly.flags.writeable = False
    bad: list[tuple[tuple[Any, ...], type[Exception], str]] = [
        ((olds, news[:1], 2, *ok, 0, True), ValueError, "2 olds but 1 news"),
        ((olds, news, 3, *ok, 0, True), ValueError, "width"),
        ((olds, news, 2, *ok, 32, True), ValueError, "bits"),
        (([olds[0], readonly], news, 2, *ok, 0, True), TypeError, r"olds\[1\] must be a writable"),
        (([olds[0], np.zeros(16, np.uint16)[::2]], news, 2, *ok, 0, True), ValueError, "contig"),
        (([olds[0], np.zeros(7, np.uint16)], news, 2, *ok, 0, True), ValueError, "bytes but"),
        (
            ([olds[0], np.zeros(3, np.uint16)], [news[0], np.ones(3, np.uint16)], 4, *ok, 0, True),
            ValueError,
            r"olds\[1\] is 6 bytes, not a whole number",
        ),
        ((olds, news, 2, pos[:15], nv, xv, counts, digests, 0, True), ValueError, "hold all"),
        ((olds, news, 2, pos, nv, xv, counts[:1], digests, 0, True), ValueError, "2 pairs"),
        ((olds, news, 2, pos, nv, xv, counts, digests[:31], 128, True), ValueError, "2 pairs"),
        ((olds, 5, 2, *ok, 0, True), TypeError, "sequence"),
        (([olds[0], "x"], news, 2, *ok, 0, True), TypeError, "bytes-like"),
    ]
    for args, exc, match in bad:
        with pytest.raises(exc, match=match):
            native.diff_many(*args)
        assert not any(o.any() for o in olds)
    assert native.diff_many([], [], 2, *ok) == 0
