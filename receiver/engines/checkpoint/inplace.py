"""Applying a delta in place, undoably: the undo journal written before every patch, undo, and
the check of the patched bytes against the manifest.

Each tensor's checksum is taken in the pass that patches it
(:func:`asyncsync.codec.patch_and_checksum`: a chunk is patched, then hashed while in cache),
so the commit compares digests instead of reading every page of the patched tensors again. A
version patches each tensor once (the engine refuses a second update of one tensor), so that
digest is of the tensor's bytes as committed: unless tensors share bytes in the files (a
damaged checkpoint; :func:`disjoint` says so), when the commit hashes them from the files as
before.

Before an apply group writes, an undo record with the OLD values of every position it will
write is durable in the journal directory (:mod:`receiver.engines.checkpoint.journal`); or,
for an engine that acks before its data is durable, a progressive record that the patch
kernel fills as it goes, each chunk's old values saved just before the chunk is written (one
pass over the pages instead of a gather pass and then the patch's, and no fsync). Undo writes
the old values back, newest record first, so it is idempotent: a failed checksum, an abort and
a restart after a crash all run it, as often as needed.
"""

from __future__ import annotations

import itertools
import mmap
import os
from collections.abc import Container, Mapping, Sequence
from pathlib import Path

import torch

from asyncsync import fsio
from asyncsync.codec import JournalPass, Patch, apply_patch, journal_pass, patch_and_checksum
from asyncsync.errors import EngineStateError
from asyncsync.format import Manifest, TensorEntry
from asyncsync.pipeline import parallel_map
from receiver.engines.checkpoint import journal
from receiver.engines.st_layout import FileMaps, TensorLocation
from receiver.state import PersistedState

__all__ = [
    "LostJournal",
    "disjoint",
    "first_mismatch",
    "journal_and_patch",
    "likely_dense",
    "mismatched",
    "undo",
    "write_record",
]

#: (name, location, flat int view of the mapped bytes, checked patch) of one tensor
Work = tuple[str, TensorLocation, torch.Tensor, Patch]


def journal_and_patch(
    maps: FileMaps,
    journal_dir: Path,
    seq: int,
    version: int,
    work: list[Work],
    algorithm: str | None = None,
    layouts: Mapping[str, Sequence[tuple[int, int]] | None] | None = None,
    *,
    durable: bool = True,
    hashed: Container[str] | None = None,
) -> dict[str, str]:
    """Write the undo record ``undo-{seq}`` of ``work`` durably, then patch the mapped bytes.

    With ``algorithm``, each tensor is checksummed in the pass that patches it (``layouts``: the
    parts of the tensors published in parts); returns those checksums by tensor name.
    ``hashed``: only the tensors it names are (None: all), the others only patched (a
    compaction's tensor that a later record patches again: its digest here would be stale).

    ``durable=False`` (a receiver that acks before its data is durable): where every patch can
    (:func:`~asyncsync.codec.can_journal_in_pass`), a progressive record instead, filled by the
    patch kernel as it patches (one pass over the pages instead of two, no fsync); see
    :mod:`receiver.engines.checkpoint.journal`.
    """
    # each tensor's pages faulted in writable by the thread that patches it, before any write
    # (a page that cannot be is an error, not a SIGBUS): all (where most change), else those
    # holding a changed element
    prefault = {name for name, loc, _flat, patch in work if _touches_most_pages(patch, loc)}
    hash_of = {n: algorithm if hashed is None or n in hashed else None for n, *_ in work}
    if not durable and algorithm is not None:
        passes: list[JournalPass] = []
        for n, _loc, flat, p in work:  # each checked once, here, for the pass that makes it
            one = journal_pass(flat, p, hash_of[n], None if layouts is None else layouts.get(n))
            if one is None:
                break
            passes.append(one)
        else:
            return _journal_in_pass(maps, prefault, journal_dir, seq, version, work, passes)
    write_record(journal_dir / f"undo-{seq:06d}.safetensors", journal.encode_parts(work, version))

    def patch_one(item: Work) -> str | None:  # on the pool: the tensors are disjoint
        name, loc, flat, patch = item
        maps.prefault(loc, None if name in prefault else patch.positions)
        if (algo := hash_of[name]) is None:
            apply_patch(flat, patch)
            return None
        layout = None if layouts is None else layouts.get(name)
        return patch_and_checksum(flat, patch, algo, layout)

    sums = parallel_map(patch_one, work, cost=_work_bytes) if algorithm is not None else None
    if sums is None:  # tensors may share bytes (not disjoint): one after another, in order
        for item in work:
            patch_one(item)
        return {}
    return {name: d for (name, *_), d in zip(work, sums, strict=True) if d is not None}


