"""A tensor that the trainer changes while ``publish`` reads it (an optimizer step in another
thread: CPU offload, a CPU trainer) never makes a version that engines cannot apply (attack-58).

Which bytes a publish catches of a tensor being written is the trainer's race; what the
publisher must keep is that the bytes it ships and the checksums it commits are the same bytes,
read once: a receiver applies the version, and holds what the publisher's snapshot holds.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

from asyncsync import Publisher, PublishError, codec
from asyncsync.codec import native
from asyncsync.format.checksum import checksum_tensor
from asyncsync.format.store import list_versions
from asyncsync.publish import snapshot
from receiver import ReceiverAgent
from receiver.engines import LocalCheckpoint
from tests.test_publish_misuse import checkpoint_tensors, raw_bytes

REPO = Path(__file__).resolve().parent.parent


def step_before_the_write(monkeypatch: pytest.MonkeyPatch, w: torch.Tensor) -> None:
    """An optimizer step lands on ``w`` right before its full shard is serialised: after the
    publisher read it for its checksum (and the diff), before the shard's bytes are taken."""
    save = safetensors.torch.save

    def stepped(tensors: dict[str, torch.Tensor], metadata: Any = None) -> bytes:
        if (metadata or {}).get("asyncsync.role") == "full":
            w.add_(1)
        return save(tensors, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save", stepped)


async def real_receiver_holds(root: Path, ckpt: Path, version: int) -> None:
    """A real receiver (``python -m receiver.cli --once``) into ``ckpt`` holds ``version``."""
    out = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "receiver.cli", "--root", str(root), "--engine-id", "rx",
         "--checkpoint", str(ckpt), "--once", "--force-polling", "--log-level", "WARNING"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"rx: holds version {version}"


def snapshot_bytes(pub: Publisher, name: str) -> torch.Tensor:
    return raw_bytes(pub._base.tensors[name])


async def test_a_step_between_the_checksum_and_the_full_shard_never_makes_a_bad_seed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full version checksummed each tensor, then serialised it for its shard (a second
    read): a step in between committed a seed whose shard disagreed with its own checksum, and
    every engine refused it ("checksum ... != ...; no other keyframe is readable"). The
    checksum is now taken of the shard's bytes: the engine holds what was shipped."""
    root, ckpt = tmp_path / "root", tmp_path / "ckpt"
    w = torch.zeros(4096)
    step_before_the_write(monkeypatch, w)
    async with (
        Publisher(root) as pub,
        ReceiverAgent(root, LocalCheckpoint(ckpt), "e0") as agent,
    ):
        await pub.seed({"w": w, "b": torch.ones(3)})
        assert await agent.sync_once() == 0
        assert torch.equal(raw_bytes(checkpoint_tensors(ckpt)["w"]), snapshot_bytes(pub, "w"))
        monkeypatch.undo()
        w[:10] += 5
        assert (await pub.publish({"w": w, "b": torch.ones(3)})).version == 1
        assert await agent.sync_once() == 1
        assert torch.equal(raw_bytes(checkpoint_tensors(ckpt)["w"]), raw_bytes(w))


async def test_a_step_between_a_keyframes_diff_and_its_full_shard_never_splits_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A keyframe carries a delta (checksummed in the diff's pass) and the whole tensor (read
    again for its shard): a step in between shipped two different tensors under one checksum.
    An engine at the base applied the delta; a new engine starting from the keyframe refused
    it. The full shard is now the bytes the delta ships: both engines hold the same tensor."""
    root = tmp_path / "root"
    w = torch.zeros(4096)
    async with (
        Publisher(root) as pub,
        ReceiverAgent(root, LocalCheckpoint(tmp_path / "old"), "old") as old,
    ):
        await pub.seed({"w": w})
        assert await old.sync_once() == 0
        w[:100] += 1
        step_before_the_write(monkeypatch, w)
        r = await pub.publish({"w": w}, keyframe=True)
        monkeypatch.undo()
        assert r.version == 1
        assert await old.sync_once() == 1
        shutil.rmtree(root / "v000000000000")  # as retention does: v1 is where engines start
        async with ReceiverAgent(root, LocalCheckpoint(tmp_path / "new"), "new") as new:
            assert await new.sync_once() == 1
        for d in ("old", "new"):
            got = raw_bytes(checkpoint_tensors(tmp_path / d)["w"])
            assert torch.equal(got, snapshot_bytes(pub, "w")), d


async def test_the_fallback_diff_checksums_the_bytes_its_delta_ships(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without the C kernel the diff finds the positions, then gathers the values, then hashes
    the new tensor: three reads. A step after the first made the checksum that of bytes the
    delta does not carry. The checksum is now of the snapshot the diff advanced."""
    from asyncsync.codec import diff

    old, new = torch.zeros(1000), torch.zeros(1000)
    new[::7] = 1
    find = diff._changed_positions_numpy

    def then_a_step(*a: Any) -> Any:
        out = find(*a)
        new.add_(1)
        return out

    monkeypatch.setattr(native, "kernels", None)
    monkeypatch.setattr(diff, "_changed_positions_numpy", then_a_step)
    (ch,) = codec.diff_tensors([old], [new], algorithm="xxh3-128", advance=True)
    assert ch.checksum == checksum_tensor(old, "xxh3-128")


@pytest.mark.skipif(native.kernels is None, reason="the C diff kernel is not built")
async def test_a_trainer_thread_stepping_during_deltas_never_makes_one_engines_refuse(
    tmp_path: Path,
) -> None:
    """The C kernel diffs a block and then hashes it from the new tensor (a second read): a
    thread stepping the weights meanwhile made deltas whose checksum was of other bytes than
    they carried, and a real receiver refused them ("does not apply to the engine's bytes")
    about one publish in two. Each delta now hashes the snapshot it advanced, element by
    element the bytes it ships: every one applies, and the receiver holds the snapshot."""
    root, ckpt = tmp_path / "root", tmp_path / "ckpt"
    w = torch.zeros(1 << 21)
    stop = threading.Event()

    def trainer() -> None:
        while not stop.is_set():
            w.add_(1)

    async with Publisher(root) as pub:
        await pub.seed({"w": w.clone()})
        th = threading.Thread(target=trainer)
        th.start()
        try:
            for _ in range(4):
                await pub.publish({"w": w})
        finally:
            stop.set()
            th.join()
        want = snapshot_bytes(pub, "w")
    await real_receiver_holds(root, ckpt, 4)
    assert torch.equal(raw_bytes(checkpoint_tensors(ckpt)["w"]), want)


def step_at_the_first_read(monkeypatch: pytest.MonkeyPatch, step: Callable[[], None]) -> None:
    """``step`` runs when the pipeline first reads tensors of the state dict, as its first
    bucket's items are taken (a trainer thread that gets there while publish awaits; a CPU
    state dict's tensors are taken as they are, a device one's through ``host_copies``)."""
    items = snapshot.bucket_items
    calls: list[int] = []

    def first_read(*args: Any, **kw: Any) -> Any:
        if not calls:
            calls.append(1)
            step()
        return items(*args, **kw)

    monkeypatch.setattr(snapshot, "bucket_items", first_read)


def eight() -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.full((1000,), float(i)) for i in range(8)}


