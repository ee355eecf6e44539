"""LocalCheckpoint: a Hugging Face safetensors directory kept at the newest version, in place.

The directory is what ``from_pretrained`` / vLLM / SGLang load::

    DIR/
      model-00001-of-00003.safetensors ...   the weights (names = state-dict keys)
      model.safetensors.index.json           {"metadata": {"total_size", "asyncsync_version"},
                                              "weight_map": {name: file}}
      .asyncsync/                            receiver.state: state.json, lock, journal/, staging/

Why in place: a delta touches a small fraction of the bytes, so rewriting multi-GB files per
version would cost far more than the delta. Each tensor sits at a fixed byte range of its file
(parsed from the safetensors header), so a delta is applied through ``mmap`` on those ranges.

Crash safety (``kill -9`` at any instant leaves a state the next ``open`` repairs):

* delta: before the first in-place write of a version, ``state.json`` says ``applying``; before
  each ``apply`` writes, an undo journal file with the OLD values of every position it will
  write is durable in ``.asyncsync/journal/``. Undo just writes old values back, so it is
  idempotent: ``abort``, a failed checksum in ``commit`` and ``open`` after a crash all run it,
  as often as needed, and the checkpoint is back at the old version bit for bit.
* durability after the ack (default): a delta commits once every touched tensor's bytes match
  the manifest's checksums *in the page cache*; ``state.json`` then says ``clean`` at the new
  version with ``synced: false`` and the receiver acknowledges it; then (``acknowledged``)
  ``msync``/``fsync`` of the data files run in the background (the next ``begin`` waits for
  them), and ``synced`` becomes true. The flush is the largest single cost of an apply (a 3 %
  delta dirties every page of a bf16 tensor), so this takes it off the version's latency. A
  process crash loses nothing (the page cache survives it); if the machine itself fails
  before the flush, ``open`` finds ``synced: false``, re-checks every tensor against the
  recorded checksums and, if any differs, removes the data files so the receiver
  re-initialises from the newest keyframe. ``sync_before_ack=True`` flushes before the
  commit instead.
* full: new files are written to ``.asyncsync/staging/`` and verified; only then is the state
  marked ``applying`` and the files moved into place. A crash in that window leaves old and
  new files mixed, so ``open`` removes the data files and reports no version: the receiver
  re-initialises the directory from a keyframe.

Blocking file work runs in ``asyncio.to_thread`` so the receiver's event loop stays free.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import mmap
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, TypeVar

import safetensors
import safetensors.torch
import torch

from asyncsync import fsio
from asyncsync.checksum import entry_checksum, new_hasher
from asyncsync.codec import Patch, apply_patch
from asyncsync.errors import (
    ApplyFailed,
    AsyncSyncError,
    ChecksumMismatch,
    ConfigError,
    EngineStateError,
)
from asyncsync.format import Manifest, TensorEntry
from receiver.engines import journal
from receiver.engines.base import Engine, EngineState, TensorUpdate
from receiver.engines.st_layout import FileMaps, TensorLocation, read_layout
from receiver.state import (
    STATE_DIR_NAME,
    STATE_NAME,
    PersistedState,
    StateStore,
    bumped,
    check_base,
    check_patch,
    layouts_of,
)

__all__ = ["LocalCheckpoint", "TensorLocation", "read_layout", "verify_checkpoint"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


@dataclass
class _Txn:
    """The version being applied between begin and commit/abort."""

    manifest: Manifest
    mode: Literal["delta", "full"]
    entries: dict[str, TensorEntry]
    seen: set[str] = field(default_factory=set)
    staged: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (part, checksum)
    parts: list[str] = field(default_factory=list)
    maps: FileMaps | None = None
    seq: int = 0


# --------------------------------------------------------------------------- the engine


class LocalCheckpoint(Engine):
    """A safetensors checkpoint directory patched in place (see the module docstring)."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        file_prefix: str = "model",
        sync_before_ack: bool = False,
    ):
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,100}", file_prefix):
            raise ConfigError(
                f"invalid file_prefix {file_prefix!r}: use [A-Za-z0-9][A-Za-z0-9._-]*"
            )
        self.directory = Path(directory)
        self.file_prefix = file_prefix
        self.index_path = self.directory / f"{file_prefix}.safetensors.index.json"
        self._data_re = re.compile(
            rf"^{re.escape(file_prefix)}(-\d{{5}}-of-\d{{5}})?\.safetensors$"
        )
        self._store = StateStore(self.directory / STATE_DIR_NAME)
        self._ps = PersistedState()
        self._layout: dict[str, TensorLocation] = {}
        self._txn: _Txn | None = None
        self._broken: str | None = None
        self._mutex = threading.Lock()
        self.sync_before_ack = sync_before_ack
        self._flushing: asyncio.Future[None] | None = None  # the last delta's background sync
        self._unflushed: tuple[FileMaps, int] | None = None  # committed, flush not yet started
        self.state = EngineState()

    def __repr__(self) -> str:
        return f"<LocalCheckpoint {self.directory} version={self.state.version}>"

    # -- public coroutines ----------------------------------------------------------------
    async def open(self) -> EngineState:
        return await self._run(self._open)

    async def close(self) -> None:
        if self._txn is not None:
            await self.abort()
        await self.flushed()
        self._store.close()

    async def begin(self, manifest: Manifest, mode: Literal["delta", "full"]) -> None:
        await self.flushed()
        await self._run(self._begin, manifest, mode)

    async def flushed(self) -> None:
        """Wait until the last committed delta is durable (a no-op with sync_before_ack);
        start its flush first if nobody called :meth:`acknowledged`."""
        await self.acknowledged()
        pending, self._flushing = self._flushing, None
        if pending is not None:
            with contextlib.suppress(AsyncSyncError):  # logged; the engine is marked broken
                await pending

    async def apply(self, updates: list[TensorUpdate]) -> None:
        txn = self._need_txn()
        if txn.mode == "delta":
            await self._run(self._apply_delta, txn, updates)
        else:
            await self._run(self._apply_full, txn, updates)

    async def commit(self) -> str:
        txn = self._need_txn()
        if txn.mode == "full":
            return await self._run(self._commit_full, txn)
        fingerprint = await self._run(self._commit_delta, txn)
        if not self.sync_before_ack:
            assert txn.maps is not None
            self._unflushed = (txn.maps, txn.manifest.version)
        return fingerprint

    async def acknowledged(self) -> None:
        """Start flushing the delta just committed (in the background): after the ack, so the
        ack's own small write is not queued behind the flush on the same disk."""
        if self._unflushed is not None and self._flushing is None:
            maps, version = self._unflushed
            self._unflushed = None
            self._flushing = asyncio.ensure_future(self._run(self._make_durable, maps, version))

    async def abort(self) -> None:
        await self._run(self._abort)

    async def bump(self, manifest: Manifest) -> None:
        await self.flushed()
        await self._run(self._bump, manifest)

    # -- read-only helpers -----------------------------------------------------------------
    def tensor_names(self) -> list[str]:
        """Names of the tensors in the checkpoint, in index order (none before the first)."""
        return list(self._read_index()[1]) if self.index_path.exists() else []

    def load_state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor of the checkpoint, copied into memory (later deltas do not alter it)."""
        if not self.index_path.exists():
            return {}
        weight_map = self._read_index()[1]
        out: dict[str, torch.Tensor] = {}
        for file in dict.fromkeys(weight_map.values()):
            out.update(safetensors.torch.load_file(self.directory / file))
        return {name: out[name].clone() for name in weight_map}  # load_file maps the file

    # -- plumbing -----------------------------------------------------------------------------
    async def _run(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run blocking work in a thread, one at a time even if a caller was cancelled."""

        def locked() -> _T:
            with self._mutex:
                return fn(*args)

        try:
            return await asyncio.to_thread(locked)
        except AsyncSyncError:
            raise
        except (OSError, RuntimeError, ValueError, safetensors.SafetensorError) as exc:
            raise ApplyFailed(f"{self.directory}: {type(exc).__name__}: {exc}") from exc

    def _need_txn(self) -> _Txn:
        if self._txn is None:
            raise ApplyFailed(f"{self.directory}: apply/commit without begin")
        return self._txn

    def _set(self, ps: PersistedState) -> None:
        self._ps = self._store.save(ps)
        self.state = EngineState(ps.version, ps.run_id, ps.fingerprint)

    def _data_files(self) -> list[Path]:
        return sorted(p for p in self.directory.iterdir() if self._data_re.match(p.name))

    def _read_index(self) -> tuple[dict[str, Any], dict[str, str]]:
        try:
            index = json.loads(self.index_path.read_bytes())
        except (OSError, ValueError) as exc:
            raise EngineStateError(f"cannot read {self.index_path}: {exc}") from exc
        wm = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wm, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and self._data_re.match(v)
            for k, v in wm.items()
        ):
            raise EngineStateError(f"{self.index_path}: weight_map is missing or invalid")
        return index, wm

    def _load_layout(self) -> dict[str, TensorLocation]:
        _, weight_map = self._read_index()
        per_file = {f: read_layout(self.directory / f) for f in dict.fromkeys(weight_map.values())}
        layout = {}
        for name, file in weight_map.items():
            if name not in per_file[file]:
                raise EngineStateError(f"{self.index_path}: {name!r} is not in {file}")
            layout[name] = per_file[file][name]
        return layout

    def _write_index(
        self, version: int, weight_map: dict[str, str] | None = None, total: int = 0
    ) -> None:
        """Write the HF index atomically (default: the current layout, only the version new)."""
        if weight_map is None:
            weight_map = {n: loc.file for n, loc in self._layout.items()}
            total = sum(loc.nbytes for loc in self._layout.values())
        index = {
            "metadata": {"total_size": total, "asyncsync_version": version},
            "weight_map": weight_map,
        }
        fsio.atomic_write(self.index_path, (json.dumps(index, indent=2) + "\n").encode())

    # -- open / recovery ------------------------------------------------------------------
    def _open(self) -> EngineState:
        if self._store.locked:
            return self.state
        self.directory.mkdir(parents=True, exist_ok=True)
        if not (self._store.directory / STATE_NAME).exists():
            self._refuse_foreign()
        ps = self._store.open()
        try:
            if ps is None:
                self._refuse_foreign()
                ps = PersistedState()
            self._ps = ps
            for d in (self._store.journal_dir, self._store.staging_dir):
                d.mkdir(exist_ok=True)
            if ps.applying and ps.mode == "delta":
                logger.warning(
                    "%s: interrupted delta to v%s; undoing", self.directory, ps.target_version
                )
                self._layout = self._load_layout()
                maps = FileMaps(self.directory)
                try:
                    self._undo(maps)
                finally:
                    maps.close()
            elif ps.applying:
                logger.warning(
                    "%s: interrupted full apply of v%s; the files are mixed, removing them so "
                    "the receiver re-initialises from a keyframe",
                    self.directory,
                    ps.target_version,
                )
                self._wipe()
            else:
                self._store.clear_dir(self._store.journal_dir)  # stale: a commit that finished
                self._store.clear_dir(self._store.staging_dir)
            if not self._ps.synced and self._ps.version is not None:
                self._check_unsynced()
            self._set(self._ps)
            if self._ps.version is not None:
                self._layout = self._load_layout()
                if self._ps.checksums and set(self._ps.checksums) != set(self._layout):
                    raise EngineStateError(
                        f"{self.directory}: the tensors in the files differ from state.json; "
                        "remove the directory to re-initialise from the newest keyframe"
                    )
            elif self._data_files():
                logger.warning("%s: holds no version but has data files", self.directory)
        except BaseException:
            self._store.close()
            raise
        logger.info("%s: open at version %s", self.directory, self.state.version)
        return self.state

    def _check_unsynced(self) -> None:
        """The held version was committed before it was durable and the receiver stopped: if
        the machine went down, some of its pages may be lost. Keep it if every tensor still
        matches, else wipe (the receiver re-initialises from a keyframe)."""
        ps = self._ps
        self._layout = self._load_layout()
        maps = FileMaps(self.directory)
        try:
            bad = [
                name
                for name, loc in self._layout.items()
                if ps.checksum_algorithm is None
                or maps.checksum(loc, ps.checksum_algorithm, ps.parts.get(name))
                != ps.checksums.get(name)
            ]
        finally:
            maps.close()
        if bad:
            logger.warning(
                "%s: v%s was committed but not yet durable when the receiver stopped, and "
                "%d tensors (e.g. %r) no longer match it; removing the files so the receiver "
                "re-initialises from a keyframe",
                self.directory, ps.version, len(bad), bad[0],
            )  # fmt: skip
            self._wipe()
            return
        self._fsync_data_files()
        self._ps = replace(ps, synced=True)
        logger.info("%s: v%s verified and made durable after a restart", self.directory, ps.version)

    def _fsync_data_files(self) -> None:
        """fsync every data file: dirty pages of any version, whoever wrote them, reach disk."""
        for p in self._data_files():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def _refuse_foreign(self) -> None:
        if self.index_path.exists() or any(
            p.name.endswith(".safetensors") for p in self.directory.iterdir()
        ):
            raise EngineStateError(
                f"{self.directory} holds safetensors files but is not an asyncsync checkpoint "
                f"(no {STATE_DIR_NAME}/{STATE_NAME}); point the receiver at an empty directory"
            )

    def _wipe(self) -> None:
        """Forget everything: remove data files, index and staging; state holds no version."""
        for p in self._data_files():
            p.unlink()
        with contextlib.suppress(FileNotFoundError):
            self.index_path.unlink()
        fsio.fsync_dir(self.directory)
        self._store.clear_dir(self._store.staging_dir)
        self._store.clear_dir(self._store.journal_dir)
        self._layout = {}
        self._set(PersistedState())

    # -- begin --------------------------------------------------------------------------------
    def _begin(self, manifest: Manifest, mode: Literal["delta", "full"]) -> None:
        if not self._store.locked:
            raise ApplyFailed(f"{self.directory}: begin before open")
        if self._broken:
            raise EngineStateError(f"{self.directory}: {self._broken}; close and reopen it")
        if self._txn is not None:
            raise ApplyFailed(
                f"{self.directory}: begin v{manifest.version} while v"
                f"{self._txn.manifest.version} is in progress; commit or abort it first"
            )
        entries = manifest.tensor_map()
        txn = _Txn(manifest, mode, entries)
        if mode == "full":
            self._store.clear_dir(self._store.staging_dir)
            self._txn = txn
            return
        if mode != "delta":
            raise ApplyFailed(f"unknown apply mode {mode!r}")
        check_base(self.state.version, self.state.run_id, manifest, str(self.directory))
        for name, e in entries.items():
            loc = self._layout.get(name)
            if loc is None:
                raise ApplyFailed(
                    f"tensor {name!r} of v{manifest.version} is not in the checkpoint"
                )
            if loc.dtype != e.torch_dtype or loc.shape != e.shape:
                raise ApplyFailed(
                    f"tensor {name!r}: v{manifest.version} has {e.dtype}{list(e.shape)}, the "
                    f"checkpoint has {loc.dtype}{list(loc.shape)}"
                )
        extra = set(self._layout) - set(entries)
        if extra:
            logger.warning("%s: tensors not in v%s: %s", self.directory, manifest.version, extra)
        self._store.clear_dir(self._store.journal_dir)
        self._set(self._ps.begin(manifest.version, "delta"))
        txn.maps = FileMaps(self.directory)
        self._txn = txn

    def _claim(self, txn: _Txn, u: TensorUpdate) -> TensorEntry:
        """The manifest entry of an update; refuses strangers, repeats and changed shapes."""
        name = u.entry.name
        entry = txn.entries.get(name)
        if entry is None:
            raise ApplyFailed(f"tensor {name!r} is not in v{txn.manifest.version}")
        if name in txn.seen:
            raise ApplyFailed(f"tensor {name!r} updated twice in v{txn.manifest.version}")
        if (u.entry.dtype, u.entry.shape) != (entry.dtype, entry.shape):
            raise ApplyFailed(f"tensor {name!r}: update does not match the manifest entry")
        txn.seen.add(name)
        return entry

    # -- delta ------------------------------------------------------------------------------
    def _apply_delta(self, txn: _Txn, updates: list[TensorUpdate]) -> None:
        """Journal the old bytes of every position the updates write (durably), then patch."""
        assert txn.maps is not None
        work: list[tuple[str, TensorLocation, torch.Tensor, Patch]] = []
        for u in updates:
            entry = self._claim(txn, u)
            if u.patch is None:
                raise ApplyFailed(f"tensor {entry.name!r}: a delta needs a patch, not full data")
            loc = self._layout[entry.name]
            flat = txn.maps.flat(loc)
            work.append((entry.name, loc, flat, check_patch(u.patch, flat, entry.name)))
        if not work:
            return
        for _name, loc, _flat, patch in work:
            if _touches_most_pages(patch, loc):
                txn.maps.prefault(loc)
        path = self._store.journal_dir / f"undo-{txn.seq:06d}.safetensors"
        txn.seq += 1
        fsio.atomic_write(path, journal.encode(work, txn.manifest.version))
        for _name, _loc, flat, patch in work:
            apply_patch(flat, patch)

    def _undo(self, maps: FileMaps) -> None:
        """Write back the old values of every journal file (newest first), sync, state clean."""
        for path in sorted(self._store.journal_dir.glob("undo-*.safetensors"), reverse=True):
            try:
                records = journal.read(path)
            except Exception as exc:
                raise EngineStateError(f"undo journal {path} is unreadable: {exc}") from exc
            for name, pos, old in records:
                loc = self._layout.get(name)
                if loc is None:
                    raise EngineStateError(f"undo journal {path} names unknown tensor {name!r}")
                flat = maps.flat(loc)
                old = old.view(flat.dtype)
                if pos is None:
                    flat.copy_(old)
                elif pos.numel():
                    flat.index_copy_(0, pos, old)
                del flat
        maps.sync()
        self._set(self._ps.clean())
        self._store.clear_dir(self._store.journal_dir)

    def _commit_delta(self, txn: _Txn) -> str:
        assert txn.maps is not None
        m = txn.manifest
        try:
            if self.sync_before_ack:
                txn.maps.sync()
            bad = self._first_mismatch(txn)
            if bad is None:
                self._set(
                    replace(
                        self._ps.clean(),
                        version=m.version,
                        run_id=m.run_id,
                        fingerprint=m.fingerprint,
                        checksum_algorithm=m.checksum_algorithm,
                        checksums={e.name: e.checksum for e in m.tensors},
                        parts=layouts_of(m),
                        synced=self.sync_before_ack,
                    )
                )
        except BaseException:
            self._rollback(txn)
            raise
        if bad is not None:
            name, got = bad
            path = str(self.directory / self._layout[name].file)
            self._rollback(txn)
            raise ChecksumMismatch(
                f"tensor {name!r} of v{m.version} in {path}: checksum {got} != "
                f"{txn.entries[name].checksum}; rolled back to v{self.state.version}",
                path=path,
                tensor=name,
            )
        self._txn = None
        if self.sync_before_ack:
            txn.maps.close()
        self._after_commit(m.version)
        logger.info("%s: committed delta v%s", self.directory, m.version)
        return m.fingerprint

    def _make_durable(self, maps: FileMaps, version: int) -> None:
        """Background, after the commit: flush the data files, then record ``synced``."""
        try:
            maps.sync()
            self._fsync_data_files()  # also pages an interrupted earlier flush left dirty
            if self._ps.version == version:  # begin and bump wait for this: nothing came between
                self._set(replace(self._ps, synced=True))
        except BaseException as exc:
            self._broken = f"making v{version} durable failed ({exc})"
            logger.error("%s: %s", self.directory, self._broken)
            raise
        finally:
            maps.close()

    def _first_mismatch(self, txn: _Txn) -> tuple[str, str] | None:
        """(name, checksum) of the first tensor whose new bytes differ from the manifest.

        Touched tensors and those the manifest says changed are hashed from the file; the
        others are compared by their recorded checksum when the algorithm is the same.
        """
        assert txn.maps is not None
        algo = txn.manifest.checksum_algorithm
        same_algo = self._ps.checksum_algorithm == algo
        for name, e in txn.entries.items():
            if name in txn.seen or e.changed > 0:
                got = txn.maps.checksum(self._layout[name], algo, e.layout)
            elif same_algo:
                got = self._ps.checksums.get(name, e.checksum)
            else:
                continue
            if got != e.checksum:
                return name, got
        return None

    def _rollback(self, txn: _Txn) -> None:
        self._txn = None
        if txn.maps is None:
            return
        try:
            self._undo(txn.maps)
        except BaseException as exc:
            self._broken = f"rollback of v{txn.manifest.version} failed ({exc})"
            raise
        finally:
            txn.maps.close()

    # -- full ---------------------------------------------------------------------------------
    def _apply_full(self, txn: _Txn, updates: list[TensorUpdate]) -> None:
        algo = txn.manifest.checksum_algorithm
        tensors: dict[str, torch.Tensor] = {}
        sums: dict[str, str] = {}
        ptrs: set[int] = set()
        for u in updates:
            entry = self._claim(txn, u)
            t = u.full
            if t is None:
                raise ApplyFailed(f"tensor {entry.name!r}: full mode needs full data, not a patch")
            if t.dtype != entry.torch_dtype or tuple(t.shape) != entry.shape:
                raise ApplyFailed(
                    f"tensor {entry.name!r}: got {t.dtype}{list(t.shape)}, manifest says "
                    f"{entry.dtype}{list(entry.shape)}"
                )
            t = t.detach().cpu().contiguous()
            ptr = t.untyped_storage().data_ptr()
            if t.numel() and ptr in ptrs:  # safetensors refuses shared storage
                t = t.clone()
            ptrs.add(ptr)
            tensors[entry.name] = t
            sums[entry.name] = entry_checksum(entry, t, algo)
        if not tensors:
            return
        part = f"part-{txn.seq:06d}.safetensors"
        txn.seq += 1
        path = self._store.staging_dir / part
        safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        txn.parts.append(part)
        txn.staged.update({n: (part, s) for n, s in sums.items()})

    def _commit_full(self, txn: _Txn) -> str:
        m, staging = txn.manifest, self._store.staging_dir
        self._txn = None
        try:
            for name, e in txn.entries.items():
                if name not in txn.staged:
                    raise ApplyFailed(f"v{m.version}: tensor {name!r} never arrived")
                part, got = txn.staged[name]
                if got != e.checksum:
                    raise ChecksumMismatch(
                        f"tensor {name!r} of v{m.version}: checksum {got} != {e.checksum}; "
                        f"v{m.version} discarded, still at v{self.state.version}",
                        path=str(staging / part),
                        tensor=name,
                    )
            fsio.fsync_dir(staging)
        except BaseException:
            self._store.clear_dir(staging)
            raise
        n = len(txn.parts)
        final = {
            p: f"{self.file_prefix}-{k:05d}-of-{n:05d}.safetensors"
            for k, p in enumerate(txn.parts, 1)
        }
        weight_map = {name: final[part] for name, (part, _) in txn.staged.items()}
        try:
            self._set(self._ps.begin(m.version, "full"))
            old = set(self._data_files())
            for part, name in final.items():
                os.replace(staging / part, self.directory / name)
            self._write_index(m.version, weight_map, sum(e.nbytes for e in m.tensors))
            for p in old - {self.directory / name for name in final.values()}:
                p.unlink()
            fsio.fsync_dir(self.directory)
            self._set(
                PersistedState(
                    version=m.version,
                    run_id=m.run_id,
                    fingerprint=m.fingerprint,
                    checksum_algorithm=m.checksum_algorithm,
                    checksums={e.name: e.checksum for e in m.tensors},
                    parts=layouts_of(m),
                )
            )
            self._layout = self._load_layout()
        except BaseException as exc:
            logger.error("%s: full apply of v%s failed midway (%s)", self.directory, m.version, exc)
            with contextlib.suppress(OSError, AsyncSyncError):
                self._wipe()
            raise ApplyFailed(
                f"{self.directory}: moving v{m.version} into place failed ({exc}); the files "
                "were removed, the receiver re-initialises from a keyframe"
            ) from exc
        logger.info("%s: committed full v%s (%d files)", self.directory, m.version, n)
        return m.fingerprint

    # -- abort / bump -------------------------------------------------------------------------
    def _abort(self) -> None:
        txn = self._txn
        if txn is None:
            return
        if txn.mode == "delta":
            self._rollback(txn)
        else:
            self._txn = None
            self._store.clear_dir(self._store.staging_dir)
        logger.info("%s: aborted v%s", self.directory, txn.manifest.version)

    def _bump(self, manifest: Manifest) -> None:
        if self._txn is not None:
            raise ApplyFailed(f"{self.directory}: bump while v{self._txn.manifest.version} is open")
        check_base(self.state.version, self.state.run_id, manifest, str(self.directory))
        self._set(bumped(self._ps, manifest))
        self._after_commit(manifest.version)

    def _after_commit(self, version: int) -> None:
        """Housekeeping once state.json holds ``version``: never fails the committed version."""
        try:
            self._store.clear_dir(self._store.journal_dir)  # also cleared by open and begin
            self._write_index(version)
        except OSError as exc:
            logger.warning(
                "%s: v%s committed, but housekeeping failed: %s", self.directory, version, exc
            )