def _journal_in_pass(
    maps: FileMaps,
    prefault: set[str],
    journal_dir: Path,
    seq: int,
    version: int,
    work: list[Work],
    passes: list[JournalPass],
) -> dict[str, str]:
    """The progressive record ``undo-{seq}.progressive`` created, then every tensor patched,
    checksummed (by its pass's algorithm: one of None is not) and journaled in one pass (on the
    pool: the tensors are disjoint)."""
    path = journal_dir / f"undo-{seq:06d}{journal.PROGRESSIVE_SUFFIX}"
    record = journal.create_progressive(
        path, work, version, spare=journal.spare_path(journal_dir, seq)
    )
    try:
        jobs = list(zip(work, passes, record.values_at, record.progress_at, strict=True))

        def patch_one(job: tuple[Work, JournalPass, int, int]) -> str | None:
            (name, loc, _flat, patch), one, values_at, progress_at = job
            maps.prefault(loc, None if name in prefault else patch.positions)
            try:
                return one.run((record.fd, values_at, progress_at))
            except OSError as exc:  # the kernel's write of the record: it names no file
                if exc.filename is not None:
                    raise
                raise OSError(
                    exc.errno, f"{exc.strerror} (saving the old values of {name!r})", str(path)
                ) from exc

        sums = parallel_map(patch_one, jobs, cost=lambda job: _work_bytes(job[0]))
    finally:
        os.close(record.fd)
    return {name: d for (name, *_), d in zip(work, sums, strict=True) if d is not None}


def _work_bytes(item: Work) -> int:
    """The bytes one patch passes over: its tensor's (it is hashed whole)."""
    return item[1].nbytes


def write_record(path: Path, record: list[bytes | memoryview]) -> None:
    """Make one undo record durable (temp file, fsync, rename, fsync of the directory)."""
    fsio.atomic_write(path, record)


def _record_order(path: Path) -> tuple[int, str]:
    """Records in the order they were written: by their group number (``undo-{seq:06d}``
    grows a seventh digit past 999,999 groups, where the names' order is no longer theirs)."""
    seq = path.name.removeprefix("undo-").split(".", 1)[0]
    return (int(seq) if seq.isascii() and seq.isdigit() else -1, path.name)


class LostJournal(EngineStateError):
    """A progressive undo record cannot be read back (the machine went down before the page
    cache reached the disk): the files cannot be undone exactly."""


def undo(
    journal_dir: Path, layout: Mapping[str, TensorLocation], maps: FileMaps, *, sync: bool = True
) -> bool:
    """Write back the old values of every undo record (newest first), then (``sync``) sync
    the maps.

    Returns whether any record was progressive (not durable when written: after a crash of the
    machine the caller checks every tensor); raises :class:`LostJournal` if such a record is
    unreadable, EngineStateError if a durable one is.
    """
    progressive = False
    paths = [
        p
        for p in journal_dir.glob("undo-*")
        if p.name.endswith((".safetensors", journal.PROGRESSIVE_SUFFIX))
    ]
    for path in sorted(paths, key=_record_order, reverse=True):
        lost = path.name.endswith(journal.PROGRESSIVE_SUFFIX)
        progressive = progressive or lost
        try:
            records = journal.read(path)
        except Exception as exc:
            kind = LostJournal if lost else EngineStateError
            raise kind(f"undo journal {path} is unreadable: {exc}") from exc
        for name, pos, old in records:
            loc = layout.get(name)
            if loc is None:
                raise EngineStateError(f"undo journal {path} names unknown tensor {name!r}")
            flat = maps.flat(loc)
            try:
                maps.prefault(loc, pos)  # an error, not a SIGBUS, on a full copy-on-write disk
                old = old.view(flat.dtype)
                if pos is None:
                    flat.copy_(old)
                elif pos.numel():
                    flat.index_copy_(0, pos, old)
            except (IndexError, RuntimeError, ValueError) as exc:  # it does not fit the tensor
                kind = LostJournal if lost else EngineStateError
                raise kind(f"undo journal {path} does not fit tensor {name!r}: {exc}") from exc
            del flat
    if sync:
        maps.sync()
    return progressive


