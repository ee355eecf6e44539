"""A version an inference server with tied word embeddings cannot hold.

A model whose ``config.json`` says ``"tie_word_embeddings": true`` is built by vLLM and SGLang
with ``lm_head`` sharing the input embedding's weight, and their loaders skip
``lm_head.weight``: whatever the checkpoint holds under that name, the server serves the
embedding's bytes for both. A trainer that unties them (a version in which ``lm_head.weight``
and the embedding differ) makes a version that such a server cannot hold, in place or after its
own full reload alike: applied, it would be confirmed and acknowledged while serving another
``lm_head``. :func:`untied_why` says so before anything is written.
"""

from __future__ import annotations

import json
from pathlib import Path

from asyncsync.format import Manifest

__all__ = ["untied_why"]

LM_HEAD = "lm_head.weight"
#: the input embedding's name in the HF checkpoints of the model families that tie
EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "embed_in.weight", "word_embeddings.weight")


def ties_embeddings(checkpoint: Path) -> bool:
    """Whether the checkpoint's ``config.json`` (or its ``text_config``) says it ties."""
    try:
        config = json.loads((checkpoint / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(config, dict):
        return False
    text = config.get("text_config")
    nested = text.get("tie_word_embeddings") if isinstance(text, dict) else None
    return config.get("tie_word_embeddings", nested) is True


def untied_why(checkpoint: Path, manifest: Manifest) -> str | None:
    """Why a server started from ``checkpoint`` cannot hold ``manifest``'s version: its config
    ties the embeddings and the version's ``lm_head.weight`` differs from its embedding (by
    checksum, both with one layout); None when it can, or when that cannot be told."""
    entries = manifest.tensor_map()
    head = entries.get(LM_HEAD)
    embeds = [e for n, e in entries.items() if n != LM_HEAD and n.endswith(EMBEDDINGS)]
    if head is None or len(embeds) != 1:
        return None
    embed = embeds[0]
    if head.layout != embed.layout:
        return None  # the checksums of two layouts say nothing about equal bytes
    if (head.dtype, head.shape, head.checksum) == (embed.dtype, embed.shape, embed.checksum):
        return None
    if not ties_embeddings(checkpoint):
        return None
    return (
        f"v{manifest.version}'s {LM_HEAD} differs from {embed.name}, but the server ties them "
        f"(tie_word_embeddings in {checkpoint / 'config.json'}): it would serve "
        f"{embed.name}'s bytes under both names, so it cannot hold v{manifest.version}. The "
        "trainer untied them: keep them tied there, or set tie_word_embeddings to false in the "
        "checkpoint's config.json and restart the server"
    )