@pytest.mark.parametrize("how", ["reshape", "retype", "delete", "clear"])
@pytest.mark.parametrize("kind", ["seed", "delta"])
async def test_the_state_dict_is_read_as_it_was_when_publish_was_called(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str, kind: str
) -> None:
    """The trainer's loop rebinds or drops entries of the dict it passed (``sd[k] = ...``, a
    cast to a new tensor) while publish awaits. The publisher read the dict's entries again
    bucket by bucket: a full version shipped an entry of another shape or dtype than its
    manifest says (committed; every engine refused it, "no other keyframe is readable"), a
    delta failed on a KeyError. The dict is read once, when publish is called."""
    root, ckpt = tmp_path / "root", tmp_path / "ckpt"
    sd = eight()
    want = {k: v.clone() for k, v in sd.items()}
    changes: dict[str, Callable[[], None]] = {
        "reshape": lambda: sd.__setitem__("t7", torch.ones(10, 100)),
        "retype": lambda: sd.__setitem__("t7", torch.ones(1000, dtype=torch.float64)),
        "delete": lambda: sd.pop("t7"),
        "clear": sd.clear,
    }
    async with (
        Publisher(root, bucket_bytes=4000) as pub,
        ReceiverAgent(root, LocalCheckpoint(ckpt), "e0") as agent,
    ):
        if kind == "delta":
            await pub.seed(eight())
            sd["t0"][0] = want["t0"][0] = 5
        step_at_the_first_read(monkeypatch, changes[how])
        r = await (pub.seed(sd) if kind == "seed" else pub.publish(sd))
        monkeypatch.undo()
        assert await agent.sync_once() == r.version
    got = checkpoint_tensors(ckpt)
    assert set(got) == set(want)
    assert all(torch.equal(raw_bytes(got[k]), raw_bytes(v)) for k, v in want.items())


