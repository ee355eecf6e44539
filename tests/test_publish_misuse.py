"""The trainer-side publish API under a hostile or unlucky trainer (helper-31): what it publishes
reaches a real receiver bit for bit, or publish raises a typed error and commits nothing."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from safetensors import safe_open

from asyncsync import AsyncSyncError, ConfigError, Publisher, PublishError, codec
from asyncsync.format.store import list_versions, read_manifest
from asyncsync.publish.merge import TensorSlice
from receiver import ReceiverAgent
from receiver.engines import LocalCheckpoint
from tests.conftest import mixed_state, mutate, same_bytes
from tests.ports import free_port


def checkpoint_tensors(d: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a receiver's checkpoint directory, read as a server reads it."""
    index = json.loads((d / "model.safetensors.index.json").read_text())
    out: dict[str, torch.Tensor] = {}
    for f in sorted(set(index["weight_map"].values())):
        with safe_open(str(d / f), "pt") as st:
            for k in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                out[k] = st.get_tensor(k)
    return out


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes, never its values (a bool's copy would write 0/1; a non-contiguous
    one's ``reshape`` copies it)."""
    return codec.raw_view(t).reshape(-1).view(torch.uint8).clone()


def bools(*values: int) -> torch.Tensor:
    """A bool tensor holding these bytes (a mask viewed from uint8, ``torch.empty``'s garbage)."""
    return torch.tensor(values, dtype=torch.uint8).view(torch.bool)


async def publish_and_receive(
    root: Path, ckpt: Path, versions: list[dict[str, torch.Tensor]]
) -> None:
    """Seed ``versions[0]``, publish the others; after each the receiver holds its bytes."""
    async with Publisher(root) as pub, ReceiverAgent(root, LocalCheckpoint(ckpt), "e0") as agent:
        for i, sd in enumerate(versions):
            want = {k: raw_bytes(v) for k, v in sd.items()}
            r = await (pub.seed(sd) if i == 0 else pub.publish(sd))
            assert await agent.sync_once() == r.version, r
            got = {k: raw_bytes(v) for k, v in checkpoint_tensors(ckpt).items()}
            assert set(got) == set(want)
            assert all(torch.equal(got[k], want[k]) for k in want), (r.version, r.kind)


async def test_bool_bytes_other_than_0_and_1_survive_the_snapshot(tmp_path: Path) -> None:
    """A bool tensor's bytes are shipped as they are (the diff reads int views), but the
    snapshot of a full version was a torch clone (or ``copy_``), which writes 0/1: the next
    delta was diffed against bytes no engine held, and every engine refused it until the next
    keyframe (helper-31, finding 1)."""
    versions = [
        {"mask": bools(0, 1, 2, 255), "w": torch.ones(3)},  # seed: the snapshot is cloned
        {"mask": bools(0, 1, 3, 255), "w": torch.ones(3)},
        {"mask": bools(0, 1, 3, 255, 9), "w": torch.ones(3)},  # a new shape: full, copied
        {"mask": bools(0, 7, 3, 255, 9), "w": torch.ones(3)},
    ]
    await publish_and_receive(tmp_path / "root", tmp_path / "ckpt", versions)


async def test_a_non_contiguous_bool_tensor_is_shipped_with_its_bytes(tmp_path: Path) -> None:
    """The publisher made each tensor contiguous with ``contiguous()``, which copies a
    non-contiguous bool as bools and writes 0/1: a transposed or sliced mask viewed from uint8
    was shipped normalised, under the checksum of its real bytes (no engine could take it).
    Its bytes are copied as ints now, in a full version and in a delta."""
    versions = [
        {"mask": bools(*range(24)).reshape(4, 6).t(), "w": torch.ones(3)},  # seed: full
        {"mask": bools(*range(3, 27)).reshape(4, 6).t(), "w": torch.ones(3)},  # a delta
        {"mask": bools(*range(40))[::2].reshape(5, 4), "w": torch.zeros(3)},  # full: re-shaped
        {"mask": bools(*range(1, 41))[::2].reshape(5, 4), "w": torch.zeros(3)},
    ]
    assert not any(v["mask"].is_contiguous() for v in versions)
    await publish_and_receive(tmp_path / "root", tmp_path / "ckpt", versions)


async def test_tied_bool_tensors_with_other_bytes_make_a_seed_engines_take(tmp_path: Path) -> None:
    """Tied tensors (one storage under two names) are copied apart for the full shard; a bool
    copy wrote 0/1, so the shard disagreed with the checksum taken from the bytes and no
    engine could ever start from the seed ("no other keyframe is readable"; helper-31,
    finding 1)."""
    m = bools(0, 1, 2, 255)
    versions = [{"a": m, "b": m}, {"a": bools(0, 1, 2, 254), "b": bools(0, 1, 2, 254)}]
    await publish_and_receive(tmp_path / "root", tmp_path / "ckpt", versions)


class BoolMasks(torch.nn.Module):
    """A module with a bool buffer, a non-contiguous one (a transposed mask) and a float one."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", torch.zeros(8, dtype=torch.bool))
        self.register_buffer("mask_t", torch.zeros(4, 6, dtype=torch.bool).t())
        self.register_buffer("w", torch.zeros(3))


async def test_a_torch_module_holds_the_bool_bytes_shipped(tmp_path: Path) -> None:
    """The publisher ships a bool tensor's bytes as they are (2, 255: a uint8 mask viewed as
    bool); TorchModule copied a full version in with ``copy_``, which writes 0/1, so its
    commit found other bytes than the checksums and rolled back: no engine of that module took
    the seed, nor any delta after it (helper-33). It holds the shipped bytes now, contiguous
    or not, and a delta after them."""
    from receiver.engines import TorchModule
    from receiver.engines.base import TensorUpdate

    versions = [
        {"mask": bools(0, 1, 2, 255, 7, 0, 128, 3), "mask_t": bools(*range(24)).reshape(6, 4)},
        {"mask": bools(0, 1, 3, 255, 7, 0, 128, 4), "mask_t": bools(*range(2, 26)).reshape(6, 4)},
    ]
    module = BoolMasks()
    engine, root = TorchModule(module), tmp_path / "root"
    async with Publisher(root) as pub, ReceiverAgent(root, engine, "e0") as agent:
        for i, sd in enumerate(versions):
            sd["w"] = torch.full((3,), float(i))
            r = await (pub.seed(sd) if i == 0 else pub.publish(sd))
            assert (r.version, r.kind) == (i, "full" if i == 0 else "delta")
            assert await agent.sync_once() == r.version
            for k, v in sd.items():
                assert torch.equal(raw_bytes(module.get_buffer(k)), raw_bytes(v)), (i, k)
    assert not module.get_buffer("mask_t").is_contiguous()
    # a full copy rolled back restores the bytes it journaled, not 0/1
    m = read_manifest(root, 1)
    await engine.begin(m, "full")
    new = bools(*range(100, 124)).reshape(6, 4)
    await engine.apply([TensorUpdate(m.tensor_map()["mask_t"], full=new)])
    assert torch.equal(raw_bytes(module.get_buffer("mask_t")), raw_bytes(new))
    await engine.abort()
    assert torch.equal(raw_bytes(module.get_buffer("mask_t")), raw_bytes(versions[1]["mask_t"]))


@pytest.mark.parametrize(
    ("what", "tensor", "name", "match"),
    [
        ("rank 65", torch.zeros([1] * 65), "a", "65 dimensions"),
        ("a dim over 2^53", torch.empty(0, 2**60), "a", "dimension"),
        ("a lone surrogate", torch.ones(2), "x\ud800", "UTF-8"),
    ],
)
async def test_a_tensor_no_manifest_can_hold_is_refused_at_publish(
    tmp_path: Path, what: str, tensor: torch.Tensor, name: str, match: str
) -> None:
    """A tensor of more than 64 dimensions or a dimension over 2^53 (a 0-element tensor needs
    no memory for it) was committed in a manifest every reader refuses: each receiver marked
    the version bad while publish returned it. A name that is no UTF-8 failed deep in the
    write. Each is a ConfigError naming the tensor, at seed and at publish, and nothing is
    committed (helper-31, finding 2)."""
    root = tmp_path / "root"
    async with Publisher(root) as pub:
        with pytest.raises(ConfigError, match=match):
            await pub.seed({"w": torch.ones(2), name: tensor})
        await pub.seed({"w": torch.ones(2)})
        with pytest.raises(ConfigError, match=match):
            await pub.publish({"w": torch.ones(2), name: tensor})
    assert list_versions(root) == [0], what
    assert [e.name for e in read_manifest(root, 0).tensors] == ["w"]
    for full_shape in ((1,) * 65, (2**60,)):  # a slice's full shape: the same bounds
        with pytest.raises(ConfigError, match="at most"):
            TensorSlice(offset=0, full_shape=full_shape)


def _pairs() -> Any:
    return ((k, torch.ones(2)) for k in ("w",))


@pytest.mark.parametrize(
    ("what", "make"),
    [
        ("the module itself", lambda: torch.nn.Linear(2, 2)),
        ("None", lambda: None),
        ("a generator of pairs", _pairs),
        ("a list of pairs", lambda: [("w", torch.ones(2))]),
        ("a tensor", lambda: torch.ones(2)),
        ("an int", lambda: 5),
    ],
)
async def test_a_state_dict_that_is_no_mapping_is_a_config_error(
    tmp_path: Path, what: str, make: Any
) -> None:
    """``publish(model)`` for ``publish(model.state_dict())``, None, pairs, a tensor: each raised
    whatever its first use did (TypeError "'Linear' object is not iterable", RuntimeError
    "Boolean value of Tensor ... is ambiguous", "the state dict is empty" for None, a key
    "('w', tensor(...))"; ``seed`` a TypeError from ``Path()``). A ConfigError that says a
    mapping of names to tensors is wanted, and nothing committed (helper-31, finding 3)."""
    root = tmp_path / "root"
    async with Publisher(root) as pub:
        with pytest.raises(ConfigError, match="mapping of names to tensors"):
            await pub.seed(make())
        await pub.seed({"w": torch.ones(2)})
        with pytest.raises(ConfigError, match="mapping of names to tensors"):
            await pub.publish(make())
    assert list_versions(root) == [0], what


async def test_a_publish_cancelled_while_its_directory_is_made_leaves_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The version directory is made in a thread; a publish cancelled meanwhile removed the
    directory (none yet) and returned while the thread went on and made it: an uncommitted
    ``vN/`` stayed in the root until the next publish or open (40 random ``wait_for``
    timeouts met it once). The cancelled publish waits for the thread, as the pipeline's
    stages do, and leaves nothing (helper-31, finding 4)."""
    from asyncsync.publish import commit

    root = tmp_path / "root"
    started, made = threading.Event(), threading.Event()

    def slow_claim(*a: Any, **k: Any) -> None:  # a mkdir on a slow network filesystem
        started.set()
        time.sleep(0.3)
        try:
            commit.claim_version_dir(*a, **k)
        finally:
            made.set()

    sd = mixed_state(0)
    async with Publisher(root) as pub:
        await pub.seed(sd)
        monkeypatch.setattr("asyncsync.publish.publisher.claim_version_dir", slow_claim)
        task = asyncio.create_task(pub.publish(mutate(sd, 0.05, seed=1)))
        await asyncio.to_thread(started.wait, 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.to_thread(made.wait, 10)
        assert sorted(p.name for p in root.iterdir() if p.name.startswith("v")) == ["v000000000000"]
        monkeypatch.undo()
        assert (await pub.publish(mutate(sd, 0.05, seed=1))).version == 1


@pytest.mark.parametrize("meanwhile", ["another publisher", "the root wiped"])
async def test_a_publisher_reopened_after_the_root_moved_on_never_ships_a_stale_delta(
    tmp_path: Path, meanwhile: str
) -> None:
    """A Publisher closed and opened again kept its snapshot although the root had moved on:
    after another publisher's version it published a delta of its own old snapshot on top of
    that version (every engine refused it, publish returned it), and on a wiped root a v0
    whose base_version is -1 (no reader takes that manifest). The snapshot goes when the root
    is not where this publisher left it: publish raises (seed again) or publishes a version
    the receiver applies, bit for bit (helper-31, finding 5)."""
    root, ckpt = tmp_path / "root", tmp_path / "ckpt"
    sd0 = mixed_state(0)
    sd1, sd2 = mutate(sd0, 0.05, seed=1), mutate(sd0, 0.05, seed=2)
    a = Publisher(root)
    await a.open()
    await a.seed(sd0)
    await a.publish(sd1)
    await a.close()
    if meanwhile == "another publisher":
        async with Publisher(root) as b:
            await b.seed(sd2)
    else:
        shutil.rmtree(root)
    before = list_versions(root) if root.exists() else []
    await a.open()
    try:
        try:
            await a.publish(sd2)
        except AsyncSyncError:
            assert list_versions(root) == before  # nothing committed
            await a.seed(sd2)
    finally:
        await a.close()
    for v in list_versions(root):
        read_manifest(root, v)  # every manifest reads
    async with ReceiverAgent(root, LocalCheckpoint(ckpt), "e0") as agent:
        assert await agent.sync_once() == list_versions(root)[-1]
    got = checkpoint_tensors(ckpt)
    assert set(got) == set(sd2)
    assert all(same_bytes(got[k], t) for k, t in sd2.items())


async def test_a_tensor_changed_while_a_seed_commits_never_breaks_the_deltas_after_it(
    tmp_path: Path,
) -> None:
    """The seed (any full version) checksums and writes the caller's tensors, then copies them
    into the snapshot once the manifest is in place. A trainer whose optimizer step (another
    task, a thread; here the pre-commit hook) changes a weight in between gets a snapshot that
    is not what was shipped: publish returns, and every delta after it is refused by every
    engine until the next keyframe (20 versions by default). A delta, by contrast, advances
    the snapshot from the bytes its diff read. Now a hash pass over the full version's
    snapshot finds the changed tensor, a warning is logged, and the next version is a keyframe
    (helper-31 finding 6, fixed by helper-34). Since helper-68 a full version reads each
    tensor once, into a copy its shards and its snapshot both come from: the step in between
    changes nothing that was shipped, and the next version is a delta that applies."""
    root, ckpt = tmp_path / "root", tmp_path / "ckpt"
    w = torch.zeros(1000)

    def optimizer_step_meanwhile(vdir: Path) -> None:
        if vdir.name.endswith("0"):
            w.add_(1)

    async with (
        Publisher(root, pre_commit_hook=optimizer_step_meanwhile) as pub,
        ReceiverAgent(root, LocalCheckpoint(ckpt), "e0") as agent,
    ):
        await pub.seed({"w": w})
        assert pub.stale == []  # the snapshot is the copy that was shipped (all zeros)
        assert await agent.sync_once() == 0
        assert same_bytes(checkpoint_tensors(ckpt)["w"], torch.zeros(1000))
        nxt = w.clone()
        nxt[:10] += 5
        res = await pub.publish({"w": nxt})  # was: a delta onto the wrong base, refused
        assert res.kind == "delta" and pub.stale == []
        assert await agent.sync_once() == 1
        assert same_bytes(checkpoint_tensors(ckpt)["w"], nxt)


async def test_a_manifest_larger_than_readers_take_is_refused_before_the_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Readers refuse a manifest over ``MAX_MANIFEST_BYTES`` (256 MiB), the publisher wrote one
    of any size: 5600 one-element tensors named with 4096 emoji (each escaped to 12 bytes of
    JSON, twice) made a 525 MiB manifest, committed, that every receiver marked bad. Here the
    limit is made small for a small model. A ConfigError saying why, nothing committed
    (helper-31, finding 7)."""
    from asyncsync.format import store

    monkeypatch.setattr(store, "MAX_MANIFEST_BYTES", 64 << 10)
    root = tmp_path / "root"
    sd = {f"{i:03d}" + "\U0001f600" * 200: torch.zeros(1) for i in range(40)}
    async with Publisher(root) as pub:
        with pytest.raises(ConfigError, match=r"manifest .* bytes"):
            await pub.seed(sd)
        assert list_versions(root) == []
        assert not any(p.name.startswith("v") for p in root.iterdir())
        await pub.seed({"w": torch.ones(2)})
    read_manifest(root, 0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"engines": "gpu0"}, "list of engine ids"),  # waited for engines g, p, u and 0
        ({"engines": ["../gpu0"]}, "invalid engine id"),  # a ManifestError
        ({"engines": ["gpu0"], "version": None}, "version"),  # TypeError from a comparison
        ({"engines": ["gpu0"], "timeout": "5"}, "timeout"),  # TypeError
        ({"engines": ["gpu0"], "timeout": float("nan")}, "timeout"),  # returned at once
        ({"quorum": "1"}, "quorum"),  # TypeError
    ],
)
async def test_wait_acked_refuses_what_it_cannot_wait_for(
    tmp_path: Path, kwargs: dict[str, Any], match: str
) -> None:
    """``wait_acked(v, engines="gpu0")`` iterated the string and waited for engines 'g', 'p',
    'u' and '0': with the default ``timeout=None`` forever, though gpu0 had acked. Arguments
    it cannot use are a ConfigError at once (helper-31, finding 8)."""
    root = tmp_path / "root"
    async with (
        Publisher(root) as pub,
        ReceiverAgent(root, LocalCheckpoint(tmp_path / "ckpt"), "gpu0") as agent,
    ):
        await pub.seed({"w": torch.ones(3)})
        assert await agent.sync_once() == 0
        version = kwargs.pop("version", 0)
        with pytest.raises(ConfigError, match=match):
            await asyncio.wait_for(pub.wait_acked(version, **kwargs), 5)
        assert set(await pub.wait_acked(0, engines=["gpu0"])) == {"gpu0"}


@pytest.mark.parametrize(
    ("what", "tensor", "match"),
    [
        ("rank 65", torch.zeros([1] * 65), "65 dimensions"),
        ("a dim over 2^53", torch.zeros(0, 2**60), "dimension"),
        # (uint16 was refused here until the format carried it, helper-68; float4 is not)
        ("float4", torch.zeros(3, dtype=torch.uint8).view(torch.float4_e2m1fn_x2), "dtype"),
    ],
)
async def test_a_checkpoint_seed_with_a_tensor_no_manifest_holds_is_refused(
    tmp_path: Path, what: str, tensor: torch.Tensor, match: str
) -> None:
    """``seed(path)`` registers a checkpoint's files as they are: a tensor of 65 dimensions or
    a dimension over 2^53 in them was committed in a manifest every reader refuses (finding 2
    by the other door). A ConfigError naming the file, nothing committed (helper-31)."""
    hf = tmp_path / "hf"
    hf.mkdir()
    safetensors.torch.save_file({"w": torch.ones(2), "x": tensor}, hf / "model.safetensors")
    root = tmp_path / "root"
    async with Publisher(root) as pub:
        with pytest.raises(ConfigError, match=match):
            await pub.seed(hf)
    assert list_versions(root) == [], what


@pytest.mark.parametrize(
    "producer",
    [{"lr": float("nan")}, {"t": torch.ones(1)}, {"s": {1}}, {1: "a"}, [("a", 1)], "abc"],
)
def test_a_producer_no_manifest_can_hold_is_refused_by_the_constructor(
    tmp_path: Path, producer: Any
) -> None:
    """``producer`` goes into every manifest as JSON: a NaN, a tensor, a set made every publish
    write all its shards and then fail at the manifest; a list was a TypeError from the
    constructor. A ConfigError naming ``producer``, before anything is written (helper-31,
    finding 9)."""
    with pytest.raises(ConfigError, match="producer"):
        Publisher(tmp_path / "root", producer=producer)
    assert not (tmp_path / "root").exists()


@pytest.mark.parametrize(
    ("what", "producer", "sd"),
    [
        ("a producer list of 50000 zeros", {"hist": [0] * 50000}, {"w": torch.ones(2)}),
        ("2000 tensors of 64 dims", None, {f"t{i}": torch.ones([1] * 64) for i in range(2000)}),
    ],
)
async def test_a_manifest_readers_refuse_unparsed_is_refused_before_the_commit(
    tmp_path: Path, what: str, producer: dict[str, Any] | None, sd: dict[str, torch.Tensor]
) -> None:
    """Readers refuse, unparsed, a manifest over 64 KiB with more than one ``,``/``:`` per 5
    bytes or ``{``/``[`` per 16 (FORMAT.md 11.3's density bound). A producer holding a list of
    small numbers, or many tensors of many dimensions (``[1,1,...]``), made one: committed,
    and every receiver marked it bad. A ConfigError, nothing committed (helper-31, finding 7,
    by density)."""
    root = tmp_path / "root"
    async with Publisher(root, producer=producer) as pub:
        with pytest.raises(ConfigError, match="manifest"):
            await pub.seed(sd)
    assert list_versions(root) == [], what


def test_a_receiver_reads_back_any_index_it_writes() -> None:
    """A LocalCheckpoint writes an HF index naming each tensor of the version it applied, and
    refused to read one over 64 MiB: 17000 tensors of 4096-character names (a 135 MiB
    manifest, which readers take) were applied and acked, and every later start of the
    receiver failed ("cannot read .../model.safetensors.index.json: ... larger than 67108864
    bytes"). An index is smaller than the manifest it comes from, so its bound is the
    manifests' (helper-31, finding 10; the full-size run takes ~20 s and 0.7 GB)."""
    from asyncsync.format import store
    from receiver.engines.checkpoint import files

    assert files._MAX_INDEX_BYTES >= store.MAX_MANIFEST_BYTES


@pytest.mark.parametrize("keyframe", ["no", "", 1, 0, None, torch.tensor(True)])
async def test_publish_refuses_a_keyframe_that_is_not_a_bool(tmp_path: Path, keyframe: Any) -> None:
    """``publish(sd, keyframe="no")`` was taken as True (a truthy string published a full
    version, 1 too; "" and None a delta). Anything but a bool is a ConfigError before anything
    is written, and the publisher goes on (helper-33)."""
    root = tmp_path / "root"
    async with Publisher(root) as pub:
        await pub.seed({"w": torch.zeros(4)})
        with pytest.raises(ConfigError, match="keyframe must be True or False"):
            await pub.publish({"w": torch.ones(4)}, keyframe=keyframe)
        assert list_versions(root) == [0]
        assert not (root / "v000000000001").exists()
        r = await pub.publish({"w": torch.ones(4)})
    assert (r.version, r.kind) == (1, "delta")


async def test_a_cancelled_publish_returns_only_once_its_pre_commit_hook_thread_ended(
    tmp_path: Path,
) -> None:
    """A sync pre-commit hook runs in a thread, which cancellation cannot stop: the cancelled
    publish used to return (and remove the version directory) while the hook still ran in it.
    It now waits for the hook's thread, then the cancellation proceeds (helper-34)."""
    started, ended = threading.Event(), threading.Event()

    def slow_hook(vdir: Path) -> None:
        started.set()
        time.sleep(0.5)
        ended.set()

    root = tmp_path / "root"
    async with Publisher(root, pre_commit_hook=slow_hook) as pub:
        task = asyncio.create_task(pub.seed({"w": torch.ones(8)}))
        while not started.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert ended.is_set()
        assert list_versions(root) == []
        await pub.seed({"w": torch.ones(8)})
    assert list_versions(root) == [0]


def test_a_publisher_serves_one_asyncio_run_after_another(tmp_path: Path) -> None:
    """The publisher's asyncio.Lock bound itself to the first loop that waited on it: under a
    later ``asyncio.run``, two overlapping publishes raised RuntimeError ("bound to a different
    event loop"). The lock is now made anew in each running loop (helper-34)."""
    pub = Publisher(tmp_path / "root")

    async def two_at_once(first: int) -> None:
        sds = [{"w": torch.full((64,), float(first + i))} for i in range(2)]
        await asyncio.gather(*(pub.publish(sd) for sd in sds))

    async def open_and_seed() -> None:
        await pub.open()
        await pub.seed({"w": torch.zeros(64)})
        await two_at_once(1)

    asyncio.run(open_and_seed())
    asyncio.run(two_at_once(3))
    asyncio.run(pub.close())
    assert list_versions(tmp_path / "root") == [0, 1, 2, 3, 4]


async def test_a_publisher_whose_root_was_wiped_never_commits_beside_the_new_one(
    tmp_path: Path,
) -> None:
    """The root wiped under an open publisher (its lock file with it): a second publisher locks
    a new file and seeds; the first one's next publish used to commit its delta into the second
    one's root (two writers). Now it is refused before the manifest, nothing of it is left, and
    the second publisher goes on (helper-34's finding)."""
    root = tmp_path / "root"
    sd = {"w": torch.arange(4096, dtype=torch.float32)}
    async with Publisher(root) as a:
        await a.seed(sd)
        for p in list(root.iterdir()):
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        async with Publisher(root) as b:
            assert (await b.seed(sd)).version == 0
            sd["w"][:100] += 1
            with pytest.raises(PublishError, match="no longer the lock file this publisher holds"):
                await a.publish(sd)
            assert sorted(p.name for p in root.iterdir() if p.name.startswith("v")) == [
                "v000000000000"
            ]
            assert (await b.publish(sd)).version == 1


def _dtensor() -> torch.Tensor:
    """A DTensor over a one-process CPU mesh (an FSDP2 trainer's ``state_dict()`` holds these)."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                world_size=1)  # fmt: skip
    return distribute_tensor(torch.arange(8.0), init_device_mesh("cpu", (1,)), [Shard(0)])


def _fake() -> torch.Tensor:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.ones(4)  # says "cpu", holds no data


@pytest.mark.parametrize(
    ("what", "make", "match"),
    [("a DTensor", _dtensor, "DTensor.*full_tensor"), ("a FakeTensor", _fake, "FakeTensor")],
)
async def test_a_tensor_subclass_without_plain_memory_is_a_config_error(
    tmp_path: Path, what: str, make: Any, match: str
) -> None:
    """An FSDP2 trainer's ``model.state_dict()`` holds DTensors; a traced model's, FakeTensors.
    Publishing one failed deep in the pipeline, after the version directory was made, with
    "RuntimeError('.numpy() is not supported for tensor subclasses.')" (attack-58). It is a
    ConfigError naming the tensor and what to pass instead, before anything is written."""
    import torch.distributed as dist

    root = tmp_path / "root"
    try:
        async with Publisher(root) as pub:
            with pytest.raises(ConfigError, match=match):
                await pub.seed({"w": torch.ones(2), "x": make()})
            assert list_versions(root) == [], what
            await pub.seed({"w": torch.ones(2)})
            with pytest.raises(ConfigError, match=match):
                await pub.publish({"w": torch.ones(2), "x": make()})
    finally:  # no process group left for the tests after this one
        if dist.is_initialized():
            dist.destroy_process_group()
    assert list_versions(root) == [0]


@pytest.mark.parametrize("step", ["lock", "clean_leftovers"])
async def test_an_open_cancelled_in_a_step_holds_no_lock_and_leaves_no_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    """``open()`` takes the root's lock and removes leftovers in threads. Cancelled meanwhile
    (``asyncio.timeout`` around it on a slow network root), it returned while the lock's thread
    went on and took the lock: every other publisher was refused (LockHeld) until this process
    ended, and this one, reopened, said it was open at version 0 of run '' and refused every
    seed ("v0 is already committed"). A cancel during the clean-up released the lock while its
    thread still removed directories (a publisher opening meanwhile could lose its version
    directory). Both wait for their thread now; the lock is free and a reopen publishes on."""
    from asyncsync.fsio import FileLock
    from asyncsync.publish import commit

    root = tmp_path / "root"
    sd = mixed_state(0)
    async with Publisher(root) as pub:
        await pub.seed(sd)
        await pub.publish(mutate(sd, 0.05, seed=1))
    started, release, done = threading.Event(), threading.Event(), threading.Event()
    real = FileLock.acquire if step == "lock" else commit.clean_leftovers

    def slow(*a: Any) -> Any:  # a slow network filesystem
        started.set()
        release.wait(10)
        try:
            return real(*a)
        finally:
            done.set()

    if step == "lock":
        monkeypatch.setattr(FileLock, "acquire", slow)
    else:
        monkeypatch.setattr(commit, "clean_leftovers", slow)
    pub = Publisher(root)
    task = asyncio.create_task(pub.open())
    await asyncio.to_thread(started.wait, 10)
    task.cancel()
    await asyncio.sleep(0.05)
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert done.is_set()  # the cancel came out once the thread had ended
    monkeypatch.undo()
    async with Publisher(root) as other:  # the lock is free
        assert other.version == 1
    await pub.open()
    try:
        assert (pub.version, pub.run_id) == (1, read_manifest(root, 1).run_id)
        assert (await pub.seed(sd)).version == 2
    finally:
        await pub.close()
    assert list_versions(root) == [0, 1, 2]


@pytest.mark.parametrize("call", ["publish", "close", "publish from a sync hook's thread"])
async def test_a_pre_commit_hook_calling_its_publisher_is_refused_not_hung(
    tmp_path: Path, call: str
) -> None:
    """A pre-commit hook that calls its own publisher (publish the next step, close it) waited
    for the publish in flight, which waited for the hook: a hang for ever, found by no timeout
    but the caller's. The call is refused with PublishError naming the cause; nothing is
    committed and the publisher goes on."""
    root = tmp_path / "root"
    sd = mixed_state(0)
    armed: list[Publisher] = []

    async def hook(vdir: Path) -> None:
        if armed:
            pub = armed.pop()
            await (pub.close() if call == "close" else pub.publish(mutate(sd, 0.1, seed=9)))

    def sync_hook(vdir: Path) -> None:
        if armed:
            pub = armed.pop()
            asyncio.run_coroutine_threadsafe(pub.publish(sd), loop).result(timeout=10)

    loop = asyncio.get_running_loop()
    threaded = call.endswith("thread")
    async with Publisher(root, pre_commit_hook=sync_hook if threaded else hook) as pub:
        await pub.seed(sd)
        armed.append(pub)
        async with asyncio.timeout(30):
            with pytest.raises(PublishError, match="from inside its own call"):
                await pub.publish(mutate(sd, 0.1, seed=1))
        assert list_versions(root) == [0]
        assert (await pub.publish(mutate(sd, 0.1, seed=1))).version == 1
