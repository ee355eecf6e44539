"""The staged delta file (receiver.plugins.stage): written by the receiver, read by the engine
plugin, which must refuse anything that does not verify or parse exactly (FORMAT.md section 8's
trust rules for what an engine reads)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from asyncsync.codec import int_view
from asyncsync.errors import FormatError
from receiver.plugins.stage import (
    DATA_NAME,
    STAGE_NAME,
    StageWriter,
    VersionRef,
    is_stage,
    read_stage,
)

BASE = VersionRef(4, "run-a", "f" * 32)
TARGET = VersionRef(5, "run-a", "e" * 32)


def write_stage(d: Path) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 16, generator=g)
    h = torch.randn(5, generator=g).to(torch.bfloat16)
    pos = torch.tensor([0, 3, 17, 127])
    vals = torch.randint(1, 2**31 - 1, (4,), generator=g, dtype=torch.int32)
    dense = torch.randint(-(2**15), 2**15 - 1, (5,), generator=g, dtype=torch.int16)
    wr = StageWriter(d, target=TARGET, base=BASE, algorithm="xxh3-128")
    wr.add("w", torch.float32, (8, 16), pos, vals)
    wr.add("h", torch.bfloat16, (5,), None, dense)
    wr.commit({"w": "a" * 32, "h": "b" * 32, "other": "c" * 32}, {"w": [(0, 64), (64, 64)]})
    return {"w": w, "h": h, "pos": pos, "vals": vals, "dense": dense}


def test_round_trip(tmp_path: Path) -> None:
    d = tmp_path / "stage"
    src = write_stage(d)
    assert is_stage(d)
    st = read_stage(d)
    assert (st.base, st.target, st.algorithm) == (BASE, TARGET, "xxh3-128")
    assert st.checksums == {"w": "a" * 32, "h": "b" * 32, "other": "c" * 32}
    assert st.parts == {"w": [(0, 64), (64, 64)]}
    w, h = st.tensors
    assert (w.name, w.dtype, w.shape, w.changed) == ("w", torch.float32, (8, 16), 4)
    assert w.positions is not None and w.positions.dtype == torch.int32
    assert torch.equal(w.positions.long(), src["pos"]) and torch.equal(w.values, src["vals"])
    assert h.positions is None and torch.equal(h.values, src["dense"])
    # the dense XOR: values at the positions, zero elsewhere, in the HF shape and dtype
    d_w = w.dense()
    assert d_w.shape == (8, 16) and d_w.dtype == torch.float32
    flat = int_view(d_w)
    assert torch.equal(flat[src["pos"]], src["vals"]) and int(flat.count_nonzero()) == 4
    assert torch.equal(int_view(h.dense()), src["dense"])


def test_a_stage_is_written_last_and_a_writer_can_abort(tmp_path: Path) -> None:
    d = tmp_path / "s"
    wr = StageWriter(d, target=TARGET, base=BASE, algorithm="xxh3-128")
    wr.add("w", torch.float32, (4,), torch.tensor([1]), torch.tensor([7], dtype=torch.int32))
    assert not is_stage(d)  # no stage.json before commit
    with pytest.raises(FormatError):
        read_stage(d)
    wr.abort()
    assert not d.exists()


def _rewrite(d: Path, **changes: object) -> None:
    doc = json.loads((d / STAGE_NAME).read_text())
    doc.update(changes)
    (d / STAGE_NAME).write_text(json.dumps(doc))


def _tensor_field(d: Path, i: int, **changes: object) -> None:
    doc = json.loads((d / STAGE_NAME).read_text())
    doc["tensors"][i].update(changes)
    (d / STAGE_NAME).write_text(json.dumps(doc))


@pytest.mark.parametrize(
    "damage",
    [
        "flip_data",
        "truncate_data",
        "grow_data",
        "data_symlink",
        "data_fifo",
        "stage_symlink",
        "not_json",
        "nan",
        "wrong_format",
        "future_version",
        "bad_target",
        "unknown_algorithm",
        "offset_beyond",
        "unaligned",
        "unsorted",
        "out_of_range",
        "count_mismatch",
        "dense_short",
        "unknown_dtype",
        "no_checksum",
        "repeated",
        "bad_parts",
    ],
)
def test_anything_that_does_not_verify_is_refused(tmp_path: Path, damage: str) -> None:
    d = tmp_path / "stage"
    write_stage(d)
    data = d / DATA_NAME
    raw = data.read_bytes()
    doc = json.loads((d / STAGE_NAME).read_text())
    if damage == "flip_data":
        b = bytearray(raw)
        b[5] ^= 1
        data.write_bytes(bytes(b))
    elif damage == "truncate_data":
        data.write_bytes(raw[:-1])
    elif damage == "grow_data":
        data.write_bytes(raw + b"\0")
    elif damage == "data_symlink":
        (tmp_path / "elsewhere").write_bytes(raw)
        data.unlink()
        os.symlink(tmp_path / "elsewhere", data)
    elif damage == "data_fifo":
        data.unlink()
        os.mkfifo(data)
    elif damage == "stage_symlink":
        (tmp_path / "real.json").write_text((d / STAGE_NAME).read_text())
        (d / STAGE_NAME).unlink()
        os.symlink(tmp_path / "real.json", d / STAGE_NAME)
    elif damage == "not_json":
        (d / STAGE_NAME).write_text("{")
    elif damage == "nan":
        (d / STAGE_NAME).write_text(
            (d / STAGE_NAME).read_text().replace('"changed": 4', '"changed": NaN')
        )
    elif damage == "wrong_format":
        _rewrite(d, format="asyncsync-manifest")
    elif damage == "future_version":
        _rewrite(d, format_version=2)
    elif damage == "bad_target":
        _rewrite(d, target={"version": -1, "run_id": "x", "fingerprint": None})
    elif damage == "unknown_algorithm":
        _rewrite(d, checksum_algorithm="md5")
    elif damage == "offset_beyond":
        _tensor_field(d, 0, values={**doc["tensors"][0]["values"], "offset": 1 << 20})
    elif damage == "unaligned":
        _tensor_field(d, 0, values={**doc["tensors"][0]["values"], "offset": 3})
    elif damage in ("unsorted", "out_of_range"):
        # rewrite the positions with valid checksums: the structural check must catch them
        wr = StageWriter(d, target=TARGET, base=BASE, algorithm="xxh3-128")
        pos = torch.tensor([5, 3]) if damage == "unsorted" else torch.tensor([3, 128])
        wr.add("w", torch.float32, (8, 16), pos, torch.tensor([1, 2], dtype=torch.int32))
        wr.commit({"w": "a" * 32}, {})
    elif damage == "count_mismatch":
        _tensor_field(d, 0, changed=3)
    elif damage == "dense_short":
        _tensor_field(d, 1, shape=[6])
    elif damage == "unknown_dtype":
        _tensor_field(d, 0, dtype="float128")
    elif damage == "no_checksum":
        _rewrite(d, checksums={"h": "b" * 32})
    elif damage == "repeated":
        _rewrite(d, tensors=[doc["tensors"][0], doc["tensors"][0]])
    elif damage == "bad_parts":
        _rewrite(d, parts={"w": [[0, -1]]})
    with pytest.raises(FormatError):
        read_stage(d)


def test_writer_refuses_inconsistent_input(tmp_path: Path) -> None:
    wr = StageWriter(tmp_path / "s", target=TARGET, base=BASE, algorithm="xxh3-128")
    with pytest.raises(FormatError, match="values must be"):
        wr.add("w", torch.float32, (4,), torch.tensor([1]), torch.tensor([1], dtype=torch.int16))
    with pytest.raises(FormatError, match="positions"):
        wr.add("w", torch.float32, (4,), torch.tensor([1, 2]), torch.tensor([1], dtype=torch.int32))
    with pytest.raises(FormatError, match="dense values"):
        wr.add("w", torch.float32, (4,), None, torch.tensor([1], dtype=torch.int32))
    wr.add("w", torch.float32, (4,), torch.tensor([1]), torch.tensor([1], dtype=torch.int32))
    with pytest.raises(FormatError, match="twice"):
        wr.add("w", torch.float32, (4,), torch.tensor([1]), torch.tensor([1], dtype=torch.int32))
    with pytest.raises(FormatError, match="without a checksum"):
        wr.commit({}, {})
    wr.abort()


def test_a_stage_over_a_symlinked_directory_is_replaced_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("x")
    link = tmp_path / "stage"
    os.symlink(victim, link)
    write_stage(link)
    assert (victim / "keep").read_text() == "x" and not link.is_symlink()