@pytest.mark.parametrize("kind", ["seed", "delta", "keyframe"])
async def test_a_tensor_whose_data_is_swapped_while_publish_reads_it_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """``param.data = other`` (as FSDP's flat parameters and ZeRO-3's partitioned ones do)
    changes the shape or dtype of the very tensor publish was given, after the manifest's
    entries were taken from it: a full version shipped it as it then was (committed; every
    engine refused it), a delta failed on "tensor 0: old is ..., new is ...". A PublishError
    that names the tensor, nothing committed, and the next publish goes on."""
    root = tmp_path / "root"
    sd = eight()
    p = torch.nn.Parameter(torch.zeros(1000), requires_grad=False)
    sd["p"] = p

    def swap() -> None:
        p.data = torch.zeros(10, 100, dtype=torch.bfloat16)

    async with Publisher(root, bucket_bytes=4000) as pub:
        if kind != "seed":
            await pub.seed({**eight(), "p": torch.zeros(1000)})
        step_at_the_first_read(monkeypatch, swap)
        with pytest.raises(PublishError, match=r"'p' .*changed"):
            await (pub.seed(sd) if kind == "seed" else pub.publish(sd, keyframe=kind == "keyframe"))
        monkeypatch.undo()
        assert list_versions(root) == ([] if kind == "seed" else [0])
        p.data = torch.ones(1000)
        r = await (pub.seed(sd) if kind == "seed" else pub.publish(sd))
    assert r.version == (0 if kind == "seed" else 1)
    async with ReceiverAgent(root, LocalCheckpoint(tmp_path / "ckpt"), "e0") as agent:
        assert await agent.sync_once() == r.version
    assert torch.equal(checkpoint_tensors(tmp_path / "ckpt")["p"], torch.ones(1000))


@pytest.mark.skipif(native.kernels is None, reason="the C diff kernel is not built")
async def test_a_rank_whose_weights_a_thread_steps_never_makes_a_version_engines_refuse(
    tmp_path: Path,
) -> None:
    """A rank of a group diffs without advancing its snapshot (it may miss the outcome): its
    C diff hashed the new tensor in a second read, and a dense change was copied into the
    snapshot from the live tensor after the commit. A thread stepping rank 0's weights made
    versions a real receiver refused. The hash is of the bytes the delta makes, the snapshot
    takes the values the diff read: every version applies, and the receiver holds the
    ranks' snapshots."""
    from asyncsync import FileRendezvous

    root, ckpt = tmp_path / "root", tmp_path / "ckpt"
    pubs = [
        Publisher(root, coordinator=FileRendezvous(root, r, 2, timeout=60, poll_interval=0.002))
        for r in range(2)
    ]
    ws = [torch.zeros(1 << 20), torch.zeros(1 << 20)]
    stop = threading.Event()

    def trainer() -> None:
        while not stop.is_set():
            ws[0].add_(1)

    for p in pubs:
        await p.open()
    try:
        await asyncio.gather(*(p.seed({f"w{r}": ws[r].clone()}) for r, p in enumerate(pubs)))
        th = threading.Thread(target=trainer)
        th.start()
        try:
            for _ in range(4):
                await asyncio.gather(*(p.publish({f"w{r}": ws[r]}) for r, p in enumerate(pubs)))
        finally:
            stop.set()
            th.join()
        want = {f"w{r}": snapshot_bytes(p, f"w{r}") for r, p in enumerate(pubs)}
    finally:
        for p in pubs:
            await p.close()
    await real_receiver_holds(root, ckpt, 4)
    got = checkpoint_tensors(ckpt)
    assert all(torch.equal(raw_bytes(got[k]), v) for k, v in want.items())
