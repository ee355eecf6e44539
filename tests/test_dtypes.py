"""Every dtype that torch and safetensors both name goes end to end: published (seed, deltas,
a keyframe, a full-mode root), applied by the receivers into a checkpoint and into a
TorchModule bit-exact, and named by the in-engine plugins' tables; the others are refused
before anything is written, with the reason and the supported list.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import safetensors.torch
import torch

from asyncsync import ConfigError, Publisher
from asyncsync.format import DTYPE_SIZES, dtype_from_name
from asyncsync.format.checksum import tensor_bytes
from asyncsync.format.names import SAFETENSORS_CODES, version_dir
from asyncsync.format.store import list_versions, read_manifest
from receiver import ReceiverAgent
from receiver.engines import st_layout
from receiver.engines.checkpoint import LocalCheckpoint
from receiver.engines.torch_module import TorchModule
from receiver.plugins import held
from tests.conftest import Holder, assert_holds, mutate, random_tensor

# dtypes the format carries since helper-68 (before: refused with "not supported")
ADDED = ["uint16", "uint32", "uint64", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
         "complex64"]  # fmt: skip


def every_dtype_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    for name in DTYPE_SIZES:
        dt = dtype_from_name(name)
        sd[f"w.{name}"] = random_tensor((48, 33), dt, g)
        sd[f"w.{name}.t"] = random_tensor((12, 20), dt, g).t()  # not contiguous
        sd[f"w.{name}.scalar"] = random_tensor((), dt, g)
        sd[f"w.{name}.empty"] = random_tensor((0, 3), dt, g)
    return sd


def test_the_format_names_every_dtype_torch_and_safetensors_both_name() -> None:
    """The installed safetensors' own table (what its loaders map a code to) against ours:
    every dtype both name is in the format, under safetensors' code."""
    theirs = {c: t for c, t in safetensors.torch._TYPES.items() if t is not None}
    theirs.setdefault("F8_E8M0", getattr(torch, "float8_e8m0fnu", None))  # saved, loaded by Rust
    for code, dt in theirs.items():
        if dt is None:
            continue
        name = str(dt).removeprefix("torch.")
        assert name in DTYPE_SIZES, name
        assert SAFETENSORS_CODES[name] == code
        assert dtype_from_name(name) == dt
        assert DTYPE_SIZES[name] == dt.itemsize
    for name in ADDED:
        assert name in DTYPE_SIZES


async def test_every_dtype_is_published_and_applied_bit_exact(tmp_path: Path) -> None:
    root = tmp_path / "root"
    sd = every_dtype_state(0)
    ckpt = ReceiverAgent(root, LocalCheckpoint(tmp_path / "ckpt"), "ckpt", use_inotify=False)
    mod = ReceiverAgent(root, TorchModule(Holder(sd)), "mod", use_inotify=False)
    async with Publisher(root, bucket_bytes=4096, keyframe_interval=3) as pub:
        await pub.seed(sd)
        for agent in (ckpt, mod):
            assert await agent.sync_once() == 0
        for step in range(1, 5):  # v3 is a keyframe
            sd = mutate(sd, 0.1, seed=step)
            await pub.publish(sd)
            for agent in (ckpt, mod):
                assert await agent.sync_once() == step
                got = (
                    agent.engine.load_state_dict()  # type: ignore[attr-defined]
                    if agent is ckpt
                    else agent.engine.module.state_dict()  # type: ignore[attr-defined]
                )
                assert_holds(got, sd)
    m = read_manifest(root, 4)
    assert {e.dtype for e in m.tensors} == set(DTYPE_SIZES)
    for agent in (ckpt, mod):
        await agent.close()


async def test_every_dtype_in_a_full_mode_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    sd = every_dtype_state(1)
    ckpt = ReceiverAgent(root, LocalCheckpoint(tmp_path / "ckpt"), "ckpt", use_inotify=False)
    async with Publisher(root, mode="full", bucket_bytes=4096) as pub:
        await pub.seed(sd)
        sd = mutate(sd, 0.1, seed=2)
        await pub.publish(sd)
    assert list_versions(root) == [0, 1]
    assert await ckpt.sync_once() == 1
    assert_holds(ckpt.engine.load_state_dict(), sd)  # type: ignore[attr-defined]
    await ckpt.close()