# --------------------------------------------------------------------------- helpers


def _touches_most_pages(patch: Patch, loc: TensorLocation) -> bool:
    """At least one changed element per page on average (then ~2/3 of the pages or more are
    written): prefaulting the whole range is cheaper than faulting page by page."""
    if patch.positions is None:
        return True
    return patch.positions.numel() * mmap.PAGESIZE >= loc.nbytes


def verify_checkpoint(
    directory: str | os.PathLike[str], manifest: Manifest, *, file_prefix: str = "model"
) -> list[str]:
    """Names of tensors whose bytes differ from ``manifest`` (missing, extra, other dtype/shape
    or other checksum). An empty list means the directory holds the version bit for bit.
    Read-only and lock-free: run it on a quiet checkpoint (e.g. ``asyncsync verify``)."""
    ckpt = LocalCheckpoint(directory, file_prefix=file_prefix)
    layout = ckpt._load_layout()
    bad: list[str] = sorted(set(layout) - {e.name for e in manifest.tensors})
    for e in manifest.tensors:
        loc = layout.get(e.name)
        if loc is None or loc.dtype != e.torch_dtype or loc.shape != e.shape:
            bad.append(e.name)
            continue
        if e.parts is not None:  # per-part checksums: hash the tensor's bytes in one piece
            with open(ckpt.directory / loc.file, "rb") as f:
                f.seek(loc.begin)
                data = f.read(loc.nbytes)
            if (
                len(data) != loc.nbytes
                or entry_checksum(e, data, manifest.checksum_algorithm) != e.checksum
            ):
                bad.append(e.name)
            continue
        h = new_hasher(manifest.checksum_algorithm)
        with open(ckpt.directory / loc.file, "rb") as f:
            f.seek(loc.begin)
            left = loc.nbytes
            while left > 0:
                chunk = f.read(min(left, 8 << 20))
                if not chunk:
                    break
                h.update(chunk)
                left -= len(chunk)
        if left or h.hexdigest() != e.checksum:
            bad.append(e.name)
    return bad
