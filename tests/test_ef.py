"""Tests of asyncsync.codec.ef (Elias-Fano payloads) on the C kernel and on the NumPy fallback.

Both paths are checked against a bit-by-bit reference written from docs/FORMAT.md section 4.2,
against each other (byte-identical payloads; the same FormatError message for every damaged
payload), for every L from 0 to 61, n == numel, clustered and random positions, and universes
up to 2**62. The kernels' own argument handling is in test_native.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncsync.codec import delta as codec_delta
from asyncsync.codec import ef, native
from asyncsync.errors import ConfigError, FormatError

ORDER = "not strictly increasing"


def _examples(n: int) -> settings:
    return settings(max_examples=n, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def reference_payload(idx: Sequence[int], numel: int, low_bits: int | None = None) -> bytes:
    """The EF payload of ``idx`` straight from the spec, with no checks (bad inputs welcome)."""
    n = len(idx)
    bits = (numel // n).bit_length() - 1 if low_bits is None else low_bits
    low = high = 0
    for k, p in enumerate(idx):
        low |= (p & ((1 << bits) - 1)) << (k * bits)
        high |= 1 << ((p >> bits) + k)
    high_bits = n + (numel >> bits) + 1
    return low.to_bytes(-(-n * bits // 8), "little") + high.to_bytes(-(-high_bits // 8), "little")


def _reference_decode(payload: bytes, n: int, numel: int) -> list[int]:
    bits = ef.low_bits(n, numel)
    low_len = -(-n * bits // 8)
    low, high = int.from_bytes(payload[:low_len], "little"), payload[low_len:]
    ones = [i for i in range(len(high) * 8) if high[i // 8] >> (i % 8) & 1]
    return [(p - k) << bits | (low >> (k * bits)) & ((1 << bits) - 1) for k, p in enumerate(ones)]


@pytest.fixture(params=["native", "numpy"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test on the C kernel and again on the NumPy fallback."""
    if request.param == "native" and native.kernels is None:
        pytest.skip("asyncsync.codec._native is not built (or ASYNCSYNC_NATIVE=0)")
    if request.param == "numpy":
        monkeypatch.setattr(native, "kernels", None)
    return str(request.param)


@pytest.fixture(params=["bmi2", "baseline"])
def ef_loop(request: pytest.FixtureRequest) -> Any:
    """A kernel test runs twice: with the SIMD kernels on (the encode's loop and the decode's
    fast loop compiled for BMI1/BMI2, where the CPU has them; skipped where the build or CPU
    has no AVX2 kernels) and off (the baseline loops); both must give the spec's answers."""
    if native.kernels is None:
        pytest.skip("asyncsync.codec._native is not built (or ASYNCSYNC_NATIVE=0)")
    before = native.kernels.simd()
    try:
        native.kernels.simd(request.param == "bmi2")
    except ValueError:
        pytest.skip("this CPU or build has no SIMD kernels")
    yield request.param
    native.kernels.simd(before)


def _both(fn: Callable[[], Any]) -> list[Any]:
    """``fn()`` on each available path: its result, or the (type, message) of what it raised."""
    out = []
    kernels = [native.kernels, None] if native.kernels is not None else [None]
    for k in kernels:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(native, "kernels", k)
            try:
                got = fn()
                out.append(got.tolist() if isinstance(got, np.ndarray) else got)
            except (ConfigError, FormatError) as exc:
                out.append((type(exc).__name__, str(exc)))
    return out


def _check(idx: np.ndarray, numel: int, reference: bool = True) -> bytes:
    payload, bits = ef.encode(idx, numel)
    assert (
        bits == ef.low_bits(idx.size, numel) == max(b for b in range(63) if idx.size << b <= numel)
    )
    assert len(payload) == sum(ef.sizes(idx.size, numel, bits))
    if reference:
        assert payload == reference_payload(idx.tolist(), numel)
    got = ef.decode(payload, idx.size, numel)
    assert got.dtype == np.int64 and got.flags.writeable and np.array_equal(got, idx)
    return payload


