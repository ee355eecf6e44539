"""Child processes that the stress drivers start and kill with SIGKILL.

Two ways to start one, both real processes killed by a real ``SIGKILL``:

* ``exec``: a fresh interpreter, ``python -m MODULE ARGS`` (for the receiver that is the real
  ``python -m receiver.cli``). Faithful, but each start pays the torch import (~2-3 s here).
* ``fork``: forked from a multiprocessing *forkserver* that imported torch and asyncsync once,
  then calls ``MODULE.main(ARGS)``: the same code path without the interpreter start-up, so
  many trials fit in a short test. The forkserver never runs torch ops, so forking it is safe.

A child's stdout and stderr go to a log file (kept for a failed trial).
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import multiprocessing.context
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Literal

__all__ = ["REPO", "Child", "Launch"]

Launch = Literal["exec", "fork"]
REPO = Path(__file__).resolve().parent.parent
_PRELOAD = [
    "torch",
    "asyncsync.publish.publisher",
    "receiver.agent",
    "receiver.cli",
    "stress.children",
]
_ctx: multiprocessing.context.ForkServerContext | None = None


def _forkserver() -> multiprocessing.context.ForkServerContext:
    global _ctx
    if _ctx is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        _ctx = ctx
    return _ctx


def _run_main(module: str, argv: list[str], log: str) -> None:
    """Forked child: send output to ``log``, then ``sys.exit(module.main(argv))``."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - lives as long as we do
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.exit(importlib.import_module(module).main(argv))


class Child:
    """One child process running ``MODULE.main(argv)`` (see the module docstring)."""

    def __init__(self, launch: Launch, module: str, argv: list[str], log: Path) -> None:
        if launch not in ("exec", "fork"):
            raise ValueError(f"launch must be 'exec' or 'fork', got {launch!r}")
        self.launch = launch
        self.module = module
        self.log = log
        self._popen: subprocess.Popen[bytes] | None = None
        self._proc: multiprocessing.process.BaseProcess | None = None
        self.started = time.monotonic()
        if launch == "exec":
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(REPO), env.get("PYTHONPATH", "")) if p
            )
            with open(log, "ab") as out:
                self._popen = subprocess.Popen(
                    [sys.executable, "-m", module, *argv],
                    cwd=REPO,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
        else:
            proc = _forkserver().Process(
                target=_run_main, args=(module, argv, str(log)), name=f"stress {module}"
            )
            proc.start()
            self._proc = proc

    @property
    def pid(self) -> int:
        if self._popen is not None:
            return self._popen.pid
        assert self._proc is not None and self._proc.pid is not None
        return self._proc.pid

    def poll(self) -> int | None:
        """The exit status if the child has ended (negative: killed by that signal), else None."""
        if self._popen is not None:
            return self._popen.poll()
        assert self._proc is not None
        return None if self._proc.is_alive() else self._proc.exitcode

    def kill(self) -> float:
        """SIGKILL the child, wait for it to be gone; return the time.time() of the kill."""
        t = time.time()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        self.wait(30.0)
        return t

    def wait(self, timeout: float) -> int:
        """Wait for the child to end; raise TimeoutError (after killing it) if it does not."""
        if self._popen is not None:
            try:
                return self._popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self._popen.kill()
                self._popen.wait()
                raise TimeoutError(f"{self.module} did not end within {timeout}s") from None
        assert self._proc is not None
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            self._proc.kill()
            self._proc.join()
            raise TimeoutError(f"{self.module} did not end within {timeout}s")
        return self._proc.exitcode

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""
