"""LocalCheckpoint: a Hugging Face safetensors directory kept at the newest version, in place.

The directory is what ``from_pretrained`` / vLLM / SGLang load::

    DIR/
      model-00001-of-00003.safetensors ...   the weights (names = state-dict keys)
      model.safetensors.index.json           {"metadata": {"total_size", "asyncsync_version"},
                                              "weight_map": {name: file}}
      .asyncsync/                            receiver.state: state.json (and its spare: a
                                             rollback's state on a full disk), lock, journal/,
                                             staging/, redo/ (redo records: redo_log=N),
                                             flush-failed (a failed flush: rewrite at open),
                                             flush-failed.spare (renamed to it on a full disk),
                                             stamps.json (the data files' inode, size, mtime)

Why in place: a delta touches a small fraction of the bytes, so rewriting multi-GB files per
version would cost far more than the delta. Each tensor sits at a fixed byte range of its file
(parsed from the safetensors header), so a delta is applied through ``mmap`` on those ranges.

Crash safety (``kill -9`` at any instant leaves a state the next ``open`` repairs):

* delta: before the first in-place write of a version, ``state.json`` says ``applying``. With
  ``sync_before_ack=True``, before each ``apply`` writes, an undo journal file with the OLD
  values of every position it will write is durable in ``.asyncsync/journal/``. By default
  (acks before the data is durable) the journal is *progressive* instead: ``state.json`` also
  says ``progressive`` (format_version 2), and the patch kernel saves each chunk's old values
  into the record (``undo-NNNNNN.progressive``) just before it patches the chunk, with the
  count saved after them, so the pages are read once, not twice, and nothing is fsynced
  (:mod:`~receiver.engines.checkpoint.journal`; a committed version's records are kept as
  spares, ``spare-NNNNNN``, which the next version's records are written over: never read).
  Undo just writes old values back, so it is idempotent: ``abort``, a failed checksum in
  ``commit`` and ``open`` after a crash all run it,
  as often as needed, and the checkpoint is back at the old version bit for bit (a process
  crash keeps the page cache, so a progressive record holds every value saved before it).
* durability after the ack (default): a delta commits once every touched tensor's bytes match
  the manifest's checksums *in the page cache*; ``state.json`` then says ``clean`` at the new
  version with ``synced: false`` and the receiver acknowledges it (the HF index written
  before); then (``acknowledged``) the delta's undo records are removed (stale since the
  commit: an ``open`` finding them beside a clean state removes them too), and ``fsync`` of
  the data files runs in the background (on Linux it writes back the pages dirtied
  through the mappings, and unlike ``mmap.flush`` it releases the GIL; elsewhere ``msync``
  first), and ``synced`` becomes true. On Linux the flush holds the files' descriptors, not
  their mappings (dropped when it is submitted: the pages they dirtied stay dirty in the page
  cache), so the next delta's mapping is the only one and its pages count once in the RSS.
  The next delta does not wait for that flush: it journals and patches beside it (a full
  version and ``bump`` do wait); flushes run one after another, and one still waiting when
  a newer one comes is dropped (the newer writes back every data file). The flush is the largest
  single cost of an apply (a 3 % delta dirties every page of a bf16 tensor), so this takes it
  off the version's latency and off the next one's. A process crash loses nothing (the page
  cache survives it); if the machine itself fails before the flush, ``open`` undoes any delta
  in progress from its journal, then finds ``synced: false``, re-checks every tensor against
  the recorded checksums and, if any differs, removes the data files so the receiver
  re-initialises from the newest keyframe. After undoing a progressive delta (or finding its
  mark and no record: the machine lost it) ``open`` does the same re-check whatever ``synced``
  says, and a progressive record it cannot read makes it remove the files at once. With
  durable records, ``synced`` may become true while the next delta is open: its journal
  restores the positions it patched.
  A flush that fails marks the engine broken (under its lock): the next commit is refused
  (rolled back), and the next ``begin``, or a sync with nothing newer (``reconcile``), first
  does what a reopen does (the held version re-checked and flushed again, or wiped if a tensor
  differs or its layout no longer reads): refused while that fails, it goes on once it
  succeeds.
  Flushed again means written again, then fsynced: a failed writeback leaves its pages clean.
  A rollback (undo) whose data sync fails after it wrote the old values back ends the same
  way where its records were progressive (never durable: a retried undo could not trust
  them): the failed-flush note first, then ``state.json`` clean at the held version with
  ``synced: false``, the records gone, the engine broken until the recovery succeeds. Durable
  records (``sync_before_ack=True``) are kept, ``applying``: the undo is done again (at the
  next begin or sync), and after a reboot they restore the version exactly.
  ``sync_before_ack=True`` flushes before the commit instead.
* full: new files are written to ``.asyncsync/staging/`` and verified; only then is the state
  marked ``applying`` and the files moved into place. A crash in that window leaves old and
  new files mixed, so ``open`` removes the data files and reports no version: the receiver
  re-initialises the directory from a keyframe.

Edits behind the receiver's back (a byte flipped, a file truncated, an older copy put back):
each data file's stamp (inode, size, mtime) is recorded whenever the state is saved clean, and
compared before each delta or zero diff, at each sync with nothing newer and at open; the
tensors of a file whose stamp changed are checked against the held version, and the files
wiped if any differs (:mod:`~receiver.engines.checkpoint.stamps`). A data file with other links
(a hard-linked backup, a symlink) is copied into one of its own before a delta writes it.

* redo log (opt-in, ``LocalCheckpoint(dir, redo_log=N)``, ``asyncsync-receiver
  --checkpoint-redo-log N``; :mod:`~receiver.engines.checkpoint.redolog`): a delta is not
  patched into the files. Its decoded patches and the version's checksums are written as one
  record ``redo/redo-VVVVVVVVVVVV.rec`` (fsynced, renamed, the directory fsynced: durable before
  anything names it), then ``state.json`` names it (``redo``: the records in order, on top of
  ``version``, which stays the version the files hold; format_version 3, which an older reader
  refuses); the ack follows. No prefault, patch or flush of the model's pages per version: a
  3 % delta of bf16 writes ~5 % of the model to disk instead of all of it. Compaction patches the
  records into the files in turn through the undoable path above (journal, patch with
  checksums, checked against the newest record's; one flush for all), then ``state.json``
  holds the newest version with no record, then the records go. It runs after the ack of the
  Nth record (or at the next begin), when idle (no begin for ``compact_idle`` seconds, or twice
  the interval between versions where longer, at most 5 minutes: versions a minute apart
  would otherwise be compacted one by one), at open and close, and before anything reads the
  bytes (``load_state_dict``, a zero-diff version; a full version drops the records instead:
  it replaces every byte). Crash safety: a record no state names is removed at open (its
  version was never acknowledged); named records are compacted at open; a compaction cut
  short is undone from its journal (``applying``, as a delta) and done again; a checksum that
  differs after the compaction means the files were not the records' base (damaged between
  versions): the files are removed and the receiver re-initialises from a keyframe, as after a
  failed re-check. The trade: the composed bytes are verified against full-tensor checksums
  at each compaction (every N versions, and before any load) instead of at every version;
  each record's values were verified in transit (the shard checksums). While a record is held
  the directory is not a loadable safetensors directory of the version acknowledged (the files
  are older): the plugins' start-up load waits for it (``receiver.plugins.clean_load``) and
  ``asyncsync verify`` says so. Not for the HTTP engines (their servers reload the files:
  ``ReloadingEngine`` refuses a checkpoint with one, ConfigError).

Blocking file work runs in ``asyncio.to_thread`` so the receiver's event loop stays free.

The package: :mod:`~receiver.engines.checkpoint.engine` (:class:`LocalCheckpoint`: transactions),
:mod:`~receiver.engines.checkpoint.recovery` (open after a crash, the recovery after a failed
flush, the wipe), :mod:`~receiver.engines.checkpoint.flusher` (the flush after the ack, on
the engine's own thread), :mod:`~receiver.engines.checkpoint.files` (data
files, index, layout; :func:`verify_checkpoint`), :mod:`~receiver.engines.checkpoint.inplace`
(undoable in-place deltas), :mod:`~receiver.engines.checkpoint.journal` (the undo record's
format), :mod:`~receiver.engines.checkpoint.staging` (full versions through staged files) and
:mod:`~receiver.engines.checkpoint.fullswap` (their apply and commit, the files swapped),
:mod:`~receiver.engines.checkpoint.stamps` (the data files' stamps),
:mod:`~receiver.engines.checkpoint.redolog` (the redo log) and
:mod:`~receiver.engines.checkpoint.redo` (its records' format).
"""

from receiver.engines.checkpoint.engine import LocalCheckpoint
from receiver.engines.checkpoint.files import CheckpointFiles, verify_checkpoint
from receiver.engines.st_layout import TensorLocation, read_layout

__all__ = [
    "CheckpointFiles",
    "LocalCheckpoint",
    "TensorLocation",
    "read_layout",
    "verify_checkpoint",
]
