"""A small torch model that follows SGLang's loader conventions, for the in-engine tests.

``stacked_params_mapping`` (q/k/v -> ``qkv_proj`` with shard ids "q"/"k"/"v", gate/up ->
``gate_up_proj`` with shard ids 0/1), per-rank slicing (``tp_rank``/``tp_size``: column-parallel
rows, row-parallel columns, a vocab-parallel embedding) and tied embeddings (``lm_head`` shares
the embedding and ``load_weights`` skips ``lm_head.weight``). Every loader ends in a narrowed
``copy_``, as SGLang 0.5.23's do.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal

import safetensors.torch
import torch
from torch import nn

from asyncsync import Publisher
from asyncsync.format import Manifest
from receiver import ReceiverAgent
from receiver.engines import LocalCheckpoint
from receiver.engines.base import Engine, EngineState, TensorUpdate
from receiver.engines.stage_builder import Staging, clear_stages, stage_dir_of
from receiver.plugins.inplace import InEngineLoader
from tests.conftest import same_bytes

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS = 32, 16, 4, 2, 4, 24, 2
BF16 = torch.bfloat16


PAD = 4  # rows of vocabulary padding per rank, as SGLang pads VocabParallelEmbedding


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """SGLang 0.5.23's ``default_weight_loader``, as it is."""
    if param.numel() == 1 and loaded.numel() == 1:
        param.data.fill_(loaded.item())
    else:
        assert param.size() == loaded.size()
        param.data.copy_(loaded)


