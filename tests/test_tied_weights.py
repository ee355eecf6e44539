"""Tied weights (one storage under two names) on the engine side: a TorchModule whose module
ties ``lm_head`` to the embedding, fed by a trainer that unties them (attack-58)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncsync import ChecksumMismatch, ConfigError, Publisher
from receiver import ReceiverAgent
from receiver.engines import TorchModule
from tests.test_publish_misuse import raw_bytes


class TiedLM(torch.nn.Module):
    """An embedding and an ``lm_head`` sharing one weight (HF's ``tie_word_embeddings``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(40, 8)
        self.lm_head = torch.nn.Linear(8, 40, bias=False)
        self.lm_head.weight = self.embed.weight
        self.norm = torch.nn.Parameter(torch.ones(8))


@pytest.mark.parametrize("which", ["lm_head.weight", "embed.weight"])
async def test_a_version_a_tied_module_cannot_hold_is_never_acked(
    tmp_path: Path, which: str
) -> None:
    """The trainer unties its ``lm_head`` and changes only one of the two names: the engine
    patched the shared storage for that name, and kept the other name's checksum as it was
    (its tensor had no change in the version), so it committed and acknowledged a version
    whose other tensor it no longer held: ``embed.weight`` silently held ``lm_head``'s bytes.
    A tensor whose memory a patch of the version wrote is hashed at commit: the version is
    refused and the engine stays at the one before, bytes intact."""
    module, root = TiedLM(), tmp_path / "root"
    e = torch.randn(40, 8)
    sd = {"embed.weight": e, "lm_head.weight": e, "norm": torch.ones(8)}
    async with Publisher(root) as pub, ReceiverAgent(root, TorchModule(module), "e0") as agent:
        await pub.seed(sd)
        assert await agent.sync_once() == 0
        untied = {**sd, which: e + 1}  # the other name keeps v0's bytes
        await pub.publish(untied)
        with pytest.raises(ChecksumMismatch):
            await agent.sync_once()
        assert agent.engine.state.version == 0
        for k, v in sd.items():
            assert torch.equal(raw_bytes(module.state_dict()[k]), raw_bytes(v)), k


class FlatViews(torch.nn.Module):
    """Buffers registered with views of them (FSDP-1's flat parameters, fused QKV): ``flat``
    with its halves ``a``/``b`` and ``mid``, which overlaps both in part; a fused ``qkv`` with
    its column blocks ``q``/``kv`` and its transpose (not contiguous)."""

    def __init__(self, dtype: torch.dtype = torch.float32, *, views_first: bool = False) -> None:
        super().__init__()
        flat, qkv = torch.randn(300).to(dtype), torch.randn(8, 12).to(dtype)
        views = {"a": flat[:100], "b": flat[100:], "mid": flat[50:250], "q": qkv[:, :4]}
        views |= {"kv": qkv[:, 4:], "qkv_t": qkv.t()}
        for k, t in (
            views | {"flat": flat, "qkv": qkv}
            if views_first
            else {"flat": flat, "qkv": qkv} | views
        ).items():
            self.register_buffer(k, t)


@pytest.mark.parametrize(("dtype", "views_first"), [(torch.float32, False), (torch.bfloat16, True)])
async def test_views_of_one_buffer_follow_deltas_bit_exact(
    tmp_path: Path, dtype: torch.dtype, views_first: bool
) -> None:
    """Names that view parts of one buffer (``flat`` and ``flat[:100]``) each carry the
    version's change of the shared bytes: the engine XORed them in once per name, so every
    changed byte under two names went back to its old value and every delta was refused
    (ChecksumMismatch, waiting for a keyframe). Each byte is patched once per version: the
    module follows every delta, bit-exact under every name."""
    trainer, module = (
        FlatViews(dtype, views_first=views_first),
        FlatViews(dtype, views_first=views_first),
    )
    root = tmp_path / "root"
    module.load_state_dict(trainer.state_dict())
    gen = torch.Generator().manual_seed(5)
    async with Publisher(root) as pub, ReceiverAgent(root, TorchModule(module), "e0") as agent:
        await pub.seed(trainer.state_dict())
        assert await agent.sync_once() == 0
        for v in range(1, 5):
            with torch.no_grad():  # sparse, then dense, changes through the big buffers
                for buf in (trainer.flat, trainer.qkv.view(-1)):
                    hit = torch.rand(buf.shape, generator=gen) < (0.05 if v % 2 else 0.9)
                    buf[hit] += 1
            await pub.publish(trainer.state_dict())
            assert await agent.sync_once() == v
            for k, t in trainer.state_dict().items():
                assert torch.equal(raw_bytes(module.state_dict()[k]), raw_bytes(t)), (v, k)


async def test_a_version_whose_views_disagree_is_rolled_back_exactly(tmp_path: Path) -> None:
    """A version in which ``a`` is not ``flat[:100]`` (a trainer whose state dict holds copies,
    not views) cannot be held by a module whose ``a`` views ``flat``: refused, and the undo of
    the patches that wrote the shared bytes leaves every name at the version before."""
    trainer, module, root = FlatViews(), FlatViews(), tmp_path / "root"
    module.load_state_dict(trainer.state_dict())
    async with Publisher(root) as pub, ReceiverAgent(root, TorchModule(module), "e0") as agent:
        await pub.seed(trainer.state_dict())
        assert await agent.sync_once() == 0
        before = {k: raw_bytes(t) for k, t in trainer.state_dict().items()}
        sd = {k: t.clone() for k, t in trainer.state_dict().items()}
        sd["flat"][:150] += 1  # a's bytes and half of b's change under flat
        sd["a"][::3] += 2  # and differently under a; b keeps v0's bytes
        await pub.publish(sd)
        with pytest.raises(ChecksumMismatch):
            await agent.sync_once()
        assert agent.engine.state.version == 0
        for k, want in before.items():
            assert torch.equal(raw_bytes(module.state_dict()[k]), want), k


class Expanded(torch.nn.Module):
    """A buffer registered expanded (stride 0): its rows are one memory location."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("pe", torch.randn(1, 8).expand(4, 8))
        self.norm = torch.nn.Parameter(torch.ones(8))


async def test_an_expanded_buffer_is_refused_at_begin_with_what_to_do(tmp_path: Path) -> None:
    """A stride-0 buffer cannot take any write (torch: "more than one element of the written-to
    tensor refers to a single memory location"): every version failed at apply time with
    that as an ApplyFailed. It is refused before anything is written, naming the tensor and
    what to do instead; the module is left as it was."""
    trainer, module, root = Expanded(), Expanded(), tmp_path / "root"
    before = {k: raw_bytes(t) for k, t in module.state_dict().items()}
    async with Publisher(root) as pub, ReceiverAgent(root, TorchModule(module), "e0") as agent:
        await pub.seed(trainer.state_dict())
        with pytest.raises(ConfigError, match=r"'pe'.*expanded.*contiguous"):
            await agent.sync_once()
        assert agent.engine.state.version is None
    for k, want in before.items():
        assert torch.equal(raw_bytes(module.state_dict()[k]), want), k
