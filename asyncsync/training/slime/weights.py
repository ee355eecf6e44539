"""What slime's getter gives, made publishable: Megatron shards -> HF-named tensors per rank.

slime's actor passes ``weights_getter=lambda: self.weights_backuper.get("actor")``: this rank's
tensor/pipeline/expert-parallel *shards* under Megatron's global names
(``module.module.decoder.layers.3.self_attention.linear_qkv.weight``). Engines load Hugging Face
names, unsharded. slime's own disk updaters gather the shards and convert the names
(``HfWeightIteratorDirect``: PP/EP broadcast, TP all-gather, ``convert_to_hf``); so does this
module, through a *converter*::

    converter(args, model, megatron_weights, *, model_name, quantization_config, rank, world_size)
        -> iterable of (hf_name, full tensor) this rank publishes

It is called on every rank at once (the gathers inside are collectives); the ranks' outputs
are disjoint and together the whole HF state dict, published as one version by the
multi-rank publisher. :func:`slime_converter` is slime's own conversion (used when slime is
importable); ``--asyncsync-converter pkg.module:function`` names another (e.g. for a trainer
shaped like slime without its Megatron code). Without either, names that look like Megatron's
are refused rather than published.

:func:`write_hf_view` lays a committed full version out as slime's ``weight_v{N:06d}/``
(hard links to its shards + ``model.safetensors.index.json`` + the ``--hf-checkpoint``'s
non-weight files), the directory slime's ``RayTrainGroup`` reloads engines from.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from asyncsync.errors import ConfigError
from asyncsync.format import Manifest

__all__ = [
    "Converter",
    "accepts",
    "hf_view_dir",
    "identity_converter",
    "looks_megatron",
    "resolve_converter",
    "slime_converter",
    "write_hf_view",
]

logger = logging.getLogger(__name__)

_HF_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".h5")


class Converter(Protocol):
    def __call__(
        self,
        args: argparse.Namespace,
        model: Any,
        megatron_weights: Mapping[str, torch.Tensor],
        *,
        model_name: str,
        quantization_config: Mapping[str, Any] | None,
        rank: int,
        world_size: int,
    ) -> Iterable[tuple[str, torch.Tensor]]: ...


def looks_megatron(names: Iterable[str]) -> bool:
    """Whether tensor names are Megatron's (slime's getter) rather than Hugging Face's."""
    return any(
        n.startswith(("module.", "vp_stages.")) or ".decoder.layers." in n or ".linear_qkv." in n
        for n in names
    )


def identity_converter(
    args: argparse.Namespace,
    model: Any,
    megatron_weights: Mapping[str, torch.Tensor],
    *,
    model_name: str,
    quantization_config: Mapping[str, Any] | None,
    rank: int,
    world_size: int,
) -> Iterable[tuple[str, torch.Tensor]]:
    """The getter's tensors as they are (HF-named, complete): for getters that already convert.
    Megatron-looking names are refused (they would not load in an engine)."""
    if looks_megatron(megatron_weights):
        example = next(n for n in megatron_weights if looks_megatron([n]))
        raise ConfigError(
            f"weights_getter() gave Megatron-named shards (e.g. {example!r}), which engines "
            "cannot load: install slime where the trainer runs (its Megatron-to-HF conversion "
            "is used), or pass --asyncsync-converter pkg.module:function (see "
            "asyncsync.training.slime.weights)"
        )
    return megatron_weights.items()


def slime_converter(
    args: argparse.Namespace,
    model: Any,
    megatron_weights: Mapping[str, torch.Tensor],
    *,
    model_name: str,
    quantization_config: Mapping[str, Any] | None,
    rank: int,
    world_size: int,
) -> Iterable[tuple[str, torch.Tensor]]:
    """slime's own gather and conversion (what its full disk updater writes), chunk ``i`` kept
    by rank ``i % world_size``: every rank joins every gather, each keeps only its chunks.

    Only the parameters the installed slime accepts are passed: ``transform_ue8m0=False``
    (what slime's disk saver passes) where ``HfWeightIteratorBase`` takes it (2fa9a442f,
    2026-08-14, and later), ``should_convert_chunk`` (each rank converts only its chunks) where
    ``get_hf_weight_chunks`` takes it (6d485c423, 2026-07-19, and later); before, every rank
    converts every chunk and drops the others'.
    """
    from slime.backends.megatron_utils.update_weight.hf_weight_iterator_direct import (
        HfWeightIteratorDirect,
    )

    if getattr(args, "megatron_to_hf_mode", "raw") == "bridge":
        logger.warning(
            "--megatron-to-hf-mode bridge: asyncsync's default converter uses slime's raw "
            "conversion (HfWeightIteratorDirect), where slime's disk saver uses Megatron Bridge; "
            "pass --asyncsync-converter to convert otherwise"
        )
    init: dict[str, Any] = {
        "args": args,
        "model": model,
        "model_name": model_name,
        "quantization_config": quantization_config,
    }
    if accepts(HfWeightIteratorDirect, "transform_ue8m0"):
        init["transform_ue8m0"] = False
    iterator = HfWeightIteratorDirect(**init)
    mine: Callable[[int], bool] = lambda i: i % world_size == rank  # noqa: E731
    chunks_kw: dict[str, Any] = {"progress_desc": "asyncsync: gather"}
    if accepts(iterator.get_hf_weight_chunks, "should_convert_chunk"):
        chunks_kw["should_convert_chunk"] = mine
    for idx, chunk in enumerate(iterator.get_hf_weight_chunks(dict(megatron_weights), **chunks_kw)):
        if mine(idx):
            yield from chunk


