"""receiver.engines.checkpoint.redo: the redo record's format and the merge of records.

Property-style: random versions of a tensor (sets and XORs, sparse and dense, positions coded
xef, Elias-Fano or raw), each written as a record and read back; the merge of the records,
applied once, equals applying each version in turn."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncsync.codec import Patch
from receiver.engines.checkpoint.redo import Record, RecordWriter, merge, record_name


def _apply(flat: np.ndarray, op: str, pos: np.ndarray | None, val: np.ndarray) -> None:
    idx = slice(None) if pos is None else pos
    if op == "set":
        flat[idx] = val
    else:
        flat[idx] ^= val


def _random_patch(rng: np.random.Generator, numel: int, dtype: type) -> tuple[str, object, object]:
    op = str(rng.choice(["set", "xor"]))
    info = np.iinfo(dtype)
    if rng.random() < 0.1:  # dense
        val = rng.integers(info.min, info.max, numel, dtype=dtype, endpoint=True)
        return op, None, val
    n = int(rng.integers(0, numel + 1))
    pos = np.sort(rng.choice(numel, n, replace=False)).astype(np.int64)
    val = rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
    return op, pos, val


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    versions=st.integers(1, 6),
    numel=st.integers(1, 300),
    dtype=st.sampled_from([np.int16, np.int32, np.int8]),
)
def test_merge_equals_each_version_in_turn(
    seed: int, versions: int, numel: int, dtype: type
) -> None:
    rng = np.random.default_rng(seed)
    base = rng.integers(np.iinfo(dtype).min, np.iinfo(dtype).max, numel, dtype=dtype)
    patches = [_random_patch(rng, numel, dtype) for _ in range(versions)]
    expected = base.copy()
    for op, pos, val in patches:
        _apply(expected, op, pos, val)
    merged = merge(patches, numel)  # type: ignore[arg-type]
    assert not np.isin(merged.set_pos, merged.xor_pos).any()
    got = base.copy()
    p = merged.patch(torch.from_numpy(base.copy()))
    _apply(got, p.op, None if p.positions is None else p.positions.numpy(), p.values.numpy())
    np.testing.assert_array_equal(got, expected)


def test_merge_of_xors_alone_stays_a_xor_without_the_base() -> None:
    a = ("xor", np.array([1, 3, 5], np.int64), np.array([1, 2, 4], np.int16))
    b = ("xor", np.array([3, 4], np.int64), np.array([8, 16], np.int16))
    p = merge([a, b], 8).patch()
    assert p.op == "xor"
    assert p.positions is not None
    assert p.positions.tolist() == [1, 3, 4, 5]
    assert p.values.tolist() == [1, 10, 16, 4]
    with pytest.raises(ValueError, match="base"):
        merge([("set", np.array([0], np.int64), np.array([1], np.int16)), b], 8).patch()


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), groups=st.integers(1, 3))
def test_record_round_trip(
    tmp_path_factory: pytest.TempPathFactory, seed: int, groups: int
) -> None:
    rng = np.random.default_rng(seed)
    d = tmp_path_factory.mktemp("redo")
    w = RecordWriter(d, 7)
    expected = {}
    k = 0
    for _ in range(groups):
        items = []
        for _ in range(int(rng.integers(1, 4))):
            numel = int(rng.integers(1, 500))
            op, pos, val = _random_patch(rng, numel, np.int16)
            if pos is not None and rng.random() < 0.3 and pos.size > 1:
                pos = pos[::-1].copy()  # not increasing: kept raw
            tpos = None if pos is None else torch.from_numpy(np.asarray(pos))
            items.append((f"t{k}", numel, Patch(op, tpos, torch.from_numpy(np.asarray(val)))))  # type: ignore[arg-type]
            expected[f"t{k}"] = (op, pos, val)
            k += 1
        w.add(items)
    path = w.finish({"version": 7, "checksums": {"t0": "x"}})
    assert path.name == record_name(7) and not w.part.exists()
    rec = Record.open(path)
    try:
        assert rec.version == 7 and rec.meta["checksums"] == {"t0": "x"}
        assert set(rec.entries) == set(expected)
        for name, (op, pos, val) in expected.items():
            gop, gpos, gval = rec.patch(name, torch.int16)
            assert gop == op
            np.testing.assert_array_equal(gval, val)
            if pos is None:
                assert gpos is None
            else:
                np.testing.assert_array_equal(gpos, pos)
    finally:
        rec.close()


def test_a_torn_or_foreign_record_is_refused(tmp_path) -> None:
    w = RecordWriter(tmp_path, 3)
    w.add([("a", 4, Patch("set", torch.tensor([1]), torch.tensor([5], dtype=torch.int16)))])
    path = w.finish({"version": 3})
    data = path.read_bytes()
    for bad in (data[:-3], data[:10], b"", b"x" * 64):
        path.write_bytes(bad)
        with pytest.raises(ValueError):
            Record.open(path).close()
    w2 = RecordWriter(tmp_path, 4)
    w2.add([("a", 4, Patch("set", torch.tensor([1]), torch.tensor([5], dtype=torch.int16)))])
    w2.discard()
    assert not w2.part.exists() and not w2.path.exists()
