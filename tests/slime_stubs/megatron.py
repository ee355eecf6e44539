"""A tiny Llama-like model in the shapes slime's getter yields, and a converter back to HF.

``hf_state(step)`` is the model's HF state dict after ``step`` training steps (a few percent of
the bytes change per step, bf16). ``shards(step, rank, tp)`` is what slime's
``weights_backuper.get("actor")`` gives tensor-parallel rank ``rank``: Megatron global names,
column-parallel weights split on dim 0 (the fused QKV per query group, the GLU ``linear_fc1``
as ``[gate_r; up_r]``), row-parallel ones on dim 1, the vocabulary split on dim 0, norms
replicated. :func:`convert` is the converter the updater calls on every rank: it all-gathers
the shards over ``torch.distributed`` (as slime's ``all_gather_param``), renames them as
slime's ``convert_to_hf`` does for Llama, and keeps chunk ``i`` on rank ``i % world_size``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

H, HEADS, HD, F, V, LAYERS = 8, 2, 4, 12, 16, 2
P = "module.module."


def hf_state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.randn(V, H, generator=g)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for n, shape in (
            ("self_attn.q_proj.weight", (HEADS * HD, H)),
            ("self_attn.k_proj.weight", (HEADS * HD, H)),
            ("self_attn.v_proj.weight", (HEADS * HD, H)),
            ("self_attn.o_proj.weight", (H, HEADS * HD)),
            ("mlp.gate_proj.weight", (F, H)),
            ("mlp.up_proj.weight", (F, H)),
            ("mlp.down_proj.weight", (H, F)),
            ("input_layernorm.weight", (H,)),
            ("post_attention_layernorm.weight", (H,)),
        ):
            sd[p + n] = torch.randn(*shape, generator=g)
    sd["model.norm.weight"] = torch.randn(H, generator=g)
    sd["lm_head.weight"] = torch.randn(V, H, generator=g)
    sd = {k: v.to(torch.bfloat16) for k, v in sd.items()}
    for s in range(1, step + 1):
        gs = torch.Generator().manual_seed(s)
        for k in sorted(sd):
            t = sd[k].clone().reshape(-1)
            mask = torch.rand(t.numel(), generator=gs) < 0.03
            t[mask] = (t[mask].float() + 0.01).to(torch.bfloat16)
            sd[k] = t.reshape(sd[k].shape)
    return sd


def _qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Megatron's fused QKV: per query group (one per head here) [q_g; k_g; v_g]."""
    groups = [
        torch.cat([q[g * HD : (g + 1) * HD], k[g * HD : (g + 1) * HD], v[g * HD : (g + 1) * HD]])
        for g in range(HEADS)
    ]
    return torch.cat(groups)


def shards(step: int, rank: int, tp: int) -> Iterator[tuple[str, torch.Tensor]]:
    """What slime's getter yields on tensor-parallel rank ``rank`` of ``tp``."""
    sd = hf_state(step)

    def col(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(tp, 0)[rank].clone()

    def row(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(tp, 1)[rank].clone()

    yield P + "embedding.word_embeddings.weight", col(sd["model.embed_tokens.weight"])
    for i in range(LAYERS):
        h, m = f"model.layers.{i}.", f"{P}decoder.layers.{i}."
        qkv = _qkv(
            sd[h + "self_attn.q_proj.weight"],
            sd[h + "self_attn.k_proj.weight"],
            sd[h + "self_attn.v_proj.weight"],
        )
        yield m + "self_attention.linear_qkv.weight", col(qkv)  # whole groups per rank
        yield (
            m + "self_attention.linear_qkv.layer_norm_weight",
            sd[h + "input_layernorm.weight"].clone(),
        )
        yield m + "self_attention.linear_proj.weight", row(sd[h + "self_attn.o_proj.weight"])
        gate, up = col(sd[h + "mlp.gate_proj.weight"]), col(sd[h + "mlp.up_proj.weight"])
        yield m + "mlp.linear_fc1.weight", torch.cat([gate, up])
        yield (
            m + "mlp.linear_fc1.layer_norm_weight",
            sd[h + "post_attention_layernorm.weight"].clone(),
        )
        yield m + "mlp.linear_fc2.weight", row(sd[h + "mlp.down_proj.weight"])
    yield P + "decoder.final_layernorm.weight", sd["model.norm.weight"].clone()
    yield P + "output_layer.weight", col(sd["lm_head.weight"])


def _partition(name: str) -> int | None:
    if name.endswith(
        ("linear_qkv.weight", "linear_fc1.weight", "word_embeddings.weight", "output_layer.weight")
    ):
        return 0
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    return None


def _gather(name: str, t: torch.Tensor, world: int) -> torch.Tensor:
    import torch.distributed as dist

    dim = _partition(name)
    if dim is None or world == 1:
        return t
    wide = t.float()  # gloo has no bf16; bf16 -> fp32 -> bf16 is exact
    parts = [torch.empty_like(wide) for _ in range(world)]
    dist.all_gather(parts, wide.contiguous())
    parts = [p.to(t.dtype) for p in parts]
    if name.endswith("linear_fc1.weight"):  # slime's GLU rechunk
        halves = [p.chunk(2, 0) for p in parts]
        parts = [h[0] for h in halves] + [h[1] for h in halves]
    return torch.cat(parts, dim)


def _to_hf(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    if name == P + "embedding.word_embeddings.weight":
        return [("model.embed_tokens.weight", t)]
    if name == P + "decoder.final_layernorm.weight":
        return [("model.norm.weight", t)]
    if name == P + "output_layer.weight":
        return [("lm_head.weight", t)]
    layer, rest = name.removeprefix(P + "decoder.layers.").split(".", 1)
    h = f"model.layers.{layer}."
    if rest == "self_attention.linear_qkv.weight":
        g = t.view(HEADS, 3 * HD, H)
        return [
            (h + "self_attn.q_proj.weight", g[:, :HD].reshape(-1, H).contiguous()),
            (h + "self_attn.k_proj.weight", g[:, HD : 2 * HD].reshape(-1, H).contiguous()),
            (h + "self_attn.v_proj.weight", g[:, 2 * HD :].reshape(-1, H).contiguous()),
        ]
    if rest == "mlp.linear_fc1.weight":
        gate, up = t.chunk(2, 0)
        return [
            (h + "mlp.gate_proj.weight", gate.contiguous()),
            (h + "mlp.up_proj.weight", up.contiguous()),
        ]
    simple = {
        "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
        "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
        "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
        "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    }
    return [(h + simple[rest], t)]


def convert(
    args: Any,
    model: Any,
    megatron_weights: Mapping[str, torch.Tensor],
    *,
    model_name: str,
    quantization_config: Any,
    rank: int,
    world_size: int,
) -> Iterable[tuple[str, torch.Tensor]]:
    """Gather, convert, and keep this rank's share (every rank runs every gather)."""
    assert model_name == "llama"
    out = []
    for i, name in enumerate(sorted(megatron_weights)):
        full = _gather(name, megatron_weights[name], world_size)
        if i % world_size == rank:
            out.extend(_to_hf(name, full))
    return out
