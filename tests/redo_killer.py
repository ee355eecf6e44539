"""A real receiver (``receiver.cli.main`` in its own interpreter) that kills itself with
SIGKILL at one named point of its checkpoint's redo log (tests/test_redo_killed.py).

Usage: ``python tests/redo_killer.py POINT RECEIVER-ARGS...``; POINT is one of

* ``record``: a delta's record durable and renamed into place, the state not naming it yet;
* ``mid-compaction``: the first tensor of a compaction patched (each tensor a group of its own);
* ``before-state``: a compaction's files patched and flushed, ``state.json`` not written;
* ``after-state``: ``state.json`` at the merged version, the records not removed yet;
* ``stale-undo``: the first compaction's undo records not removed after its commit (an
  injected EIO: kept, a warning), then the next compaction's ``applying`` state saved, its
  journal not cleared yet: the earlier compaction's records beside it.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from receiver import cli
from receiver.engines.checkpoint import inplace, redolog
from receiver.engines.checkpoint.redo import RecordWriter
from receiver.state import PersistedState, StateStore


def _die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> int:
    point, args = sys.argv[1], sys.argv[2:]
    merging = [False]
    real_merge = redolog.RedoLog._merge_into_files

    def merge(self: Any, *a: Any) -> None:
        merging[0] = True
        real_merge(self, *a)
        merging[0] = False

    redolog.RedoLog._merge_into_files = merge  # type: ignore[method-assign]
    if point == "record":
        real_finish = RecordWriter.finish

        def finish(self: RecordWriter, meta: Any) -> Path:
            path = real_finish(self, meta)
            _die()
            return path

        RecordWriter.finish = finish  # type: ignore[method-assign]
    elif point == "mid-compaction":
        redolog._GROUP_BYTES = 1
        real_patch = inplace.journal_and_patch
        calls = [0]

        def patch(*a: Any, **kw: Any) -> Any:
            out = real_patch(*a, **kw)
            calls[0] += 1
            if calls[0] == 2:
                _die()
            return out

        inplace.journal_and_patch = patch
    elif point in ("before-state", "after-state"):
        real_save = StateStore.save
        saved_clean = [False]

        def save(self: StateStore, state: PersistedState, *, spare: bool = False) -> Any:
            done = merging[0] and not state.redo and not state.applying
            if done and point == "before-state":
                _die()
            out = real_save(self, state, spare=spare)
            saved_clean[0] = done
            return out

        real_remove = redolog.RedoLog._remove_records

        def remove_records(self: Any, paths: list[Path]) -> None:
            if saved_clean[0]:
                _die()
            real_remove(self, paths)

        StateStore.save = save  # type: ignore[method-assign]
        redolog.RedoLog._remove_records = remove_records  # type: ignore[method-assign]
    elif point == "stale-undo":
        real_save, real_clear = StateStore.save, StateStore.clear_dir
        merged = [0]

        def save_then(self: StateStore, state: PersistedState, *, spare: bool = False) -> Any:
            out = real_save(self, state, spare=spare)
            if merging[0] and state.applying and merged[0]:
                _die()  # the second compaction begun, its journal not cleared
            if merging[0] and not state.applying and not state.redo:
                merged[0] += 1
            return out

        def clear_dir(self: StateStore, path: Path, **kw: Any) -> None:
            if path == self.journal_dir and merged[0] == 1 and merging[0]:
                raise OSError(5, "injected: the compaction's undo records not removed")
            real_clear(self, path, **kw)

        StateStore.save = save_then  # type: ignore[method-assign]
        StateStore.clear_dir = clear_dir  # type: ignore[method-assign]
    else:
        raise SystemExit(f"unknown point {point!r}")
    return cli.main(args)


if __name__ == "__main__":
    sys.exit(main())
