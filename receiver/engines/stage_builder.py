"""Staging a delta version for an in-engine apply (receiver side, before the engine pauses).

The agent decodes each shard into :class:`~receiver.engines.base.TensorUpdate` patches; a
:class:`StageBuilder` turns them into the XOR values the engine applies
(:mod:`receiver.plugins.stage`) while the checkpoint is patched:

* an ``xor`` patch (the ``xef`` encoding) *is* the XOR: its positions and values go in as
  they are;
* a ``set`` patch (the other encodings: new values at positions) needs the old bytes, which
  the host-local checkpoint still holds before it is patched: ``old ^ new`` at those positions
  (:meth:`StageBuilder.add` must run before ``LocalCheckpoint.apply`` for the same updates).

Engine-agnostic: any engine whose plugin applies stages (SGLang; vLLM alike) uses it.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import numpy as np
import torch

from asyncsync.errors import ApplyFailed
from asyncsync.format import Manifest
from receiver.engines.base import EngineState, TensorUpdate
from receiver.engines.checkpoint import LocalCheckpoint, TensorLocation
from receiver.plugins.stage import STAGE_DIR, StageWriter, VersionRef, remove_stage
from receiver.rules import layouts_of
from receiver.state import STATE_DIR_NAME

__all__ = ["StageBuilder", "Staging", "clear_stages", "stage_dir_of"]

logger = logging.getLogger(__name__)


def stage_dir_of(checkpoint_dir: str | os.PathLike[str], version: int) -> Path:
    """Where the stage of ``version`` lives: ``<checkpoint>/.asyncsync/engine-stage/v<N>``
    (the engine plugin finds the checkpoint from this path)."""
    return Path(checkpoint_dir) / STATE_DIR_NAME / STAGE_DIR / f"v{version:012d}"


class StageBuilder:
    """The stage of one delta version (see the module docstring).

    Example::

        b = StageBuilder(checkpoint, manifest, base=engine.state)
        b.add(updates)                 # before checkpoint.apply(updates)
        ...
        path = b.commit()              # then the checkpoint commits, then the engine applies it
    """

    def __init__(self, checkpoint: LocalCheckpoint, manifest: Manifest, base: EngineState):
        if base.version is None:
            raise ApplyFailed("a stage needs the version the engine holds as its base")
        self.checkpoint = checkpoint
        self.manifest = manifest
        self.directory = stage_dir_of(checkpoint.directory, manifest.version)
        self.writer = StageWriter(
            self.directory,
            target=VersionRef(manifest.version, manifest.run_id, manifest.fingerprint),
            base=VersionRef(base.version, base.run_id, base.fingerprint),
            algorithm=manifest.checksum_algorithm,
        )
        self._layout: dict[str, TensorLocation] | None = None

    def __repr__(self) -> str:
        return f"<StageBuilder v{self.manifest.version} {self.writer!r}>"

    def add(self, updates: list[TensorUpdate]) -> None:
        """Stage the XOR of each update (blocking; before the checkpoint applies them)."""
        for u in updates:
            p = u.patch
            if p is None:
                raise ApplyFailed(f"tensor {u.entry.name!r}: a stage takes patches, not full data")
            values = p.values
            if p.op == "set":
                values = self._old(u, p.positions) ^ p.values
            elif p.op != "xor":
                raise ApplyFailed(f"tensor {u.entry.name!r}: unknown patch op {p.op!r}")
            self.writer.add(u.entry.name, u.entry.torch_dtype, u.entry.shape, p.positions, values)

    def _old(self, u: TensorUpdate, positions: torch.Tensor | None) -> torch.Tensor:
        """The checkpoint's current bytes of ``u``'s tensor at ``positions`` (int view)."""
        if self._layout is None:
            self._layout = self.checkpoint.files.load_layout()
        loc = self._layout.get(u.entry.name)
        if loc is None:
            raise ApplyFailed(f"tensor {u.entry.name!r} is not in {self.checkpoint.directory}")
        idt = loc.int_dtype
        numel = loc.nbytes // idt.itemsize
        mm = np.memmap(
            self.checkpoint.directory / loc.file,
            dtype=np.dtype(str(idt).removeprefix("torch.")).newbyteorder("<"),
            mode="r",
            offset=loc.begin,
            shape=(numel,),
        )
        try:
            old = mm if positions is None else mm[positions.numpy()]
            return torch.from_numpy(np.array(old, copy=True))
        finally:
            del mm

    def commit(self) -> Path:
        """Write the stage's record (last); returns its directory."""
        m = self.manifest
        return self.writer.commit({e.name: e.checksum for e in m.tensors}, layouts_of(m))

    def abort(self) -> None:
        self.writer.abort()


def clear_stages(checkpoint_dir: str | os.PathLike[str]) -> None:
    """Remove every stage (at open: a stage never outlives the receiver that wrote it)."""
    d = Path(checkpoint_dir) / STATE_DIR_NAME / STAGE_DIR
    if d.is_dir() and not d.is_symlink():
        for p in d.iterdir():
            try:
                remove_stage(p)
            except OSError as exc:
                logger.warning("cannot remove the stale stage %s: %s", p, exc)


class Staging:
    """The stage of the version an engine is applying, if any (async, for the engine). A
    failure to stage is logged, never raised: the version is then a reload of the checkpoint.
    """

    def __init__(self, kind: str):
        self.kind = kind
        self.builder: StageBuilder | None = None
        #: a cancelled begin's stage, still being made by its thread (removed at the next drop)
        self._building: asyncio.Future[StageBuilder] | None = None

    async def begin(self, checkpoint: LocalCheckpoint, m: Manifest, base: EngineState) -> None:
        await self.drop()
        loop = asyncio.get_running_loop()
        building = loop.run_in_executor(None, StageBuilder, checkpoint, m, base)
        try:
            self.builder = await asyncio.shield(building)
        except asyncio.CancelledError:  # its thread runs on and makes the stage's directory:
            self._building = building  # kept, so the drop (the abort that follows) removes it
            raise
        except (OSError, ApplyFailed) as exc:
            self._failed(m.version, exc)

    async def add(self, updates: list[TensorUpdate]) -> None:
        b = self.builder
        if b is not None:
            try:
                await asyncio.to_thread(b.add, updates)
            except (OSError, ApplyFailed, ValueError) as exc:
                self._failed(b.manifest.version, exc)
                await self.drop()

    async def commit(self) -> str | None:
        """The committed stage's directory name (None: no stage for this version)."""
        b = self.builder
        if b is None:
            return None
        try:
            await asyncio.to_thread(b.commit)
        except (OSError, ApplyFailed, ValueError) as exc:
            self._failed(b.manifest.version, exc)
            return None
        return b.directory.name

    async def drop(self) -> None:
        b, self.builder = self.builder, None
        if (building := self._building) is not None:
            try:  # a cancelled begin's thread: what it makes is removed once it is made
                b = await asyncio.shield(building)
            except (OSError, ApplyFailed):
                b = None  # nothing made (the begin's failure, which nobody waits for)
            self._building = None
        if b is not None:
            await asyncio.to_thread(b.abort)

    def _failed(self, version: int, exc: BaseException) -> None:
        logger.warning("%s: v%s will be a reload of the checkpoint, staging failed: %s",
                       self.kind, version, exc)  # fmt: skip