def first_mismatch(
    maps: FileMaps,
    layout: Mapping[str, TensorLocation],
    entries: Mapping[str, TensorEntry],
    touched: set[str],
    algorithm: str,
    held: Mapping[str, str] | None,
    patched: Mapping[str, str] | None = None,
) -> tuple[str, str] | None:
    """(name, checksum) of the first tensor whose new bytes differ from its manifest entry.

    Touched tensors and those the manifest says changed are checked by the checksum taken when
    they were patched (``patched``, from :func:`journal_and_patch`), else hashed from the files;
    the others are compared by the checksum recorded for the version held (``held``: None when
    it was recorded with another algorithm, then they are not compared).
    """
    for name, e in entries.items():
        if name in touched or e.changed > 0:
            got = None if patched is None else patched.get(name)
            if got is None:
                got = maps.checksum(layout[name], algorithm, e.layout)
        elif held is not None:
            got = held.get(name, e.checksum)
        else:
            continue
        if got != e.checksum:
            return name, got
    return None


def mismatched(
    directory: Path, layout: Mapping[str, TensorLocation], ps: PersistedState
) -> list[str]:
    """The tensors whose bytes in the files differ from the checksums ``ps`` records (all of
    them when it records no algorithm)."""
    maps = FileMaps(directory)
    try:
        return [
            name
            for name, loc in layout.items()
            if ps.checksum_algorithm is None
            or maps.checksum(loc, ps.checksum_algorithm, ps.parts.get(name))
            != ps.checksums.get(name)
        ]
    finally:
        maps.close()


def disjoint(layout: Mapping[str, TensorLocation]) -> bool:
    """No two tensors share a byte of the files (as safetensors writes them): then patching
    one leaves every other tensor's checksum, taken when it was patched, as it is."""
    ranges = sorted((loc.file, loc.begin, loc.end) for loc in layout.values() if loc.nbytes)
    return all(a[0] != b[0] or a[2] <= b[1] for a, b in itertools.pairwise(ranges))


def likely_dense(manifest: Manifest, layout: Mapping[str, TensorLocation]) -> list[TensorLocation]:
    """The tensors a delta begun on ``manifest`` will most likely write on most of their pages
    (its patch then prefaults them whole), in the manifest's order: those whose entry changed
    an element per page or more. For a streamed delta the manifest is the provisional one,
    whose entries are the base's (the step before changed about as much); none when its
    density says little (a seed or keyframe without a base: every element "changed")."""
    if not 0 < manifest.totals.density < 0.5:
        return []
    return [
        loc
        for t in manifest.tensors
        if (loc := layout.get(t.name)) is not None and _most_pages(t.changed, loc)
    ]


def _touches_most_pages(patch: Patch, loc: TensorLocation) -> bool:
    """At least one changed element per page on average (then ~2/3 of the pages or more are
    written): prefaulting the whole range is cheaper than faulting page by page."""
    return patch.positions is None or _most_pages(patch.positions.numel(), loc)


def _most_pages(changed: int, loc: TensorLocation) -> bool:
    """``changed`` elements are at least one per page of ``loc`` on average."""
    return changed * mmap.PAGESIZE >= loc.nbytes
