"""An engine's start-up load of a checkpoint the receiver patches in place: only whole versions.

The receiver patches its host-local checkpoint in place while the server serves. A server
(re)started meanwhile (by its supervisor, a node reboot) reads the files with its own loader,
which knows nothing of asyncsync: halfway through a version (``state.json`` says
``applying``; a receiver killed there leaves it so until it is restarted and undoes it) it
loaded some tensors of the new version beside the rest of the old one, a model that no version
ever was, and served it (seen on vLLM 0.32: ``tests/test_real_midapply.py``).

:func:`load_whole_version` wraps such a load: while the directory is an asyncsync checkpoint
that is not clean it waits (saying so once in the server's log, :data:`WAIT_LINE`), up to
``$ASYNCSYNC_START_WAIT`` seconds (default 600; then the start fails with that reason, for the
supervisor to try again); and if ``state.json`` changed while the files were read (the receiver
began the next version), it loads them again. ``state.json`` is replaced by a rename at every
change of state, so an unchanged inode and mtime mean no version began in between. A directory
that is no asyncsync checkpoint is loaded as it is.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from receiver.plugins.held import Unverified, checkpoint_snapshot
from receiver.state import STATE_DIR_NAME, STATE_NAME

__all__ = ["ENV_WAIT", "WAIT_LINE", "load_whole_version"]

ENV_WAIT = "ASYNCSYNC_START_WAIT"
WAIT_LINE = "asyncsync: the checkpoint is being patched by its receiver"
_POLL = 0.5

T = TypeVar("T")


def _clean(directory: Path) -> tuple[int, int, int] | None:
    """(inode, mtime, version) of a clean checkpoint's ``state.json``; None while it is not."""
    path = directory / STATE_DIR_NAME / STATE_NAME
    try:
        before = os.stat(path)
        snapshot = checkpoint_snapshot(directory)
        after = os.stat(path)
    except (OSError, Unverified):
        return None
    if snapshot is None or (before.st_ino, before.st_mtime_ns) != (after.st_ino, after.st_mtime_ns):
        return None
    return after.st_ino, after.st_mtime_ns, snapshot.version


def load_whole_version(
    directory: str | os.PathLike[str],
    load: Callable[[], T],
    log: logging.Logger,
    wait: float | None = None,
) -> T:
    """``load()`` of the checkpoint in ``directory``, holding it until the checkpoint is clean
    and repeating it if the checkpoint changed meanwhile (see the module docstring). Raises
    RuntimeError when it stays mid-apply for ``wait`` seconds."""
    d = Path(directory)
    if not (d / STATE_DIR_NAME / STATE_NAME).is_file():
        return load()
    if wait is None:
        wait = float(os.environ.get(ENV_WAIT, "600"))
    deadline = time.monotonic() + wait
    waited = False
    while True:
        before = _clean(d)
        if before is None:
            if not waited:
                log.warning("%s (%s mid-apply): waiting up to %gs for it to be clean before "
                            "loading", WAIT_LINE, d, wait)  # fmt: skip
                waited = True
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"asyncsync: {d} is an asyncsync checkpoint still being patched after "
                    f"{wait:g}s (its receiver is stopped mid-version?): not loading a mix of "
                    f"two versions. Start its receiver (it undoes or finishes the version), "
                    f"then this server again; ${ENV_WAIT} sets the wait"
                )
            time.sleep(_POLL)
            continue
        out = load()
        if _clean(d) == before:
            if waited:
                log.warning("asyncsync: %s is clean at v%s: loaded", d, before[2])
            return out
        log.warning("asyncsync: %s changed while it was read: loading it again", d)