def test_the_plugins_dtype_tables_name_every_dtype() -> None:
    """The in-engine readers of safetensors headers (the file maps, the held checkpoint's
    specs) know every code the format writes."""
    for name, code in SAFETENSORS_CODES.items():
        assert st_layout.BY_CODE[code] == dtype_from_name(name)
        assert held._ST_DTYPES[code] == name


@pytest.mark.parametrize(
    ("dtype", "why"),
    [
        (torch.complex128, "safetensors has no code"),
        (torch.complex32, "safetensors has no code"),
        (torch.float4_e2m1fn_x2, "two values per byte"),
        (torch.bits8, "bit-packed"),
        (torch.uint4, "sub-byte"),
    ],
)
async def test_a_dtype_the_format_cannot_carry_is_refused_before_anything_is_written(
    tmp_path: Path, dtype: torch.dtype, why: str
) -> None:
    root = tmp_path / "root"
    # (a complex32 made by torch warns that it is experimental; quantized tensors are deprecated)
    bad = torch.zeros(3 * dtype.itemsize, dtype=torch.uint8).view(dtype)
    async with Publisher(root) as pub:
        with pytest.raises(ConfigError, match=rf"(?s)w.bad.*{dtype}.*{why}.*supported: bool"):
            await pub.seed({"w.ok": torch.zeros(3), "w.bad": bad})
    assert list_versions(root) == []


async def test_a_lazily_conjugated_complex_tensor_is_refused_naming_it(tmp_path: Path) -> None:
    """``t.conj()`` of a complex tensor is a view whose bytes are not its values (a bit says
    "conjugate when read"): publishing its bytes would ship the unconjugated values. It failed
    mid-pipeline with torch's RuntimeError about views; it is refused up front now."""
    t = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64).conj()
    async with Publisher(tmp_path / "root") as pub:
        with pytest.raises(ConfigError, match=r"state_dict\['c'\] is a lazily conjugated view"):
            await pub.seed({"c": t})
        res = await pub.seed({"c": t.resolve_conj()})
    assert res.version == 0


async def test_full_shards_are_plain_safetensors_files_each_tensor_at_its_alignment(
    tmp_path: Path,
) -> None:
    """A full shard is written from the publisher's own copies, header then each tensor's bytes
    (not one ``safetensors.torch.save`` buffer: a second copy of every tensor in flight, 2.27x
    the model at a 1 GiB seed): safetensors' own reader takes the seed's and a keyframe's, each
    tensor's bytes are the state's, and each starts at a multiple of its element size."""
    root = tmp_path / "root"
    sd = every_dtype_state(2)
    async with Publisher(root, bucket_bytes=4096, keyframe_interval=1) as pub:
        await pub.seed(sd)
        old, sd = sd, mutate(sd, 0.1, seed=3)
        await pub.publish(sd)  # a keyframe: its full shards come from the advanced snapshot
    for version, want in ((0, old), (1, sd)):
        vdir = version_dir(root, version)
        seen = set()
        for path in sorted(vdir.glob("full-*.safetensors")):
            data = path.read_bytes()
            (n,) = struct.unpack("<Q", data[:8])
            assert (8 + n) % 8 == 0
            for name, info in safetensors.deserialize(data):  # validates offsets: no holes
                t = want[name]
                assert info["dtype"] == SAFETENSORS_CODES[str(t.dtype).removeprefix("torch.")]
                assert info["shape"] == list(t.shape)
                assert bytes(info["data"]) == bytes(tensor_bytes(t)), name
                seen.add(name)
            header = json.loads(data[8 : 8 + n])
            for name, entry in header.items():
                if name != "__metadata__":
                    assert entry["data_offsets"][0] % want[name].element_size() == 0, name
        assert seen == set(want)
