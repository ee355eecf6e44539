"""A full shard's tensors as views of its verified bytes (``codec.shards.parse_shard``).

A full shard (a late or restarted engine's catch-up, a keyframe, a registered checkpoint) was
parsed by ``safetensors.deserialize``, which copies every tensor while holding the GIL: ~0.5 s
of CPU and a second copy of the shard in memory a GiB. Its tensors now view the buffer the
receiver read the shard into (``fsio.read_buffer``). These tests hold the parser to what
safetensors itself accepts (a hand-made table of damaged headers and a differential fuzz against
``safetensors.deserialize``), and to the views' promises: the bytes exact for every dtype, no
copy of a ``bytearray`` (a misaligned tensor excepted), no aliasing of immutable ``bytes``, the
buffer kept alive by its views.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest
import safetensors
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncsync.codec.shards import parse_shard
from asyncsync.codec.views import BY_CODE
from asyncsync.errors import FormatError, ManifestError
from asyncsync.format import ShardInfo
from asyncsync.format.checksum import DEFAULT_ALGORITHM, checksum_bytes
from asyncsync.format.names import DTYPES
from receiver.shard_reader import read_verified


def _raw(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _random(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    n = int(torch.Size(shape).numel()) * dtype.itemsize
    return torch.frombuffer(bytearray(os.urandom(n)), dtype=torch.uint8).view(dtype).reshape(shape)


def _state() -> dict[str, torch.Tensor]:
    sd = {f"t.{name}": _random((3, 5 + i), dt) for i, (name, dt) in enumerate(DTYPES.items())}
    sd["empty"] = torch.empty((0, 4), dtype=torch.bfloat16)
    sd["scalar"] = torch.tensor(3.5, dtype=torch.float32)
    return sd


def _file(entries: dict[str, Any], body: bytes, meta: dict[str, str] | None = None) -> bytes:
    """A safetensors file of the header ``entries`` (as given: no check) and ``body``; the
    header padded with spaces to a multiple of 8 bytes, as safetensors pads it."""
    header = dict(entries) if meta is None else {"__metadata__": meta, **entries}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + body


@pytest.mark.parametrize("kind", [bytes, bytearray])
def test_every_dtype_parses_to_its_exact_bytes(kind: type) -> None:
    sd = _state()
    data = kind(safetensors.torch.save(sd, metadata={"asyncsync.role": "full"}))
    got = parse_shard(data, where="x", role="full")
    assert set(got) == set(sd)
    for name, t in sd.items():
        assert (got[name].dtype, got[name].shape) == (t.dtype, t.shape), name
        assert _raw(got[name]) == _raw(t), name


def test_a_bytearrays_tensors_view_it_and_keep_it_alive() -> None:
    sd = _state()
    data = bytearray(safetensors.torch.save(sd))
    lo = torch.frombuffer(data, dtype=torch.uint8).data_ptr()
    got = parse_shard(data, where="x")
    for name, t in got.items():
        if t.numel():
            assert lo <= t.data_ptr() < lo + len(data), f"{name} was copied"
    del data
    gc.collect()
    for name, t in sd.items():
        assert _raw(got[name]) == _raw(t), name


def test_immutable_bytes_are_never_written_through_a_tensor() -> None:
    """torch has no read-only tensors: views of ``bytes`` would let a consumer write into an
    immutable object. ``bytes`` are copied once; writing into the tensors leaves them as they
    were."""
    sd = {"w": _random((64,), torch.bfloat16)}
    data = safetensors.torch.save(sd)
    before = bytes(data)
    got = parse_shard(data, where="x")
    got["w"].view(torch.int16).fill_(-1)
    assert data == before


def test_a_misaligned_tensor_is_copied_and_read_right() -> None:
    """safetensors' writer aligns the data, but a valid file need not: a tensor whose offset is
    not a multiple of its element size cannot be viewed as its dtype, so it is copied."""
    a, b, c = bytes([1, 2, 3]), _random((2, 3), torch.bfloat16), _random((5,), torch.float32)
    entries = {
        "a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
        "b": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [3, 15]},
        "c": {"dtype": "F32", "shape": [5], "data_offsets": [15, 35]},
    }
    data = _file(entries, a + _raw(b) + _raw(c))
    assert (8 + struct.unpack("<Q", data[:8])[0]) % 8 == 0  # so "b" and "c" are misaligned
    ours = parse_shard(bytearray(data), where="x")
    theirs = {k: v for k, v in safetensors.deserialize(data)}
    assert set(ours) == set(theirs) == {"a", "b", "c"}
    assert _raw(ours["a"]) == a and _raw(ours["b"]) == _raw(b) and _raw(ours["c"]) == _raw(c)
    assert ours["b"].shape == (2, 3) and ours["b"].dtype == torch.bfloat16
    assert ours["c"].shape == (5,) and ours["c"].dtype == torch.float32


_GOOD = {
    "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
    "b": {"dtype": "I16", "shape": [1, 2], "data_offsets": [8, 12]},
}
_BAD: list[tuple[str, dict[str, Any], bytes, str]] = [
    ("unknown dtype", {**_GOOD, "b": {**_GOOD["b"], "dtype": "Q16"}}, bytes(12), "dtype 'Q16'"),
    ("dtype not a string", {**_GOOD, "b": {**_GOOD["b"], "dtype": 5}}, bytes(12), "not a safe"),
    ("shape too big", {**_GOOD, "b": {**_GOOD["b"], "shape": [2, 2]}}, bytes(12), "span 4"),
    ("negative dim", {**_GOOD, "b": {**_GOOD["b"], "shape": [-1, -2]}}, bytes(12), "not a safe"),
    ("float dim", {**_GOOD, "b": {**_GOOD["b"], "shape": [1.0, 2]}}, bytes(12), "not a safe"),
    ("bool offset", {**_GOOD, "a": {**_GOOD["a"], "data_offsets": [False, 8]}}, bytes(12), "not"),
    ("reversed", {**_GOOD, "b": {**_GOOD["b"], "data_offsets": [12, 8]}}, bytes(12), "not a"),
    ("three offsets", {**_GOOD, "b": {**_GOOD["b"], "data_offsets": [8, 12, 12]}}, bytes(12), "t"),
    ("no shape", {**_GOOD, "b": {"dtype": "I16", "data_offsets": [8, 12]}}, bytes(12), "not a"),
    ("entry not an object", {**_GOOD, "b": [8, 12]}, bytes(12), "not a safetensors entry"),
    ("gap", {**_GOOD, "b": {**_GOOD["b"], "data_offsets": [9, 13]}}, bytes(13), "does not start"),
    ("overlap", {**_GOOD, "b": {**_GOOD["b"], "data_offsets": [6, 10]}}, bytes(10), "not start"),
    ("trailing bytes", _GOOD, bytes(13), "hold 12 bytes, the data after the header 13"),
    ("short data", _GOOD, bytes(11), "hold 12 bytes, the data after the header 11"),
    ("no room", _GOOD, b"", "hold 12 bytes"),
]


@pytest.mark.parametrize(
    ("entries", "body", "match"), [c[1:] for c in _BAD], ids=[c[0] for c in _BAD]
)
def test_what_safetensors_refuses_is_a_format_error(
    entries: dict[str, Any], body: bytes, match: str
) -> None:
    data = _file(entries, body)
    with pytest.raises(Exception):  # noqa: B017 (safetensors' own error types vary)
        safetensors.deserialize(data)
    for kind in (bytes, bytearray):
        with pytest.raises(FormatError, match=match):
            parse_shard(kind(data), where="x")
    assert {k for k, _ in safetensors.deserialize(_file(_GOOD, bytes(12)))} == {"a", "b"}


def test_a_huge_entry_is_named_briefly() -> None:
    entries = {**_GOOD, "b": {"dtype": "I16", "shape": list(range(10_000)), "data_offsets": 1}}
    with pytest.raises(FormatError) as info:
        parse_shard(_file(entries, bytes(12)), where="x")
    assert len(str(info.value)) < 400


@pytest.mark.parametrize("shape", [[0, 2**63], [0, 2**62, 2**62]])
def test_a_shape_torch_cannot_make_is_a_format_error(shape: list[int]) -> None:
    """safetensors takes any shape of unsigned 64-bit dims whose bytes are its span; torch
    refuses some (a dim over int64, a stride overflow)."""
    data = _file({"a": {"dtype": "BF16", "shape": shape, "data_offsets": [0, 0]}}, b"")
    assert {k for k, _ in safetensors.deserialize(data)} == {"a"}
    with pytest.raises(FormatError, match="tensor 'a' of shape"):
        parse_shard(data, where="x")


def test_metadata_is_still_checked() -> None:
    data = _file(_GOOD, bytes(12), meta={"asyncsync.version": "3", "asyncsync.role": "full"})
    assert set(parse_shard(data, where="x", version=3, role="full")) == {"a", "b"}
    with pytest.raises(FormatError, match="another version"):
        parse_shard(data, where="x", version=4)
    with pytest.raises(FormatError, match="__metadata__"):
        parse_shard(_file(_GOOD, bytes(12), meta={"k": 1}), where="x")  # type: ignore[dict-item]


# --------------------------------------------------------------------------- differential

_CODES = sorted(BY_CODE)


@st.composite
def _headers(draw: st.DrawFn) -> tuple[bytes, dict[str, Any]]:
    """A valid file, then its entries perturbed: a dtype, a dim, an offset moved, an entry
    dropped, bytes added or cut at the end; what safetensors says of it is the oracle."""
    n = draw(st.integers(0, 5))
    entries: dict[str, Any] = {}
    at = 0
    for i in range(n):
        code = draw(st.sampled_from(_CODES))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        size = int(torch.Size(shape).numel()) * BY_CODE[code].itemsize
        entries[f"t{i}"] = {"dtype": code, "shape": shape, "data_offsets": [at, at + size]}
        at += size
    body = draw(st.binary(min_size=at, max_size=at))
    for _ in range(draw(st.integers(0, 2))):
        if not entries:
            break
        key = draw(st.sampled_from(sorted(entries)))
        e = entries[key]
        how = draw(st.sampled_from(["dtype", "dim", "begin", "stop", "drop", "end"]))
        if how == "dtype":
            e["dtype"] = draw(st.sampled_from([*_CODES, "F4", "X1", "u8"]))
        elif how == "dim":
            e["shape"] = [*e["shape"], draw(st.integers(0, 3))]
        elif how in ("begin", "stop"):
            i = how == "stop"
            e["data_offsets"][i] = max(0, e["data_offsets"][i] + draw(st.integers(-3, 3)))
        elif how == "drop":
            del entries[key]
        else:
            body = body + bytes(draw(st.integers(1, 3))) if draw(st.booleans()) else body[:-1]
    return _file(entries, body), entries


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(_headers())
def test_parse_shard_accepts_exactly_what_safetensors_accepts(
    case: tuple[bytes, dict[str, Any]],
) -> None:
    data, entries = case
    try:
        theirs: dict[str, Any] | None = dict(safetensors.deserialize(data))
    except Exception:
        theirs = None
    try:
        ours: dict[str, torch.Tensor] | None = parse_shard(bytearray(data), where="x")
    except FormatError:
        ours = None
    foreign = any(e.get("dtype") not in BY_CODE for e in entries.values() if isinstance(e, dict))
    if foreign:  # a dtype safetensors knows and the format does not carry: ours refuses
        assert ours is None
        return
    assert (ours is None) == (theirs is None), (ours, theirs)
    if ours is not None and theirs is not None:
        assert set(ours) == set(theirs)
        for key, view in theirs.items():
            assert _raw(ours[key]) == bytes(view["data"]), key
            assert list(ours[key].shape) == view["shape"], key


# --------------------------------------------------------------------------- the reader


def test_the_receiver_reads_a_full_shard_into_a_buffer_and_a_delta_into_the_pool(
    tmp_path: Path,
) -> None:
    """A full shard into a private ``bytearray`` (its tensors view it); a delta shard into a
    buffer of the scratch pool, as a read-only view, the same buffer again once the last view
    of it is gone (its pages already faulted in), never while one is held."""
    from asyncsync.codec import scratch

    for size in (8, 1 << 20):  # below the pool's smallest buffer, and in it
        data = safetensors.torch.save({"w": _random((size,), torch.bfloat16)})
        path = tmp_path / "s.safetensors"
        path.write_bytes(data)
        info = {
            role: ShardInfo(path.name, role, len(data), checksum_bytes(data, DEFAULT_ALGORITHM))  # type: ignore[arg-type]
            for role in ("full", "delta")
        }
        full = read_verified(path, info["full"], DEFAULT_ALGORITHM, root=tmp_path)
        assert type(full) is bytearray and full == data
        got = read_verified(path, info["delta"], DEFAULT_ALGORITHM, root=tmp_path)
        assert type(got) is memoryview and got.readonly and got == data
        if len(data) < scratch.MIN_BYTES:
            continue
        held = read_verified(path, info["delta"], DEFAULT_ALGORITHM, root=tmp_path)
        assert held.obj.base is not got.obj.base  # a view still held: another buffer
        del got  # its buffer free again: the next read takes a free one, none made
        reused, held_bytes = scratch.pool.reused, scratch.pool.held
        again = read_verified(path, info["delta"], DEFAULT_ALGORITHM, root=tmp_path)
        assert again == data and held == data
        assert scratch.pool.reused == reused + 1 and scratch.pool.held == held_bytes


async def test_a_registered_checkpoint_with_misaligned_tensors_is_applied_bit_exact(
    tmp_path: Path,
) -> None:
    """A checkpoint another tool wrote (``Publisher.seed(path)`` registers its files as they
    are) may place a tensor at any offset; the agent's catch-up copies those and views the
    rest, and its checkpoint holds every byte, bool bytes that are not 0/1 included."""
    from asyncsync import Publisher
    from receiver import ReceiverAgent
    from receiver.engines import LocalCheckpoint

    mask = torch.frombuffer(bytearray([0, 1, 2, 255, 1, 0, 7]), dtype=torch.uint8)
    sd = {
        "a.mask": mask.view(torch.bool),
        "b.w": _random((5, 3), torch.bfloat16),
        "c.w": _random((9,), torch.float32),
        "d.w": _random((4, 4), torch.float16),
    }
    entries, body = {}, b""
    for name, t in sd.items():  # one after another: "b.w" at 7, "c.w" at 37 (misaligned)
        raw = _raw(t)
        code = {v: k for k, v in BY_CODE.items()}[t.dtype]
        entries[name] = {
            "dtype": code,
            "shape": list(t.shape),
            "data_offsets": [len(body), len(body) + len(raw)],
        }
        body += raw
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model.safetensors").write_bytes(_file(entries, body, meta={"format": "pt"}))
    root, ckpt = tmp_path / "root", tmp_path / "ckpt"
    async with Publisher(root) as pub:
        await pub.seed(hf)
    async with ReceiverAgent(root, LocalCheckpoint(ckpt), "e", use_inotify=False) as agent:
        assert await agent.sync_once() == 0
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    got = {}
    for f in sorted(set(index["weight_map"].values())):
        got.update(dict(safetensors.deserialize((ckpt / f).read_bytes())))
    assert set(got) == set(sd)
    for name, t in sd.items():
        assert bytes(got[name]["data"]) == _raw(t), name


def _full_header_edits() -> dict[str, Any]:
    """Ways to rewrite a full shard's header that safetensors refuses (the delta shard's attack
    of the twelfth session, tests/test_hostile.py, on the full shard's own parser)."""

    def first(h: dict[str, Any]) -> dict[str, Any]:
        return h[next(k for k in h if k != "__metadata__")]  # type: ignore[no-any-return]

    def edit(change: Any) -> Any:
        def rewrite(text: bytes) -> bytes:
            h = json.loads(text)
            change(first(h))
            return json.dumps(h).encode()

        return rewrite

    return {
        "nested": lambda t: t[:-1] + b', "zz": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        "utf16": lambda t: t.decode().encode("utf-16"),
        "NaN": lambda t: t.replace(b'"__metadata__":{', b'"__metadata__":{"x":NaN,', 1),
        "float-shape": edit(lambda e: e.update(shape=[float(d) for d in e["shape"]])),
        "bigger-shape": edit(lambda e: e.update(shape=[*e["shape"], 2])),
        "dtype": edit(lambda e: e.update(dtype="F4")),
        "offsets": edit(
            lambda e: e.update(data_offsets=[e["data_offsets"][0] + 2, e["data_offsets"][1] + 2])
        ),
    }