def accepts(fn: Any, name: str) -> bool:
    """Whether calling ``fn`` (a function, or a class: its ``__init__``) accepts the keyword
    ``name``. A class's ``__init__(*args, **kwargs)`` that passes everything on is looked
    through to the next ``__init__`` of its bases (slime's ``HfWeightIteratorDirect``)."""
    if isinstance(fn, type):
        chain = [vars(k)["__init__"] for k in fn.__mro__ if "__init__" in vars(k)]
    else:
        chain = [fn]
    for f in chain:
        try:
            params = list(inspect.signature(f).parameters.values())
        except (TypeError, ValueError):
            return False
        named = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        if named - {"self"}:
            return name in named
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            return False  # takes nothing
    return False


def _slime_importable() -> bool:
    try:
        import slime.backends.megatron_utils.update_weight.hf_weight_iterator_direct  # noqa: F401
    except Exception:  # ImportError, or slime's own imports failing without Megatron
        return False
    return True


def resolve_converter(path: str | None) -> Converter:
    """The converter ``path`` names (``pkg.module:function``), else slime's when importable,
    else :func:`identity_converter`."""
    if path:
        from asyncsync.publish.hooks import resolve_callable

        return resolve_callable(path, what="--asyncsync-converter")
    return slime_converter if _slime_importable() else identity_converter


# ---------------------------------------------------------------------------------- weight_v


def hf_view_dir(disk_dir: str | os.PathLike[str], weight_version: int) -> Path:
    """slime's directory of a full version: ``<disk_dir>/weight_v{N:06d}``."""
    return Path(disk_dir) / f"weight_v{weight_version:06d}"


def write_hf_view(
    version_path: Path, manifest: Manifest, dest: Path, *, assets_from: str | None = None
) -> Path:
    """Lay the committed full version at ``version_path`` out as an HF checkpoint at ``dest``.

    The shards are hard-linked (copied where links are not possible), renamed
    ``model-0000i-of-0000n.safetensors``; ``model.safetensors.index.json`` is written last
    (slime's completion marker); non-weight files of ``assets_from`` (config, tokenizer) are
    copied, as slime's checkpoint saver does. An existing ``dest`` is replaced.
    """
    if manifest.kind != "full" or any(t.full is None for t in manifest.tensors):
        raise ConfigError(f"v{manifest.version} is not a full version: no HF view of it")
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    full = [s for s in manifest.shards if s.role == "full"]
    names = {}
    for i, shard in enumerate(full, start=1):
        target = dest / f"model-{i:05d}-of-{len(full):05d}.safetensors"
        src = manifest.shard_path(version_path, shard)
        try:
            os.link(src, target)
        except OSError:
            shutil.copyfile(src, target)
        names[shard.file] = target.name
    weight_map = {}
    for t in manifest.tensors:
        assert t.full is not None
        weight_map[t.full.key] = names[manifest.shards[t.full.shard].file]
    if assets_from and Path(assets_from).is_dir():
        for item in Path(assets_from).iterdir():
            if item.is_file() and not _is_weight_file(item.name):
                shutil.copy2(item, dest / item.name)
    index = {
        "metadata": {
            "total_size": sum(s.bytes for s in full),
            "asyncsync_version": manifest.version,
        },
        "weight_map": weight_map,
    }
    tmp = dest / "model.safetensors.index.json.tmp"
    tmp.write_text(json.dumps(index, indent=2))
    os.replace(tmp, dest / "model.safetensors.index.json")
    return dest


def _is_weight_file(name: str) -> bool:
    return name.endswith(".index.json") or name.endswith(_HF_WEIGHT_SUFFIXES)
