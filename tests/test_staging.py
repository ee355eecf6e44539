"""A full version's staged files (receiver.engines.checkpoint.staging): the bytes
``safetensors.torch.save_file`` writes, written in spans aligned to the file's offsets, so
that the page cache holds the files in large folios that a later delta maps writable cheaply
(see the module's docstring)."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import safetensors.torch
import torch

from asyncsync.format import TensorEntry
from asyncsync.format.checksum import entry_checksum
from asyncsync.format.names import DTYPES
from receiver.engines.checkpoint import staging


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(1000, 13, generator=g).to(torch.bfloat16),
        "layers.0.w": torch.randn(3001, generator=g),
        "layers.0.b": torch.randn(7, generator=g).to(torch.float16),
        "step": torch.tensor(5, dtype=torch.int64),
        "empty": torch.zeros(0, 4),
        "mask": torch.arange(9) % 2 == 0,
        "é.unicode": torch.randint(0, 255, (4099,), generator=g, dtype=torch.uint8),
        "fp8": torch.randn(33, generator=g).to(torch.float8_e4m3fn),
    }


def _entries(sd: dict[str, torch.Tensor]) -> list[tuple[TensorEntry, torch.Tensor]]:
    out = []
    for name, t in sd.items():
        e = TensorEntry(
            name=name, dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape),
            checksum="", changed=t.numel(),
        )  # fmt: skip
        out.append((e, t))
    return out


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(offset, bytes) of every writev the staging makes."""
    seen: list[tuple[int, int]] = []
    real = os.writev

    def spy(fd: int, buffers: list[memoryview]) -> int:
        at = os.lseek(fd, 0, os.SEEK_CUR)
        n = real(fd, buffers)
        seen.append((at, n))
        return n

    monkeypatch.setattr(os, "writev", spy)
    return seen


