"""The batched decode of small sparse xef deltas (``codec.decode_xef_many``, the C kernel
``xef_decode_many``, ``receiver.shard_reader.decode_pieces``) against the per-tensor path.

A MoE model's thousands of small tensors cost more in the decoder's glue than in its kernels
(issue 26), so the receiver decodes a group's small sparse pieces many to a C call. The
Patches must be the per-tensor decoder's byte for byte (positions, values, dtypes, the blob they
vouch for) over dtypes and sizes; and whatever the per-tensor path refuses, the batched path
must refuse too: it then hands every piece back to the per-tensor path, so ``decode_pieces``
raises the very error (type and message) it raised before, for the first bad piece in order.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncsync import codec
from asyncsync.codec import Patch, native
from asyncsync.codec.delta import _EF_ZSTD
from asyncsync.errors import FormatError
from asyncsync.format import Manifest, version_dir
from asyncsync.publish.publisher import Publisher
from receiver import shard_reader
from receiver.shard_reader import decode_pieces, open_shard, pieces_in

needs_kernel = pytest.mark.skipif(
    not codec.NATIVE, reason="asyncsync.codec._native is not built (or ASYNCSYNC_NATIVE=0)"
)

DTYPES = (torch.bfloat16, torch.float8_e4m3fn, torch.uint8, torch.int16, torch.int32, torch.int64)
Delta = tuple[bytes, bytes, int, int]


def _delta(dtype: torch.dtype, numel: int, every: int, start: int, seed: int) -> Delta:
    """The publisher's xef delta of a tensor of ``numel`` elements whose elements ``start::every``
    changed: (positions blob, values blob, changed, numel)."""
    idt = codec.int_dtype(dtype)
    g = torch.Generator().manual_seed(seed)
    old = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=g)
    old = old.view(idt)
    new = old.clone()
    new[start::every] ^= 1  # the low bit: never a no-op
    positions = torch.nonzero(old != new).reshape(-1)
    enc = codec.encode_delta(old, new, positions, "xef")
    assert enc.mode == "sparse"
    return enc.positions, enc.values, enc.changed, numel


def _one_by_one(deltas: list[Delta], dtype: torch.dtype) -> list[Patch | Exception]:
    out: list[Patch | Exception] = []
    for pos, val, changed, numel in deltas:
        try:
            out.append(
                codec.decode_delta(
                    "xef", "sparse", pos, val, changed=changed, numel=numel, dtype=dtype
                )
            )
        except Exception as exc:  # (compared below)
            out.append(exc)
    return out


def _same(a: Patch, b: Patch) -> None:
    assert a.op == b.op == "xor"
    assert a.positions is not None and b.positions is not None
    assert a.positions.dtype == b.positions.dtype == torch.int64
    assert a.values.dtype == b.values.dtype
    assert torch.equal(a.positions, b.positions)
    assert a.values.numpy().tobytes() == b.values.numpy().tobytes()
    assert a.decoded_xef() is not None and bytes(a.decoded_xef()) == bytes(b.decoded_xef())
    pos, vals = a.arrays()
    assert pos.tobytes() == b.positions.numpy().tobytes()
    assert vals.tobytes() == b.values.numpy().tobytes()


@st.composite
def _groups(draw: st.DrawFn) -> tuple[list[Delta], torch.dtype]:
    dtype = draw(st.sampled_from(DTYPES))
    deltas = [_delta(dtype, 100, 7, 3, 0)]
    for _ in range(draw(st.integers(1, 6))):
        numel = draw(st.sampled_from([1, 2, 7, 64, 2048, 5000]) | st.integers(1, 9000))
        every = draw(st.sampled_from([2, 3, 31, 997, numel + 1]))
        start = draw(st.integers(0, numel - 1))
        if (numel - start + every - 1) // every > codec.DENSE_THRESHOLD * numel:
            continue  # (sent dense: no positions, not this decoder's)
        deltas.append(_delta(dtype, numel, every, start, draw(st.integers(0, 2**31))))
    return deltas, dtype


@needs_kernel
@given(_groups())
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_the_batched_decode_is_the_per_tensor_decoders(case: tuple[list[Delta], Any]) -> None:
    deltas, dtype = case
    idt = codec.int_dtype(dtype)
    want = _one_by_one(deltas, idt)
    got = codec.decode_xef_many(deltas, idt)  # (regular positions come zstd-compressed)
    assert got is not None and len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert isinstance(b, Patch)
        _same(a, b)


def _mutations() -> st.SearchStrategy[tuple[str, int, int]]:
    """(what, where, how): a byte of a blob xored, a blob cut or grown, changed or numel off."""
    return st.tuples(
        st.sampled_from(
            ["pos_byte", "val_byte", "pos_cut", "val_cut", "pos_grow", "changed", "numel"]
        ),
        st.integers(0, 10_000),
        st.integers(1, 255),
    )


def _mutated(d: Delta, what: str, at: int, how: int) -> Delta:
    pos, val, changed, numel = d
    if what in ("pos_byte", "val_byte"):
        blob = bytearray(pos if what == "pos_byte" else val)
        blob[at % len(blob)] ^= how
        return (
            (bytes(blob), val, changed, numel)
            if what == "pos_byte"
            else (pos, bytes(blob), changed, numel)
        )
    if what == "pos_cut":
        return pos[: at % len(pos)], val, changed, numel
    if what == "val_cut":
        return pos, val[: at % len(val)], changed, numel
    if what == "pos_grow":
        return pos + bytes([how]), val, changed, numel
    if what == "changed":
        return pos, val, changed + (how % 5) - 2, numel
    return pos, val, changed, numel + (how % 9) - 4


@needs_kernel
@given(_groups(), st.data())
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_a_corrupt_delta_in_a_batch_is_refused_as_the_per_tensor_path_refuses_it(
    case: tuple[list[Delta], Any], data: st.DataObject
) -> None:
    """A piece the per-tensor decoder refuses makes the batch give up (None); a piece it takes
    (a mutation that still decodes) comes out of the batch as it does alone."""
    deltas, dtype = case
    idt = codec.int_dtype(dtype)
    j = data.draw(st.integers(0, len(deltas) - 1))
    deltas[j] = _mutated(deltas[j], *data.draw(_mutations()))
    want = _one_by_one(deltas, idt)
    got = codec.decode_xef_many(deltas, idt)
    if any(isinstance(w, Exception) for w in want):
        assert got is None
    elif got is not None:
        for a, b in zip(got, want, strict=True):
            assert isinstance(b, Patch)
            _same(a, b)


@needs_kernel
@pytest.mark.parametrize(
    "bad",
    [
        "empty positions",
        "header",
        "low tail",
        "high tail",
        "count",
        "order",
        "zero xor",
        "values size",
        "changed above numel",
        "no numel",
    ],
)
def test_each_refusal_of_the_per_tensor_path_gives_the_batch_up(bad: str) -> None:
    """The per-tensor checks, one by one: the batch of a good delta and the bad one is None,
    and the bad one alone raises FormatError through decode_delta."""
    good = _delta(torch.bfloat16, 2048, 31, 5, 1)
    pos, val, changed, numel = _delta(torch.bfloat16, 2048, 37, 3, 2)
    assert pos[0] == 5 and not pos[0] & _EF_ZSTD  # L = 5, not compressed
    payload = bytearray(pos[1:])
    low_len = (changed * 5 + 7) // 8
    if bad == "empty positions":
        pos = b""
    elif bad == "header":
        pos = bytes([4]) + pos[1:]
    elif bad == "low tail":  # 56 positions x 5 bits: 280 bits, 35 whole bytes: no tail there
        pos, val, changed = _tail_case()
    elif bad == "high tail":
        payload[-1] |= 0x80
        pos = pos[:1] + bytes(payload)
    elif bad == "count":
        payload[low_len] ^= 0x01 if payload[low_len] & 0x01 == 0 else 0x02
        pos = pos[:1] + bytes(payload)
    elif bad == "order":  # the last position's high bit moved to the last bit: past numel
        high = int.from_bytes(payload[low_len:], "little")
        top = changed + (numel >> 5)  # the high part's last bit
        high ^= 1 << (high.bit_length() - 1) | 1 << top
        pos = pos[:1] + bytes(payload[:low_len]) + high.to_bytes(len(payload) - low_len, "little")
    elif bad == "zero xor":
        planes = np.frombuffer(codec.delta._unzstd(val, (2 * changed,), "v"), np.uint8).copy()
        planes[0] = planes[changed] = 0
        val = codec.delta._zstd(planes.tobytes(), 3)
    elif bad == "values size":
        val = codec.delta._zstd(b"\x01" * (2 * changed + 2), 3)
    elif bad == "changed above numel":
        numel = changed - 1
    else:
        numel = 0
    with pytest.raises(FormatError):
        codec.decode_delta(
            "xef", "sparse", pos, val, changed=changed, numel=numel, dtype=torch.int16
        )
    assert codec.decode_xef_many([good, (pos, val, changed, numel)], torch.int16) is None


def _tail_case() -> tuple[bytes, bytes, int]:
    """A delta whose low part ends inside a byte (3 positions x 5 bits), a bit set past it."""
    pos, val, changed, _ = _delta(torch.bfloat16, 100, 40, 1, 3)
    assert changed == 3 and pos[0] == 5
    payload = bytearray(pos[1:])
    payload[1] |= 0x80  # bits 15.. of the low part: past its 15 bits
    return pos[:1] + bytes(payload), val, changed


def test_without_the_kernel_the_batch_is_not_made(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "kernels", None)
    assert codec.decode_xef_many([_delta(torch.bfloat16, 64, 3, 0, 0)], torch.int16) is None


# -- decode_pieces over a real shard -----------------------------------------------------------


def _publish(root: Path) -> None:
    g = torch.Generator().manual_seed(0)
    sd: dict[str, torch.Tensor] = {}
    for i, (dtype, numel) in enumerate(
        [(torch.bfloat16, 2048), (torch.float32, 1000), (torch.uint8, 4096), (torch.bfloat16, 7),
         (torch.int64, 300), (torch.bfloat16, 600_000), (torch.float16, 3000), (torch.bfloat16, 2)]
    ):  # fmt: skip
        raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=g)
        sd[f"t{i}"] = raw.view(dtype)

    async def go() -> None:
        async with Publisher(root, keyframe_interval=0) as pub:
            await pub.seed(sd)
            for k, t in enumerate(sd.values()):
                flat = t.view(-1).view(codec.int_dtype(t.dtype))
                flat[k % 3 :: 29] ^= 1
            await pub.publish(sd)

    asyncio.run(go())


@pytest.fixture(scope="module")
def shard(tmp_path_factory: pytest.TempPathFactory) -> tuple[Manifest, int, bytes]:
    root = tmp_path_factory.mktemp("root")
    _publish(root)
    vd = version_dir(root, 1)
    m = Manifest.from_json((vd / "manifest.json").read_bytes())
    assert m.kind == "delta" and m.encoding == "xef"
    (idx,) = [i for i, s in enumerate(m.shards) if s.role == "delta"]
    return m, idx, m.shard_path(vd, m.shards[idx]).read_bytes()


def _outcome(fn: Any) -> Any:
    try:
        return fn()
    except Exception as exc:  # (compared by type and message)
        return (type(exc), str(exc))


def _per_tensor(m: Manifest, tensors: Any, pieces: list[Any]) -> list[Any]:
    """decode_pieces as it was: each piece by decode_delta, the first error in order raised."""
    return [shard_reader._decode_piece(m, "delta", tensors, p, "w") for p in pieces]


def _compare(m: Manifest, tensors: Any, pieces: list[Any]) -> None:
    got = _outcome(lambda: decode_pieces(m, "delta", tensors, pieces, "w"))
    want = _outcome(lambda: _per_tensor(m, tensors, pieces))
    if isinstance(want, tuple):
        assert got == want
        return
    assert isinstance(got, list) and len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert type(a) is type(b) and a.entry is b.entry
        if b.patch.positions is None:
            assert a.patch.positions is None
            assert torch.equal(a.patch.values, b.patch.values)
        else:
            _same(a.patch, b.patch)


@needs_kernel
def test_decode_pieces_of_a_shard_is_the_per_tensor_paths(
    shard: tuple[Manifest, int, bytes],
) -> None:
    m, idx, data = shard
    tensors = open_shard(m, m.shards[idx], data, "w")
    pieces = pieces_in(m, "delta", idx)
    assert len(pieces) == 8
    batched = shard_reader._decode_small(m, tensors, pieces)
    assert len(batched) == 7  # all but the 1.2 MB bf16 tensor
    _compare(m, tensors, pieces)


@needs_kernel
@given(st.integers(0, 1 << 30), st.integers(1, 255))
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_a_corrupt_shard_raises_the_per_tensor_paths_error(
    shard: tuple[Manifest, int, bytes], at: int, how: int
) -> None:
    """A byte of the shard's blobs changed after its checksum (a hostile or corrupt shard):
    decode_pieces raises what the per-tensor path raises, or decodes what it decodes."""
    m, idx, data = shard
    header = 8 + int.from_bytes(data[:8], "little")
    buf = bytearray(data)
    buf[header + at % (len(data) - header)] ^= how
    tensors = open_shard(m, m.shards[idx], bytes(buf), "w")
    _compare(m, tensors, pieces_in(m, "delta", idx))


@needs_kernel
@pytest.mark.parametrize("field", ["changed", "numel", "missing blob", "dtype"])
def test_a_manifest_that_disagrees_with_the_shard_raises_the_per_tensor_paths_error(
    shard: tuple[Manifest, int, bytes], field: str
) -> None:
    m, idx, data = shard
    tensors = open_shard(m, m.shards[idx], data, "w")
    pieces = pieces_in(m, "delta", idx)
    for j in (0, 3, 7):  # a piece first, in the middle, last
        e, part, ref = pieces[j]
        if field == "changed":
            bad = (dataclasses.replace(e, changed=e.changed + 1), part, ref)
        elif field == "numel":
            bad = (dataclasses.replace(e, shape=(e.numel * 3,)), part, ref)
        elif field == "missing blob":
            bad = (e, part, dataclasses.replace(ref, values="nowhere"))
        else:  # a 2-byte tensor said to be 4-byte: the values' size is wrong
            bad = (
                dataclasses.replace(e, dtype="float32" if e.dtype != "float32" else "bfloat16"),
                part,
                ref,
            )
        _compare(m, tensors, [*pieces[:j], bad, *pieces[j + 1 :]])


@needs_kernel
def test_the_kernel_refuses_arguments_that_do_not_fit() -> None:
    """Outputs of the wrong size, counts of another length, a piece of no positions: refused
    before anything is written."""
    k = native.kernels
    pos, val, changed, numel = _delta(torch.bfloat16, 2048, 37, 3, 2)
    assert not pos[0] & _EF_ZSTD
    raw = codec.delta._unzstd(val, (2 * changed,), "v")
    one = np.array([changed], np.int64)
    n = np.array([numel], np.int64)

    def call(pos_out: Any, val_out: Any, counts: Any = one, blobs: Any = (pos,)) -> None:
        k.xef_decode_many(list(blobs), [raw], counts, n, 2, pos_out, val_out)

    ok_p, ok_v = np.zeros(changed, np.int64), np.zeros(2 * changed, np.uint8)
    call(ok_p, ok_v)
    for bad_p, bad_v in [
        (np.zeros(changed + 1, np.int64), ok_v),
        (ok_p, np.zeros(2 * changed - 2, np.uint8)),
        (np.zeros(changed - 1, np.int64), ok_v),
    ]:
        with pytest.raises(ValueError, match="must hold exactly"):
            call(bad_p, bad_v)
    with pytest.raises(ValueError, match="must hold 1 int64"):
        call(ok_p, ok_v, counts=np.array([changed, 1], np.int64))
    with pytest.raises(ValueError, match="2 positions but 1 values"):
        call(ok_p, ok_v, blobs=(pos, pos))
    with pytest.raises(ValueError, match="piece 0: 0 positions"):
        call(ok_p[:0], ok_v[:0], counts=np.array([0], np.int64))
    with pytest.raises(TypeError, match="bytes-like"):
        call(ok_p, ok_v, blobs=(3,))
    with pytest.raises(TypeError, match="val_out must be a writable"):
        call(ok_p, memoryview(bytes(2 * changed)))