def _random(rng: np.random.Generator, n: int, numel: int) -> np.ndarray:
    """``n`` sorted distinct positions (about ``n`` when both are large: a full shuffle is slow)."""
    if numel > 10**5 and 10 * n > numel:
        return np.flatnonzero(rng.random(numel) < n / numel).astype(np.int64)
    return np.sort(rng.choice(numel, size=n, replace=False)).astype(np.int64)


def _clustered(rng: np.random.Generator, n: int, numel: int) -> np.ndarray:
    """Runs of about 50 consecutive positions at random places (rows of a weight that moved)."""
    runs = max(1, n // 50)
    lengths = np.diff(np.linspace(0, n, runs + 1).astype(np.int64))
    free = np.sort(rng.choice(numel - n, size=runs, replace=False))  # unchanged ones before each
    starts = free + np.cumsum(lengths) - lengths
    return np.concatenate([s + np.arange(k) for s, k in zip(starts, lengths, strict=True)])


# ---------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 9, 15, 16, 17, 63, 64, 65, 1000])
def test_roundtrip_every_low_bits(path: str, n: int) -> None:
    rng = np.random.default_rng(n)
    for bits in range(0, 42):
        for numel in {n << bits, (n << bits) + n - 1, ((n << bits) * 3) // 2}:
            if numel.bit_length() > 62:
                continue
            idx = (
                _random(rng, n, numel)
                if numel < 10**6
                else np.unique(rng.integers(0, numel, n, dtype=np.int64))
            )
            if idx.size == n:
                _check(idx, numel)
        assert ef.low_bits(n, n << bits) == bits


@pytest.mark.parametrize("numel", [1, 2, 7, 8, 9, 64, 1001, 2**20 + 3])
def test_every_position_changed(path: str, numel: int) -> None:
    """n == numel: L = 0, the high part is all ones but the last bit."""
    idx = np.arange(numel, dtype=np.int64)
    payload = _check(idx, numel, reference=numel < 10**4)
    assert ef.low_bits(numel, numel) == 0 and len(payload) == -(-(2 * numel + 1) // 8)


@pytest.mark.parametrize("density", [1e-6, 1e-3, 0.03, 0.3, 0.8, 1.0])
@pytest.mark.parametrize("shape", ["random", "clustered", "edges"])
def test_roundtrip_millions(path: str, density: float, shape: str) -> None:
    numel = 3_000_017
    rng = np.random.default_rng(int(density * 1e6))
    n = max(1, int(numel * density))
    if shape == "random":
        idx = _random(rng, n, numel)
    elif shape == "clustered":
        idx = _clustered(rng, n, numel) if n < numel else np.arange(numel, dtype=np.int64)
    else:  # the first and the last positions always in
        idx = _random(rng, n, numel)
        idx = np.r_[0, idx[(idx > 0) & (idx < numel - 1)], numel - 1].astype(np.int64)
    _check(idx, numel, reference=False)


@pytest.mark.parametrize(
    "density",
    [1e-3, 0.03, pytest.param(0.3, marks=pytest.mark.heavy)],  # 0.3: ~13 s a loop
)
def test_loops_agree_at_scale(density: float, ef_loop: str) -> None:
    """Millions of positions (past the fast loop's first words and its prefetch distance)
    encode to the spec's payload and decode to the same positions with either loop."""
    numel = 3_000_017
    idx = _random(np.random.default_rng(5), int(numel * density), numel)
    payload, bits = ef.encode(idx, numel)
    assert payload == reference_payload(idx.tolist(), numel, bits)
    out = np.full(idx.size, -1, np.int64)
    native.kernels.ef_decode(payload, idx.size, numel, bits, out)
    assert np.array_equal(out, idx)


def test_native_and_numpy_payloads_identical_at_scale() -> None:
    rng = np.random.default_rng(5)
    numel = 32_500_000 // 8
    for n in (1, 40_000, 121_875, 2_000_000):
        idx = _random(rng, n, numel)
        encoded = _both(lambda idx=idx: ef.encode(idx, numel))
        assert all(e == encoded[0] for e in encoded)
        payload = encoded[0][0]
        decoded = _both(lambda p=payload, k=idx.size: ef.decode(p, k, numel))
        assert all(d == idx.tolist() for d in decoded)


def test_huge_universes(path: str) -> None:
    for numel in (2**31, 2**33 + 1, 2**62 - 1, 2**62):
        for idx in ([0], [numel - 1], [0, 1, numel - 2, numel - 1], [3, numel // 2 + 5, numel - 1]):
            _check(np.array(idx, dtype=np.int64), numel)


@pytest.mark.parametrize("n", [1, 2, 7, 1000, 65_536])
def test_headed_encode_is_the_header_then_the_payload(path: str, n: int) -> None:
    """``headed=True`` gives one byte L, then exactly the payload ``encode`` gives without it,
    for every L (dense and sparse), on both paths; bad positions are refused the same way."""
    rng = np.random.default_rng(n)
    for numel in sorted({n, n + 1, 2 * n, 3 * n + 1, 64 * n, 2**40}):
        idx = _random(rng, n, numel) if numel < 2**40 else np.unique(rng.integers(0, numel, n))
        payload, bits = ef.encode(idx, numel)
        assert ef.encode(idx, numel, headed=True) == (bytes([bits]) + payload, bits)
    with pytest.raises(ConfigError, match=r"positions\[1\] = 1: "):
        ef.encode(np.array([1, 1], dtype=np.int64), 10, headed=True)


def test_encode_accepts_a_strided_view(path: str) -> None:
    idx = np.arange(0, 4000, 3, dtype=np.int64)
    _check(idx[::2], 4000)
    _check(np.arange(10, dtype=np.int64)[2:], 10)


@_examples(300)
@given(
    numel=st.integers(1, 2**62),
    data=st.data(),
)
def test_property_roundtrip_identical_on_both_paths(numel: int, data: st.DataObject) -> None:
    n = data.draw(st.integers(1, min(numel, 200)), label="n")
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    rng = np.random.default_rng(seed)
    if data.draw(st.booleans(), label="clustered") and numel > n:
        start = int(rng.integers(0, numel - n + 1))
        idx = np.arange(start, start + n, dtype=np.int64)
    elif numel <= 10 * n:
        idx = _random(rng, n, numel)
    else:
        idx = np.unique(rng.integers(0, numel, size=n, dtype=np.int64))
    want = reference_payload(idx.tolist(), numel)
    for payload, bits in _both(lambda: ef.encode(idx, numel)):
        assert payload == want and bits == ef.low_bits(idx.size, numel)
    assert _both(lambda: ef.decode(want, idx.size, numel)) in ([idx.tolist()] * 2, [idx.tolist()])


# -------------------------------------------------------------------------- bad positions


@pytest.mark.parametrize(
    ("idx", "at"),
    [([-1, 2, 3], 0), ([1, 1, 2], 1), ([5, 3, 9], 1), ([1, 2, 100], 2), ([0, 2**40], 1)],
)
def test_encode_names_the_first_bad_position(path: str, idx: list[int], at: int) -> None:
    with pytest.raises(ConfigError, match=rf"positions\[{at}\] = {idx[at]}: .*\[0, 100\)"):
        ef.encode(np.array(idx, dtype=np.int64), 100)


def test_encode_rejects_bad_arrays(path: str) -> None:
    with pytest.raises(ConfigError, match="1 <= n <= numel"):
        ef.encode(np.zeros(0, np.int64), 10)
    with pytest.raises(ConfigError, match="1 <= n <= numel"):
        ef.encode(np.arange(4, dtype=np.int64), 3)
    with pytest.raises(ConfigError, match="int64"):
        ef.encode(np.arange(4, dtype=np.int32), 10)
    with pytest.raises(ConfigError, match="1-D"):
        ef.encode(np.arange(4, dtype=np.int64).reshape(2, 2), 10)


# ------------------------------------------------------------------------ hostile payloads


def _decode_errors(payload: bytes, n: int, numel: int) -> list[Any]:
    got = _both(lambda: ef.decode(payload, n, numel))
    assert all(g == got[0] for g in got), got  # the same outcome, message included
    return got


def _refused(payload: bytes, n: int, numel: int, match: str) -> None:
    got = _decode_errors(payload, n, numel)
    assert got[0][0] == "FormatError" and match in got[0][1], got


def test_wrong_sizes_are_refused() -> None:
    idx = [1, 5, 40, 41, 99]
    good = reference_payload(idx, 100)
    assert _decode_errors(good, 5, 100)[0] == idx
    for bad in (b"", good[:-1], good + b"\0", good[1:], bytes(len(good) + 8)):
        _refused(bad, 5, 100, "bytes, want")
    _refused(good, 9, 100, "bytes, want")  # n and numel decide the size
    _refused(good, 5, 50, "bytes, want")
    for n, numel in ((0, 100), (101, 100), (-1, 100), (1, 0)):
        _refused(good, n, numel, "impossible")


def test_set_bit_count_must_be_n() -> None:
    idx = [3, 17, 18, 60, 61, 62, 95]  # L = 3, high part: 7 + 12 + 1 = 20 bits, 3 bytes
    good = bytearray(reference_payload(idx, 100))
    low_len = ef.sizes(7, 100, 3)[0]
    assert len(good) == low_len + 3
    for bit in range(20):
        bad = bytearray(good)
        bad[low_len + bit // 8] ^= 1 << (bit % 8)
        got = _decode_errors(bytes(bad), 7, 100)[0]
        ones = 7 + (1 if bad[low_len + bit // 8] >> (bit % 8) & 1 else -1)
        assert got == ("FormatError", f"Elias-Fano high bits hold {ones} positions, want 7")
    _refused(bytes(low_len) + b"\0\0\0", 7, 100, "hold 0 positions, want 7")
    _refused(bytes(low_len) + b"\xff\xff\x0f", 7, 100, "hold 20 positions, want 7")


def test_bits_past_the_end_are_refused() -> None:
    idx = [3, 17, 18, 60, 61, 62, 95]  # 21 low bits (3 bytes), 20 high bits (3 bytes)
    good = reference_payload(idx, 100)
    for byte, bit, what in ((2, 5, "low part"), (2, 7, "low part"), (5, 4, "high part")):
        bad = bytearray(good)
        bad[byte] |= 1 << bit
        _refused(bytes(bad), 7, 100, f"Elias-Fano {what} has bits set past its")
    # a trailing high bit that stands in for a missing one: caught as trailing, not counted
    bad = bytearray(good)
    bad[5] = (bad[5] & 0x07) | 0x10
    bad[3] &= 0xFE
    _refused(bytes(bad), 7, 100, "high part has bits set past its 20 bits")


@pytest.mark.parametrize(
    ("idx", "numel"),
    [
        ([1, 1, 2], 100),  # repeated
        ([3, 2, 9], 100),  # decreasing low parts within one high bucket
        ([33, 34, 40, 35], 100),  # decreasing within a later high bucket
        ([1, 2, 99], 90),  # high part past numel >> L
        ([1, 2, 95], 90),  # high part == numel >> L, low part makes it >= numel
        ([0, 2**62 + 5], 2**62),  # the largest universe: no overflow on the way
        ([0, 3 << 61], 2**62),  # high part past numel >> L, where the shift would overflow
    ],
)
def test_positions_must_increase_within_the_tensor(idx: list[int], numel: int) -> None:
    payload = reference_payload(idx, numel)
    _refused(payload, len(idx), numel, f"positions {ORDER} within [0, {numel})")
    blob = bytes([ef.low_bits(len(idx), numel)]) + payload
    with pytest.raises(FormatError, match=ORDER):
        codec_delta._ef_decode(blob, len(idx), numel)


@_examples(400)
@given(data=st.data())
def test_damaged_payloads_same_outcome_on_both_paths(data: st.DataObject) -> None:
    """Random bit flips, or random bytes of the right size: never a crash, and the two paths
    agree on the positions or on the exact error."""
    numel = data.draw(st.sampled_from([1, 5, 64, 100, 1000, 4097, 2**40, 2**62]), label="numel")
    n = data.draw(st.integers(1, min(numel, 60)), label="n")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    idx = (
        _random(rng, n, numel)
        if numel < 10**6
        else np.unique(rng.integers(0, numel, n, dtype=np.int64))
    )
    payload = bytearray(reference_payload(idx.tolist(), numel))
    if data.draw(st.booleans(), label="random bytes"):
        payload = bytearray(data.draw(st.binary(min_size=len(payload), max_size=len(payload))))
    else:
        for bit in data.draw(st.lists(st.integers(0, 8 * len(payload) - 1), max_size=4)):
            payload[bit // 8] ^= 1 << (bit % 8)
    got = _decode_errors(bytes(payload), idx.size, numel)[0]
    if isinstance(got, list):  # accepted: it must be what the spec says the bytes mean
        assert got == _reference_decode(bytes(payload), idx.size, numel)
        assert got == sorted(set(got)) and got[0] >= 0 and got[-1] < numel
        assert reference_payload(got, numel) == bytes(payload)  # one payload per position set


def test_decode_takes_any_buffer_and_returns_a_fresh_array(path: str) -> None:
    idx = np.array([2, 3, 500, 9999], dtype=np.int64)
    payload = _check(idx, 10_000)
    for buf in (bytearray(payload), memoryview(payload), np.frombuffer(payload, np.uint8)):
        got = ef.decode(buf, 4, 10_000)
        assert np.array_equal(got, idx)
    blob = memoryview(b"\0" + payload)[1:]  # unaligned
    a, b = ef.decode(blob, 4, 10_000), ef.decode(blob, 4, 10_000)
    a[0] = 7
    assert b[0] == 2


# ------------------------------------------- the kernels' fast loops, for any L, against the spec


def _spec_decode(payload: bytes, n: int, numel: int, bits: int) -> list[int] | str:
    """What ``ef_decode`` must answer for ``payload`` with any L: the positions, or the message
    of the first check that fails (checks in the order the module docstring lists them)."""
    low_len, high_bits = -(-n * bits // 8), n + (numel >> bits) + 1
    if len(payload) != low_len + -(-high_bits // 8):
        return f"positions blob is {len(payload)} bytes, want {low_len + -(-high_bits // 8)}"
    low, high = int.from_bytes(payload[:low_len], "little"), payload[low_len:]
    if low >> (n * bits):
        return f"Elias-Fano low part has bits set past its {n * bits} bits"
    if int.from_bytes(high, "little") >> high_bits:
        return f"Elias-Fano high part has bits set past its {high_bits} bits"
    ones = np.flatnonzero(np.unpackbits(np.frombuffer(high, np.uint8), bitorder="little"))
    if ones.size != n:
        return f"Elias-Fano high bits hold {ones.size} positions, want {n}"
    mask = (1 << bits) - 1
    got = [(int(b) - k) << bits | (low >> (k * bits)) & mask for k, b in enumerate(ones)]
    if got[-1] >= numel or any(b <= a for a, b in pairwise(got)):
        return f"positions not strictly increasing within [0, {numel})"
    return got


def _kernel_decode(payload: bytes, n: int, numel: int, bits: int) -> list[int] | str:
    out = np.full(n, -7, np.int64)
    try:
        native.kernels.ef_decode(payload, n, numel, bits, out)
    except ValueError as exc:
        return str(exc)
    return [int(p) for p in out]


def _kernel_cases(seed: int) -> list[tuple[np.ndarray, int, int]]:
    """Positions, numel and L (any, not only the rule's) with payloads long enough for the
    kernels' fast loops (low part and high part past 8 bytes) and their ends."""
    rng = np.random.default_rng(seed)
    cases = []
    for bits in range(64):
        n = int(rng.choice([1, 2, 9, 63, 64, 65, 200, 777, 3000]))
        spare = int(rng.choice([0, 1, 2 ** int(rng.integers(1, 16))]))  # numel >> bits: small
        numel = min((n + spare) << bits, 2**63 - 1) - int(rng.integers(0, 2))
        if not 1 <= n <= numel:
            continue
        if rng.random() < 0.5 or numel < 4 * n:
            idx = np.sort(rng.choice(numel, size=n, replace=False)) if numel < 10**6 else None
        else:
            idx = None
        if idx is None:
            idx = np.unique(rng.integers(0, numel, size=n, dtype=np.int64))
        if rng.random() < 0.3:  # the ends of the tensor
            idx = np.unique(np.r_[idx, 0, numel - 1]).astype(np.int64)
        cases.append((idx.astype(np.int64), int(numel), bits))
    return cases


@pytest.mark.parametrize("seed", range(6))
def test_kernels_any_low_bits_and_damage_against_the_spec(seed: int, ef_loop: str) -> None:
    """Every L from 0 to 63 over payloads of up to ~3000 positions: the payload is the spec's,
    it decodes back, and every damaged payload (1-3 bits flipped anywhere, or the low part's
    fields shuffled so that order breaks inside the fast loop) gets exactly the spec's answer:
    the same positions or the same message, with either decode loop."""
    rng = np.random.default_rng(1000 + seed)
    for idx, numel, bits in _kernel_cases(seed):
        payload = native.kernels.ef_encode(idx, numel, bits)
        assert payload == reference_payload(idx.tolist(), numel, bits)
        assert _kernel_decode(payload, idx.size, numel, bits) == idx.tolist()
        damaged = []
        for _ in range(12):
            bad = bytearray(payload)
            for bit in rng.integers(0, 8 * len(bad), size=int(rng.integers(1, 4))):
                bad[bit // 8] ^= 1 << int(bit % 8)
            damaged.append(bytes(bad))
        if idx.size > 2 and bits:  # swap two low fields: the high bits stay valid
            j = int(rng.integers(0, idx.size - 1))
            swapped = idx.copy()
            hi, lo = swapped >> bits, swapped & ((1 << bits) - 1)
            lo[[j, j + 1]] = lo[[j + 1, j]]
            damaged.append(reference_payload((hi << bits | lo).tolist(), numel, bits))
        for bad in damaged:
            assert _kernel_decode(bad, idx.size, numel, bits) == _spec_decode(
                bad, idx.size, numel, bits
            )


@pytest.mark.parametrize("at", [0, 1, 63, 64, 500, 997, 998, 999])
@pytest.mark.parametrize("kind", ["negative", "repeat", "decrease", "numel", "far"])
def test_kernel_encode_names_the_first_bad_position_anywhere(
    at: int, kind: str, ef_loop: str
) -> None:
    """The encode's refusal where its loop stores whole high words and where it keeps the
    last, partial one: the first bad index and value, whatever follows, with either loop."""
    numel, bits = 1000 << 5, 5
    idx = np.arange(1000, dtype=np.int64) * 32 + 7
    bad = {
        "negative": -3,
        "repeat": idx[at - 1] if at else -1,
        "decrease": idx[at - 1] - 1 if at else -2,
        "numel": numel,
        "far": 2**62,
    }[kind]
    idx[at] = bad
    if at + 1 < idx.size:
        idx[at + 1] = 0  # a second bad one after it is never named
    with pytest.raises(ValueError, match=rf"positions\[{at}\] = {bad}: .*\[0, {numel}\)"):
        native.kernels.ef_encode(idx, numel, bits)