@pytest.mark.parametrize("edit", sorted(_full_header_edits()))
async def test_a_keyframe_shard_header_safetensors_refuses_is_refused(
    tmp_path: Path, edit: str
) -> None:
    """A keyframe's full shard rewritten in a real root (its size and checksum fixed up in the
    manifest) so that safetensors refuses it: a real agent refuses the version with a
    FormatError, holds nothing, and applies the next keyframe bit-exact."""
    from asyncsync import Publisher
    from asyncsync.format import MANIFEST_NAME, version_dir
    from asyncsync.format.store import read_manifest
    from receiver import ReceiverAgent
    from receiver.engines import LocalCheckpoint
    from receiver.engines.checkpoint import verify_checkpoint
    from tests.conftest import mixed_state

    root, ckpt = tmp_path / "root", tmp_path / "ckpt"
    async with Publisher(root) as pub:
        await pub.seed(mixed_state(0))
    m0 = read_manifest(root, 0)
    shard = version_dir(root, 0) / m0.shards[0].file
    data = shard.read_bytes()
    n = int.from_bytes(data[:8], "little")
    text = _full_header_edits()[edit](data[8 : 8 + n].rstrip())
    forged = len(text).to_bytes(8, "little") + text + data[8 + n :]
    shard.write_bytes(forged)
    path = version_dir(root, 0) / MANIFEST_NAME
    d = json.loads(path.read_text())
    d["shards"][0].update(bytes=len(forged), checksum=checksum_bytes(forged))
    d["totals"]["wire_bytes"] = sum(s["bytes"] for s in d["shards"])
    path.write_text(json.dumps(d))
    async with ReceiverAgent(root, LocalCheckpoint(ckpt), "e1", use_inotify=False) as agent:
        with pytest.raises(FormatError) as info:
            await asyncio.wait_for(agent.sync_once(), 30)
        assert not isinstance(info.value, ManifestError), info.value
        why = str(info.value)
        assert m0.shards[0].file in why, why
        assert "tensor" in why or "safetensors header" in why, why
        assert agent.version is None
        async with Publisher(root) as pub:  # a restarted trainer seeds a keyframe: v1
            await pub.seed(mixed_state(1))
        assert await asyncio.wait_for(agent.sync_once(), 30) == 1
    assert verify_checkpoint(ckpt, read_manifest(root, 1)) == []
