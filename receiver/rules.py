"""The rules every engine enforces before it changes anything, and the state a version it takes
leaves: :func:`check_base` (a delta or zero-diff version applies only on exactly its base
version of the same run), :func:`check_tensor_set` (it names exactly the tensors the engine
holds, with their dtypes and shapes), :func:`check_patch` (a codec patch fits its target
tensor's int view), so a refused version never leaves a half-written engine behind; and
:func:`holding` / :func:`bumped` (the :class:`~receiver.state.PersistedState` after a version).

Split out of :mod:`receiver.state` (the persisted state and its lock), which they stand on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from asyncsync.codec import Patch, native
from asyncsync.errors import ApplyFailed, ChecksumMismatch, IncompatibleVersion, OutOfOrder
from asyncsync.format import Manifest
from receiver.state import PersistedState

__all__ = [
    "bumped",
    "check_base",
    "check_patch",
    "check_tensor_set",
    "holding",
    "layouts_of",
]


def check_base(version: int | None, run_id: str | None, manifest: Manifest, where: str) -> None:
    """Raise OutOfOrder unless ``manifest`` applies on (``version``, ``run_id``) as a delta."""
    if version is None or manifest.base_version != version:
        raise OutOfOrder(
            f"{where}: v{manifest.version} applies on v{manifest.base_version}, "
            f"the engine holds v{version}"
        )
    if run_id is not None and manifest.run_id != run_id:
        raise OutOfOrder(
            f"{where}: v{manifest.version} is from run {manifest.run_id!r}, the engine holds "
            f"run {run_id!r}; jump to a keyframe"
        )


def check_tensor_set(
    held: Mapping[str, tuple[torch.dtype | None, tuple[int, ...]]], manifest: Manifest, where: str
) -> None:
    """Raise IncompatibleVersion unless a delta or zero-diff ``manifest`` names exactly the
    tensors of ``held`` (name -> dtype, shape: the version the engine holds).

    A version that dropped, added or reshaped a tensor is not a delta of the engine's version
    (a publisher sends a full version for that); taking it would leave an engine whose files
    and recorded state disagree, and that never opens again.
    """
    names = {e.name for e in manifest.tensors}
    missing, extra = sorted(set(held) - names), sorted(names - set(held))
    if missing or extra:
        raise IncompatibleVersion(
            f"{where}: v{manifest.version} is not a delta of the engine's tensors: "
            + "; ".join(
                f"{what} {len(ns)} (e.g. {ns[0]!r})"
                for what, ns in (("lacks", missing), ("adds", extra))
                if ns
            )
            + "; refused (a change of tensor set needs a full version)"
        )
    for e in manifest.tensors:
        dtype, shape = held[e.name]
        if dtype != e.torch_dtype or tuple(shape) != e.shape:
            raise IncompatibleVersion(
                f"{where}: tensor {e.name!r}: v{manifest.version} has {e.dtype}{list(e.shape)}, "
                f"the engine holds {dtype}{list(shape)}; refused (needs a full version)"
            )


def check_patch(
    patch: Patch, flat: torch.Tensor, name: str, *, kernels_check: bool = False
) -> Patch:
    """Validate ``patch`` against ``flat`` (the target's int view); return it on flat's device.

    Engines call this before journaling or writing anything, so a malformed patch is an
    ApplyFailed naming the tensor instead of a half-applied version. Positions must lie in
    the tensor and must not repeat (a repeated one would be undone to the value between its
    two writes).

    ``kernels_check``: the engine applies CPU patches only through the C kernels that check
    every position before they write it, and undoes what they wrote from values saved before
    (LocalCheckpoint): positions decoded from an xef blob then have only their ends checked
    here (the decoder checked every one: :meth:`~asyncsync.codec.Patch.decoded_xef`); a Patch
    made up or altered since has no blob vouched for and is checked in full.
    """
    values = _flat(patch.values)
    if patch.op not in ("set", "xor") or values.dtype != flat.dtype:
        raise ApplyFailed(
            f"tensor {name!r}: patch {patch.op!r} of {values.dtype} does not fit {flat.dtype}"
        )
    if patch.positions is None:
        if values.numel() != flat.numel():
            raise ApplyFailed(f"tensor {name!r}: dense patch of {values.numel()}/{flat.numel()}")
        return replace(patch, positions=None, values=values.to(flat.device))
    pos = _flat(patch.positions)
    if pos.dtype != torch.int64 or pos.numel() != values.numel():
        raise ApplyFailed(f"tensor {name!r}: positions must be int64, one per value")
    decoded = patch.decoded_xef() if kernels_check else None
    if pos.numel() and not _increasing_within(patch, pos, flat.numel(), decoded=decoded):
        lo, hi = torch.aminmax(pos)  # one pass, not two
        if int(lo) < 0 or int(hi) >= flat.numel():
            raise ApplyFailed(f"tensor {name!r}: patch positions outside 0..{flat.numel() - 1}")
        if (
            pos.numel() > 1
            and not bool((pos[1:] > pos[:-1]).all())
            and torch.unique(pos).numel() != pos.numel()
        ):
            raise ApplyFailed(f"tensor {name!r}: patch positions repeat")
    # the same positions: an xef blob they were decoded from still describes them
    if not (flat.is_cpu and pos.is_cpu and values.is_cpu):  # (.to costs ~2 us when a no-op)
        pos, values = pos.to(flat.device), values.to(flat.device)
    if pos is patch.positions and values is patch.values:
        return patch  # already flat and on flat's device (a decoded patch on CPU)
    return replace(patch, positions=pos, values=values)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t.detach().reshape(-1)``, or ``t`` itself where that is what it already is."""
    if t.dim() == 1 and not t.requires_grad:
        return t
    return t.detach().reshape(-1)


def _increasing_within(
    patch: Patch, pos: torch.Tensor, numel: int, *, decoded: bytes | memoryview | None
) -> bool:
    """Positions strictly increasing within ``[0, numel)`` (as decoded ones are), by the C
    kernel in one pass on this thread; False where it cannot tell (then aminmax checks).

    Positions on the CPU decoded from an xef blob (``decoded``, given where the engine's
    kernels check every position again before they write it) have only their ends checked."""
    k = native.kernels
    if k is None or not hasattr(k, "increasing") or pos.device.type != "cpu":
        return False
    if decoded is not None:  # (read through NumPy: a tensor's element costs ~3 us)
        # the decoder's array where pos is the patch's own tensor (a flattened view of it is not)
        arr = patch.arrays()[0] if pos is patch.positions else pos.numpy()
        return bool(arr[0] >= 0 and arr[-1] < numel)
    return bool(k.increasing(pos.contiguous().numpy(), 8, numel))


def layouts_of(manifest: Manifest) -> dict[str, list[tuple[int, int]]]:
    """The ``(offset, numel)`` parts of each tensor published in parts, as state records them
    (their checksums are composites: verifying one needs its layout)."""
    return {e.name: list(e.layout) for e in manifest.tensors if e.layout is not None}


def holding(ps: PersistedState, manifest: Manifest, **changes: Any) -> PersistedState:
    """``ps`` holding ``manifest``'s version: its identity and every tensor's checksum (any of
    them replaced by ``changes``)."""
    fields: dict[str, Any] = {
        "version": manifest.version,
        "run_id": manifest.run_id,
        "fingerprint": manifest.fingerprint,
        "checksum_algorithm": manifest.checksum_algorithm,
        "checksums": {e.name: e.checksum for e in manifest.tensors},
        "parts": layouts_of(manifest),
    }
    return replace(ps, **{**fields, **changes})


def bumped(ps: PersistedState, manifest: Manifest) -> PersistedState:
    """The state after taking the zero-diff ``manifest`` (no data changes, a new version).

    Raises ChecksumMismatch when the manifest claims bytes other than the ones held (a zero diff
    must carry the checksums of its base).
    """
    if ps.checksums and set(ps.checksums) != {e.name for e in manifest.tensors}:
        raise IncompatibleVersion(
            f"zero-diff v{manifest.version} names other tensors than v{ps.version} holds; "
            "refused (a change of tensor set needs a full version)"
        )
    if ps.checksum_algorithm == manifest.checksum_algorithm:
        for e in manifest.tensors:
            if ps.checksums.get(e.name, e.checksum) != e.checksum:
                raise ChecksumMismatch(
                    f"zero-diff v{manifest.version} says tensor {e.name!r} is {e.checksum} "
                    f"but v{ps.version} holds {ps.checksums[e.name]}",
                    tensor=e.name,
                )
    if manifest.tensors:
        return holding(ps, manifest)
    return holding(ps, manifest, checksums=ps.checksums, parts=ps.parts)  # lists no tensor
