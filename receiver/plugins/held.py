"""What a model inside an engine holds, and verified reads of the receiver's checkpoint.

:class:`Held` is the base an in-engine apply checks before it XORs anything: the version
(number, run, fingerprint) and the checksum of every tensor, the checkpoint it came from. It is
set by a load of a clean checkpoint (:func:`checkpoint_snapshot`) and advanced by each in-place
apply of a stage (:meth:`Held.advanced`).

:func:`read_verified` reads tensors of a checkpoint and checks each against the checksum the
caller expects (the trainer's, from ``state.json`` or a stage): only verified bytes are handed
to an engine. Engine-agnostic; imports no engine.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import safetensors
import torch

from asyncsync.errors import AsyncSyncError
from asyncsync.format.checksum import layout_checksum, tensor_bytes
from asyncsync.format.names import SAFETENSORS_CODES, dtype_from_name
from asyncsync.fsio import read_bytes
from receiver.plugins.stage import Stage, VersionRef
from receiver.state import STATE_DIR_NAME, STATE_NAME, PersistedState

__all__ = [
    "INDEX_NAME",
    "CheckpointSnapshot",
    "Held",
    "Refused",
    "Unverified",
    "checkpoint_snapshot",
    "read_snapshot",
    "read_verified",
    "tensor_specs",
]

INDEX_NAME = "model.safetensors.index.json"
_ST_DTYPES = {code: name for name, code in SAFETENSORS_CODES.items()}  # -> format name


class Unverified(AsyncSyncError):
    """An asyncsync checkpoint that must not be handed to the engine (mid-apply, unreadable)."""


class Refused(AsyncSyncError):
    """Bytes that fail verification: nothing was loaded from them."""


@dataclass(frozen=True)
class CheckpointSnapshot:
    """What a clean asyncsync checkpoint holds: its version and every tensor's checksum."""

    directory: Path
    version: int
    run_id: str | None
    algorithm: str
    checksums: dict[str, str]
    weight_map: dict[str, str]  # tensor name -> file name
    parts: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # tensors in parts
    fingerprint: str | None = None


@dataclass(frozen=True)
class Held:
    """The weights a model holds: the version and the checksum of every tensor, and where the
    receiver's checkpoint is (for whole-tensor loads and audits). ``source``: how the model
    got them (``full``: a load of the checkpoint; ``stage``: an in-place apply)."""

    directory: Path
    version: VersionRef
    algorithm: str
    checksums: dict[str, str]
    parts: dict[str, list[tuple[int, int]]]
    weight_map: dict[str, str]
    source: str = "full"

    @classmethod
    def of(cls, snap: CheckpointSnapshot) -> Held:
        v = VersionRef(snap.version, snap.run_id, snap.fingerprint)
        return cls(snap.directory, v, snap.algorithm, snap.checksums, snap.parts, snap.weight_map)

    def advanced(self, stage: Stage) -> Held:
        """What the model holds after ``stage`` was applied on this base."""
        return replace(
            self,
            version=stage.target,
            algorithm=stage.algorithm,
            checksums=dict(stage.checksums),
            parts={**stage.parts},
            source="stage",
        )

    def why_not_base_of(self, stage: Stage, directory: Path) -> str | None:
        """Why ``stage`` must not be XORed onto these weights (None: it may)."""
        if self.directory != directory:
            return f"the model was loaded from {self.directory}, not {directory}"
        mine, base = self.version, stage.base
        # the fingerprint names the complete model state (FORMAT.md section 3): a zero-diff
        # version (relabelled in the engine, never loaded) has its base's fingerprint
        same = (
            (mine.run_id, mine.fingerprint) == (base.run_id, base.fingerprint)
            if mine.fingerprint is not None and base.fingerprint is not None
            else mine == base
        )
        if not same:
            return f"the model holds {mine}, the stage applies to {base}"
        if self.algorithm != stage.algorithm:
            return "the checksum algorithm changed"
        if self.checksums.keys() != stage.checksums.keys():
            return "the set of tensors changed"
        return None