class ColumnParallel(nn.Module):
    """Output rows split across ranks; fused shards (``shard_sizes``) laid out per rank."""

    def __init__(self, shard_sizes: dict[Any, int], tp_rank: int, tp_size: int):
        super().__init__()
        self.rank, self.tp = tp_rank, tp_size
        self.offsets: dict[Any, tuple[int, int]] = {}
        off = 0
        for sid, full in shard_sizes.items():
            self.offsets[sid] = (off, full // tp_size)
            off += full // tp_size
        self.weight = nn.Parameter(torch.zeros(off, HIDDEN, dtype=BF16), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any) -> None:
        off, size = self.offsets[shard_id]
        param.data.narrow(0, off, size).copy_(loaded.narrow(0, self.rank * size, size))


class RowParallel(nn.Module):
    def __init__(self, out: int, inp: int, tp_rank: int, tp_size: int):
        super().__init__()
        self.rank, self.size = tp_rank, inp // tp_size
        self.weight = nn.Parameter(torch.zeros(out, self.size, dtype=BF16), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded.narrow(1, self.rank * self.size, self.size))


class VocabParallelEmbedding(nn.Module):
    """A rank's rows of the vocabulary, then zero padding rows (SGLang's loader: copy into
    ``param[:n]``, ``fill_(0)`` the rest)."""

    def __init__(self, tp_rank: int, tp_size: int):
        super().__init__()
        self.rank, self.size = tp_rank, VOCAB // tp_size
        self.weight = nn.Parameter(
            torch.full((self.size + PAD, HIDDEN), 7.0, dtype=BF16), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        loaded = loaded.narrow(0, self.rank * self.size, self.size)
        param[: loaded.shape[0]].data.copy_(loaded)
        param[loaded.shape[0] :].data.fill_(0)


class Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(HIDDEN, dtype=torch.float32), requires_grad=False)


class Layer(nn.Module):
    def __init__(self, r: int, tp: int):
        super().__init__()
        q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
        self.self_attn = nn.Module()
        self.self_attn.qkv_proj = ColumnParallel({"q": q, "k": kv, "v": kv}, r, tp)
        self.self_attn.o_proj = RowParallel(HIDDEN, q, r, tp)
        self.mlp = nn.Module()
        self.mlp.gate_up_proj = ColumnParallel({0: INTER, 1: INTER}, r, tp)
        self.mlp.down_proj = RowParallel(HIDDEN, INTER, r, tp)
        self.input_layernorm = Norm()
        self.post_attention_layernorm = Norm()


class ToyForCausalLM(nn.Module):
    """The shape of an SGLang LlamaForCausalLM, small, with tied embeddings."""

    stacked_params_mapping = (  # (param_name, shard_name, shard_id), as in SGLang's models
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )

    def __init__(self, tp_rank: int = 0, tp_size: int = 1, *, scale: bool = False):
        super().__init__()
        self.model = nn.Module()
        if scale:  # a one-element parameter: default_weight_loader fills it from .item()
            self.model.scale = nn.Parameter(torch.zeros(1), requires_grad=False)
        self.model.embed_tokens = VocabParallelEmbedding(tp_rank, tp_size)
        self.model.layers = nn.ModuleList(Layer(tp_rank, tp_size) for _ in range(LAYERS))
        self.model.norm = Norm()
        self.lm_head = nn.Module()
        self.lm_head.weight = self.model.embed_tokens.weight  # tie_word_embeddings
        self.loaded_names: list[str] = []

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        for name, loaded in weights:
            self.loaded_names.append(name)
            if "rotary_emb.inv_freq" in name or name == "lm_head.weight":  # tied: skipped
                continue
            for param_name, shard_name, shard_id in self.stacked_params_mapping:
                if shard_name not in name:
                    continue
                param = params[name.replace(shard_name, param_name)]
                param.weight_loader(param, loaded, shard_id)  # type: ignore[attr-defined]
                break
            else:
                param = params[name]
                getattr(param, "weight_loader", default_weight_loader)(param, loaded)


def hf_state(seed: int, *, scale: bool = False) -> dict[str, torch.Tensor]:
    """An HF-named state dict for the toy model (tied: lm_head equals the embedding)."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    sd = {"model.embed_tokens.weight": w(VOCAB, HIDDEN)}
    if scale:
        sd["model.scale"] = w(1, dtype=torch.float32)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = w(HEADS * HEAD_DIM, HIDDEN)
        sd[p + "self_attn.k_proj.weight"] = w(KV_HEADS * HEAD_DIM, HIDDEN)
        sd[p + "self_attn.v_proj.weight"] = w(KV_HEADS * HEAD_DIM, HIDDEN)
        sd[p + "self_attn.o_proj.weight"] = w(HIDDEN, HEADS * HEAD_DIM)
        sd[p + "mlp.gate_proj.weight"] = w(INTER, HIDDEN)
        sd[p + "mlp.up_proj.weight"] = w(INTER, HIDDEN)
        sd[p + "mlp.down_proj.weight"] = w(HIDDEN, INTER)
        sd[p + "input_layernorm.weight"] = w(HIDDEN, dtype=torch.float32)
        sd[p + "post_attention_layernorm.weight"] = w(HIDDEN, dtype=torch.float32)
    sd["model.norm.weight"] = w(HIDDEN, dtype=torch.float32)
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    return sd


def step(sd: dict[str, torch.Tensor], names: list[str], seed: int) -> dict[str, torch.Tensor]:
    """A training step that changes ~3% of the elements of ``names`` (the tie kept)."""
    g = torch.Generator().manual_seed(seed)
    out = {k: v.clone() for k, v in sd.items()}
    for n in names:
        t = out[n]
        mask = torch.rand(t.shape, generator=g) < 0.03
        mask.view(-1)[0] = True
        t[mask] = (t.float()[mask] + 0.5).to(t.dtype)
    out["lm_head.weight"] = out["model.embed_tokens.weight"].clone()
    return out


def reference(sd: dict[str, torch.Tensor], tp_rank: int, tp_size: int) -> ToyForCausalLM:
    m = ToyForCausalLM(tp_rank, tp_size, scale="model.scale" in sd)
    m.load_weights(sd.items())
    return m


def assert_same_params(model: nn.Module, ref: nn.Module) -> None:
    got, want = model.state_dict(), ref.state_dict()
    assert set(got) == set(want)
    for k in want:
        assert same_bytes(got[k], want[k]), k


# --------------------------------------------------------------------------- a staging receiver


class StagedCheckpoint(Engine):
    """A LocalCheckpoint that also stages every delta (what ReloadingEngine does before it asks
    a server to apply the stage), keeping each stage for the test to hand to the models."""

    def __init__(self, directory: Path):
        self.checkpoint = LocalCheckpoint(directory)
        self.staging = Staging("test")
        self.stages: dict[int, Path] = {}
        self._m: Manifest | None = None

    async def open(self) -> EngineState:
        self.state = await self.checkpoint.open()
        clear_stages(self.checkpoint.directory)
        return self.state

    async def close(self) -> None:
        await self.checkpoint.close()

    async def begin(self, manifest: Manifest, mode: Literal["delta", "full"]) -> None:
        base = self.checkpoint.state
        await self.checkpoint.begin(manifest, mode)
        self._m = manifest
        if mode == "delta":
            await self.staging.begin(self.checkpoint, manifest, base)

    async def apply(self, updates: list[TensorUpdate]) -> None:
        await self.staging.add(updates)
        await self.checkpoint.apply(updates)

    async def commit(self) -> str:
        fp = await self.checkpoint.commit()
        name = await self.staging.commit()
        assert self._m is not None
        if name is not None:
            self.stages[self._m.version] = stage_dir_of(self.checkpoint.directory, self._m.version)
        self.staging.builder = None  # kept on disk for the test
        self.state = self.checkpoint.state
        return fp

    async def abort(self) -> None:
        await self.staging.drop()
        await self.checkpoint.abort()

    async def bump(self, manifest: Manifest) -> None:
        await self.checkpoint.bump(manifest)
        self.state = self.checkpoint.state

    async def acknowledged(self) -> None:
        await self.checkpoint.acknowledged()


class Rig:
    """A Publisher, a receiver staging each delta, and ``tp`` ranks of the toy model, each with
    its InEngineLoader (the plugin's per-model state)."""

    def __init__(self, tmp_path: Path, tp: int = 2, *, encoding: str = "xef", **toy: Any):
        self.root, self.ckpt = tmp_path / "root", tmp_path / "ckpt"
        self.pub = Publisher(self.root, bucket_bytes=4096, keyframe_interval=0, encoding=encoding)
        self.engine = StagedCheckpoint(self.ckpt)
        self.agent = ReceiverAgent(self.root, self.engine, "rx", use_inotify=False)
        self.tp = tp
        self.models = [ToyForCausalLM(r, tp, **toy) for r in range(tp)]
        self.loaders = [InEngineLoader(m) for m in self.models]
        self.full_reloads = 0
        self.sd: dict[str, torch.Tensor] = {}

    async def __aenter__(self) -> Rig:
        await self.pub.open()
        await self.agent.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.agent.close()
        await self.pub.close()

    async def publish(self, sd: dict[str, torch.Tensor], **kw: Any) -> int:
        self.sd = sd
        if self.pub.version is None:
            v = (await self.pub.seed(sd)).version
        else:
            v = (await self.pub.publish(sd, **kw)).version
        await self.agent.sync_once()
        # the checkpoint's flush (state.json "synced") runs on after the ack: the tests change
        # the checkpoint's files and state.json by hand, which must not race with it
        await self.engine.checkpoint.flushed()
        return v

    def full_of(self, rank: int) -> Callable[[str], tuple[bool, str]]:
        def full(path: str) -> tuple[bool, str]:  # SGLang's own reload: every tensor
            self.full_reloads += 1
            self.models[rank].load_weights(LocalCheckpoint(path).load_state_dict().items())
            return True, "Succeeded to update model weights."

        return full

    def load_all(self) -> list[str]:
        """Every rank reloads the checkpoint (as the receiver's first reload does)."""
        out = []
        for r, loader in enumerate(self.loaders):
            full = self.full_of(r)
            ok, msg = loader.reload_checkpoint(self.ckpt, lambda full=full: full(str(self.ckpt)))
            assert ok, msg
            out.append(msg)
        return out

    def apply_all(self, version: int) -> list[str]:
        """Every rank applies the stage of ``version``; returns their messages."""
        out = []
        for r, loader in enumerate(self.loaders):
            ok, msg = loader.apply_stage(self.engine.stages[version], self.full_of(r))
            assert ok, msg
            out.append(msg)
        return out

    def check(self) -> None:
        for r, m in enumerate(self.models):
            assert_same_params(m, reference(self.sd, r, self.tp))


def corrupt_tensor(ckpt: Path, name: str) -> None:
    """Change one element of ``name`` in the checkpoint's file (shape and header intact)."""
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    path = ckpt / index["weight_map"][name]
    tensors = safetensors.torch.load_file(path)
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1
    safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})
