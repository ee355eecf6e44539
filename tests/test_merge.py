"""Format version 2: tensors in parts, their composite checksum, merging ranks' parts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncsync.errors import ConfigError, ManifestError
from asyncsync.format import (
    FORMAT_VERSION,
    AckRecord,
    DeltaRef,
    FullRef,
    Manifest,
    ShardInfo,
    TensorEntry,
    TensorPart,
    Totals,
    fingerprint,
)
from asyncsync.format.checksum import (
    checksum_bytes,
    checksum_tensor,
    entry_checksum,
    parts_checksum,
)
from asyncsync.format.store import ensure_root_info
from asyncsync.publish.merge import PartRecord, TensorSlice, as_part, merge

H = "0123456789abcdef0123456789abcdef"
ALGO = "xxh3-128"


def test_composite_checksum_is_exactly_the_documented_text() -> None:
    parts = [(4, 8, "bb"), (0, 4, "aa")]
    assert parts_checksum(parts, ALGO) == checksum_bytes(b"0:4:aa\n4:8:bb", ALGO)


def test_entry_checksum_plain_and_in_parts() -> None:
    t = torch.arange(12, dtype=torch.int16).reshape(3, 4)
    plain = TensorEntry("w", "int16", (3, 4), checksum_tensor(t), 0)
    assert entry_checksum(plain, t) == plain.checksum
    flat = t.reshape(-1)
    sums = [checksum_tensor(flat[:5]), checksum_tensor(flat[5:])]
    parted = TensorEntry(
        "w", "int16", (3, 4), parts_checksum([(0, 5, sums[0]), (5, 7, sums[1])]), 0,
        parts=(TensorPart(0, 5, sums[0], 0), TensorPart(5, 7, sums[1], 0)),
    )  # fmt: skip
    assert entry_checksum(parted, t) == parted.checksum
    assert entry_checksum(parted, bytes(t.numpy().tobytes())) == parted.checksum


def _parted_manifest(**over: Any) -> Manifest:
    sums = (H[:16] * 2, H[::-1])
    parts = (
        TensorPart(0, 8, sums[0], 2, DeltaRef(0, "sparse", "t0.pos", "t0.val")),
        TensorPart(8, 12, sums[1], 0),
    )
    w = TensorEntry(
        "w", "float32", (4, 5), parts_checksum([(0, 8, sums[0]), (8, 12, sums[1])], ALGO), 2,
        parts=parts,
    )  # fmt: skip
    b = TensorEntry("b", "int64", (), H, 0)
    tensors = (w, b)
    fields: dict[str, Any] = dict(
        version=5, base_version=4, kind="delta", encoding="xef", checksum_algorithm=ALGO,
        run_id="abc", shards=(ShardInfo("r0000-abcdef012345-delta-00000.safetensors", "delta",
                                        100, H),),
        tensors=tensors, totals=Totals(2, 21, 2, 2 / 21, 88, 100, 100, 80),
        fingerprint=fingerprint(tensors, ALGO), created_at=1.0, committed_at=2.0,
        attempt="abcdef012345",
    )  # fmt: skip
    fields.update(over)
    if "fingerprint" not in over:  # readers check it against the entries (FORMAT.md section 3)
        fields["fingerprint"] = fingerprint(fields["tensors"], ALGO)
    return Manifest(**fields)


def test_parts_round_trip_and_format_version() -> None:
    m = _parted_manifest()
    m.validate()
    d = json.loads(m.to_json())
    assert d["format_version"] == FORMAT_VERSION == 3 and d["attempt"] == "abcdef012345"
    assert "parts" not in d["tensors"][1] and d["tensors"][0]["delta"] is None
    assert d["tensors"][0]["parts"][0] == {
        "offset": 0, "numel": 8, "checksum": H[:16] * 2, "changed": 2,
        "delta": {"shard": 0, "mode": "sparse", "positions": "t0.pos", "values": "t0.val"},
        "full": None,
    }  # fmt: skip
    assert Manifest.from_json(m.to_json()) == m
    assert m.tensors[0].layout == ((0, 8), (8, 12)) and m.tensors[1].layout is None


def _mutated(change: Any) -> str:
    d = json.loads(_parted_manifest().to_json())
    change(d)
    return json.dumps(d)


def _w(d: dict[str, Any]) -> dict[str, Any]:
    return d["tensors"][0]  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda d: d.update(format_version=1), "need format_version 2"),
        (lambda d: d.update(format_version=4), "format_version 4"),
        (lambda d: _w(d)["parts"][1].update(offset=9, numel=11), "expected a part at 8"),
        (lambda d: _w(d)["parts"][1].update(numel=11), "cover 19 of 20"),
        (lambda d: _w(d)["parts"].reverse(), "expected a part at 0"),
        (lambda d: _w(d)["parts"][1].update(numel=13), "runs past"),
        (lambda d: _w(d)["parts"][1].update(numel=0), "out of range"),
        (lambda d: _w(d).update(parts=[]), "non-empty list"),
        (lambda d: _w(d)["parts"][1].update(checksum=H), "composite"),
        (lambda d: _w(d).update(changed=3), "sum of its parts"),
        (lambda d: _w(d)["parts"][0].update(delta=None), "no delta data"),
        (lambda d: _w(d)["parts"][1].update(full={"shard": 0, "key": "w"}), "no full data"),
        (
            lambda d: _w(d).update(
                delta={"shard": 0, "mode": "sparse", "positions": "a", "values": "b"}
            ),
            "in its parts",
        ),
        (lambda d: d.update(attempt="XYZ"), "attempt"),
    ],
)
def test_bad_parts_are_refused(change: Any, match: str) -> None:
    with pytest.raises(ManifestError, match=match):
        Manifest.from_json(_mutated(change))


def test_format_1_records_are_still_read(tmp_path: Path) -> None:
    m = _parted_manifest(tensors=(TensorEntry("b", "int64", (), H, 0),))
    d = json.loads(m.to_json())
    d.update(
        format_version=1,
        totals={**d["totals"], "tensors": 1, "elements": 1, "changed": 0, "density": 0.0},
    )
    d.pop("attempt")
    assert Manifest.from_json(json.dumps(d)).format_version == 1
    ack = AckRecord("e1", 3, H, "run", 1.0, format_version=1)
    assert AckRecord.from_json(ack.to_json()).format_version == 1
    (tmp_path / "asyncsync.json").write_text(
        json.dumps({"format": "asyncsync", "format_version": 1, "run_id": "r1"})
    )
    assert ensure_root_info(tmp_path).run_id == "r1"


def _entry(name: str, shard: int, *, full: bool = False) -> TensorEntry:
    delta = None if full else DeltaRef(shard, "sparse", f"{name}.pos", f"{name}.val")
    return TensorEntry(name, "float32", (2, 3), H, 1, delta, FullRef(shard, name) if full else None)


def test_merge_rebases_shards_and_joins_slices() -> None:
    shards = [ShardInfo(f"r{r}.safetensors", "delta", 10, H) for r in range(3)]
    slices = [TensorSlice(0, (3, 2)), TensorSlice(2, (3, 2)), TensorSlice(4, (3, 2))]
    ranks = []
    for r in range(3):
        sliced = as_part(
            TensorEntry("s", "float32", (1, 2), H, 1, DeltaRef(0, "sparse", "p", "v")),
            slices[r],
            ALGO,
        )
        ranks.append(([_entry(f"own{r}", 0), sliced], [shards[r]]))
    entries, merged = merge(ranks, ALGO)
    assert merged == tuple(shards)
    assert [e.name for e in entries] == ["own0", "s", "own1", "own2"]
    assert [e.delta.shard for e in entries if e.delta] == [0, 1, 2]
    s = entries[1]
    assert s.layout == ((0, 2), (2, 2), (4, 2)) and s.changed == 3 and s.shape == (3, 2)
    assert [p.delta.shard for p in s.parts or () if p.delta] == [0, 1, 2]
    assert s.checksum == parts_checksum([(0, 2, H), (2, 2, H), (4, 2, H)], ALGO)
    with pytest.raises(ConfigError, match="published by ranks 0 and 1"):
        merge([([_entry("x", 0)], shards[:1]), ([_entry("x", 0)], shards[1:2])], ALGO)
    with pytest.raises(ConfigError, match="do not fit"):
        as_part(_entry("x", 0), TensorSlice(1, (6,)), ALGO)
    with pytest.raises(ConfigError, match="non-negative"):
        TensorSlice(-1, (6,))


def test_part_record_round_trip() -> None:
    rec = PartRecord(
        3, "abcdef012345", 2, "run", (ShardInfo("a.safetensors", "delta", 1, H),),
        (_entry("w", 0), as_part(_entry("s", 0), TensorSlice(6, (4, 3)), ALGO)), 7, {"rank": 2},
    )  # fmt: skip
    assert PartRecord.from_json(rec.to_json()) == rec
    with pytest.raises(ManifestError, match="malformed"):
        PartRecord.from_json(rec.to_json().replace('"rank": 2, "run_id"', '"rank": -2, "run_id"'))