def read_snapshot(directory: str | os.PathLike[str]) -> CheckpointSnapshot | None:
    """The snapshot of ``directory``, or None when it is not a clean asyncsync checkpoint."""
    try:
        return checkpoint_snapshot(directory)
    except Unverified:
        return None


def checkpoint_snapshot(directory: str | os.PathLike[str]) -> CheckpointSnapshot | None:
    """The snapshot of a clean asyncsync checkpoint; None when ``directory`` is not an asyncsync
    checkpoint at all (no ``.asyncsync/state.json``). Raises Unverified for one that is not
    clean."""
    d = Path(directory).resolve()
    if not (d / STATE_DIR_NAME / STATE_NAME).is_file():
        return None
    try:
        state = PersistedState.from_json(
            read_bytes(d / STATE_DIR_NAME / STATE_NAME, limit=256 << 20), where=str(d)
        )
        index = read_weight_map(d / INDEX_NAME)
    except (OSError, ValueError, AsyncSyncError) as exc:
        raise Unverified(f"{d} is an asyncsync checkpoint that cannot be read: {exc}") from exc
    if state.applying:
        raise Unverified(f"{d}: a version is being applied (not verified yet)")
    if state.redo:  # the files hold an older version: its receiver merges them when idle
        raise Unverified(
            f"{d}: {len(state.redo)} redo records (to v{state.head_version}) are not yet merged "
            f"into its files (at v{state.version})"
        )
    if state.version is None or state.checksum_algorithm is None:
        raise Unverified(f"{d}: no verified version yet")
    if set(state.checksums) != set(index):
        raise Unverified(f"{d}: the index and state.json name different tensors")
    return CheckpointSnapshot(
        d,
        state.version,
        state.run_id,
        state.checksum_algorithm,
        dict(state.checksums),
        index,
        dict(state.parts),
        state.fingerprint,
    )


def read_weight_map(path: Path) -> dict[str, str]:
    """The ``weight_map`` of an HF safetensors index (tensor names -> plain file names)."""
    index = json.loads(read_bytes(path, limit=256 << 20))
    wm = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wm, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and "/" not in v and v.endswith(".safetensors")
        for k, v in wm.items()
    ):
        raise ValueError(f"{path}: weight_map is missing or invalid")
    return dict(wm)


def read_verified(
    directory: Path,
    weight_map: Mapping[str, str],
    names: Iterable[str],
    checksums: Mapping[str, str],
    algorithm: str,
    parts: Mapping[str, list[tuple[int, int]]] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors ``names`` of the checkpoint in ``directory``, each in memory and verified
    against ``checksums``; raises Refused at the first that does not match."""
    by_file: dict[str, list[str]] = {}
    for n in names:
        file = weight_map.get(n)
        if file is None:
            raise Refused(f"{directory}: tensor {n!r} is not in the checkpoint's index")
        by_file.setdefault(file, []).append(n)
    for file, file_names in by_file.items():
        with safetensors.safe_open(str(directory / file), framework="pt") as f:
            for n in file_names:
                # a copy: safetensors maps the file, and the receiver patches its checkpoint in
                # place; the bytes verified must be the bytes loaded or compared
                t = f.get_tensor(n).clone()
                got = layout_checksum(
                    tensor_bytes(t), t.element_size(), (parts or {}).get(n), algorithm
                )
                if got != checksums[n]:
                    raise Refused(
                        f"{directory / file}: tensor {n!r} has checksum {got}, expected "
                        f"{checksums[n]} (changed or damaged on disk)"
                    )
                yield n, t


def tensor_specs(
    directory: Path, weight_map: Mapping[str, str]
) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """dtype and shape of every tensor of a checkpoint, from the safetensors headers only."""
    by_file: dict[str, list[str]] = {}
    for n, file in weight_map.items():
        by_file.setdefault(file, []).append(n)
    out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for file, file_names in by_file.items():
        with safetensors.safe_open(str(directory / file), framework="pt") as f:
            for n in file_names:
                sl: Any = f.get_slice(n)
                out[n] = (dtype_from_name(_ST_DTYPES[sl.get_dtype()]), tuple(sl.get_shape()))
    return out