@pytest.mark.parametrize("span", [4096, 8192, 1 << 20])
def test_a_staged_file_is_save_files_bytes_written_in_aligned_spans(
    tmp_path: Path, writes: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch, span: int
) -> None:
    monkeypatch.setattr(staging, "WRITE_SPAN", span)
    sd = _state()
    sums = staging.stage_part(tmp_path, "part.safetensors", _entries(sd), "xxh3-128")
    safetensors.torch.save_file(sd, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    data = (tmp_path / "part.safetensors").read_bytes()
    assert data == (tmp_path / "ref.safetensors").read_bytes()
    assert sums == {e.name: entry_checksum(e, t, "xxh3-128") for e, t in _entries(sd)}
    # every write but the last one whole span, each at a multiple of it, in order, all of it
    assert writes, "the file was not written through the aligned writes"
    assert [at for at, _ in writes] == [k * span for k in range(len(writes))]
    assert all(n == span for _, n in writes[:-1])
    assert sum(n for _, n in writes) == len(data)


def test_many_small_tensors_in_one_span_are_written_aligned(
    tmp_path: Path, writes: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """More pieces in one span than one writev takes (a MoE's small experts): joined first."""
    monkeypatch.setattr(staging, "WRITE_SPAN", 1 << 20)
    g = torch.Generator().manual_seed(1)
    sd = {f"expert.{i}": torch.randn(i % 5 + 1, generator=g) for i in range(1500)}
    staging.stage_part(tmp_path, "part.safetensors", _entries(sd), "xxh3-128")
    safetensors.torch.save_file(sd, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    data = (tmp_path / "part.safetensors").read_bytes()
    assert data == (tmp_path / "ref.safetensors").read_bytes()
    assert writes == [(0, len(data))]


def test_a_short_writev_is_written_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.writev

    def short(fd: int, buffers: list[memoryview]) -> int:  # at most 1000 bytes a call
        left, out = 1000, []
        for b in buffers:
            out.append(b[:left])
            left -= len(out[-1])
            if not left:
                break
        return real(fd, out)

    monkeypatch.setattr(os, "writev", short)
    monkeypatch.setattr(staging, "WRITE_SPAN", 4096)
    sd = _state(2)
    staging.stage_part(tmp_path, "part.safetensors", _entries(sd), "xxh3-128")
    safetensors.torch.save_file(sd, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "part.safetensors").read_bytes() == (
        tmp_path / "ref.safetensors"
    ).read_bytes()


def _every_dtype(n: int, seed: int = 3) -> dict[str, torch.Tensor]:
    """A tensor of ``n`` elements (random bytes) of every dtype the format carries, named in
    the reverse of safetensors' own order: the layout is the file's, not the names'."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, (name, dtype) in enumerate(sorted(DTYPES.items())):
        raw = torch.randint(0, 256, (n * dtype.itemsize,), generator=g, dtype=torch.uint8)
        out[f"{99 - i}.{name}"] = raw.view(dtype)
    return out


@pytest.mark.parametrize("n", [0, 1, 37])
def test_every_dtype_is_staged_as_save_file_writes_it(
    tmp_path: Path, writes: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch, n: int
) -> None:
    """Each dtype the format carries ranked where safetensors puts it (and 0-element tensors,
    which take no bytes), written by the aligned writes, not left to ``save_file``."""
    monkeypatch.setattr(staging, "WRITE_SPAN", 4096)
    sd = _every_dtype(n)
    staging.stage_part(tmp_path, "part.safetensors", _entries(sd), "xxh3-128")
    safetensors.torch.save_file(sd, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    assert writes, "left to save_file"
    assert (tmp_path / "part.safetensors").read_bytes() == (
        tmp_path / "ref.safetensors"
    ).read_bytes()


def test_names_beyond_ascii_are_written_as_save_file_writes_them(
    tmp_path: Path, writes: list[tuple[int, int]]
) -> None:
    """UTF-8 in the header, not ``\\u`` escapes (the delta shards' header escapes them),
    sorted as safetensors sorts them (by bytes), quotes and backslashes escaped as it does."""
    names = [
        "é.w",
        "e.w",
        "z\\u00e9",
        "tab\tctl\x01",
        'q"uote',
        "back\\slash",
        "日本.w",
        "😀.bias",
        "ÿ",
        "Ā",
    ]
    sd = {name: torch.full((i + 1,), float(i)) for i, name in enumerate(names)}
    sd["empty.é"] = torch.zeros(0, 3, dtype=torch.bfloat16)
    staging.stage_part(tmp_path, "part.safetensors", _entries(sd), "xxh3-128")
    safetensors.torch.save_file(sd, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    assert writes, "left to save_file"
    data = (tmp_path / "part.safetensors").read_bytes()
    assert data == (tmp_path / "ref.safetensors").read_bytes()
    assert "日本.w".encode() in data


def test_a_dtype_it_does_not_rank_is_left_to_save_file(
    tmp_path: Path, writes: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dtype the format gained that the rank list does not place yet: ``save_file`` writes
    the file, never a layout of a guessed order."""
    ranks = {dt: r for dt, r in staging._RANK_OF.items() if dt != torch.float8_e5m2}
    monkeypatch.setattr(staging, "_RANK_OF", ranks)
    sd = {"a": torch.randn(5), "z": torch.zeros(3, dtype=torch.float8_e5m2)}
    staging.stage_part(tmp_path, "part.safetensors", _entries(sd), "xxh3-128")
    assert not writes
    back = safetensors.torch.load_file(tmp_path / "part.safetensors")
    assert set(back) == {"a", "z"} and torch.equal(back["a"], sd["a"])


@pytest.mark.parametrize("metadata", [{}, {"format": "pt"}, {"format": "pt", "k": "é"}])
def test_write_safetensors_is_save_files_bytes_whatever_the_metadata(
    tmp_path: Path, metadata: dict[str, str]
) -> None:
    """The writer's own contract, beside the staging's one caller (which passes
    ``{"format": "pt"}``): no metadata writes no ``__metadata__`` key, as ``save_file`` with
    none writes it. With two keys or more, ``save_file`` orders them as a Rust ``HashMap``
    iterates, which differs from process to process (this test failed 1 CI run in 5 comparing
    bytes): there the header's JSON, its length and the data are compared."""
    sd = {"a": torch.arange(5, dtype=torch.float32), "b": torch.zeros(3, dtype=torch.bfloat16)}
    assert staging.write_safetensors(tmp_path / "x.safetensors", sd, metadata)
    safetensors.torch.save_file(sd, tmp_path / "ref.safetensors", metadata=metadata or None)
    ours, ref = (
        (tmp_path / "x.safetensors").read_bytes(),
        (tmp_path / "ref.safetensors").read_bytes(),
    )
    if len(metadata) < 2:
        assert ours == ref
        return
    n = int.from_bytes(ref[:8], "little")
    assert ours[:8] == ref[:8] and ours[8 + n :] == ref[8 + n :]
    assert json.loads(ours[8 : 8 + n]) == json.loads(ref[8 : 8 + n])


@pytest.mark.parametrize("ranked", [True, False], ids=["write_safetensors", "save_file"])
def test_views_of_one_buffer_and_tied_names_are_staged_byte_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ranked: bool
) -> None:
    """A full shard's tensors are views of one buffer (parse_shard), tied names one tensor, and
    a bool's bytes need not be 0/1. ``save_file`` (the fallback) refuses shared storage, so
    those it writes are copied first: their bytes, never a bool's 0/1 copy (a tied bool mask
    failed its checksum that way: ``clone``)."""
    if not ranked:  # a dtype the rank list does not place: save_file writes the whole file
        monkeypatch.setattr(staging, "_RANK_OF", {})
    buf = bytearray(os.urandom(64))
    buf[:8] = bytes([0, 1, 2, 3, 255, 128, 7, 1])
    flat = torch.frombuffer(buf, dtype=torch.uint8)
    mask = flat[:8].view(torch.bool)
    sd = {"mask": mask, "tied.mask": mask, "w": flat[8:40].view(torch.bfloat16)}
    sd["v"] = flat[40:64].view(torch.int32)
    items = _entries(sd)
    items = [(replace(e, checksum=entry_checksum(e, t, "xxh3-128")), t) for e, t in items]
    sums = staging.stage_part(tmp_path, "part.safetensors", items, "xxh3-128")
    assert sums == {e.name: e.checksum for e, _ in items}
    back = {k: v for k, v in safetensors.deserialize((tmp_path / "part.safetensors").read_bytes())}
    for name, t in sd.items():
        assert bytes(back[name]["data"]) == bytes(t.reshape(-1).view(torch.uint8).numpy()), name
    assert bytes(buf[:8]) == bytes([0, 1, 2, 3, 255, 128, 7, 1])  # the source untouched
