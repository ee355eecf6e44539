"""ServerStanding: what a reloading engine knows of whether its server serves the version held.

The receiver acknowledges the version its server serves (docs/ENGINES.md, "What the agent
acknowledges"). Between two confirmed reloads the server can stop serving it:

* restarted: it reports another label (its launch weights), and while it restarts it refuses
  connections: the process is gone, and the next one serves its launch weights;
* stalled (SIGSTOP, a hung process, a cut network): no call is answered. Past
  ``Timeouts.silence`` seconds without an answer, what it would serve is not known either;
* a failed reload left its weights unknown (vLLM), or a repair after an audit that found other
  bytes served failed.

:class:`ServerStanding` holds what the engine saw; the engine
(:mod:`receiver.engines.reloading`) asks it what may be acknowledged (:attr:`withdrawn`: the
ack goes at once, and comes back once the server answers with the version held, or a reload
is confirmed), whether the server must be waited for and reconciled before the next call
(:attr:`lost`), and how to read a label read while a reload runs (:meth:`judge`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from receiver.engines.http_engine import HttpClient

__all__ = ["ServerStanding"]


class ServerStanding:
    """What is known of the server since its last confirmed reload (see the module docstring).

    Args:
        client: the engine's client (what it saw of the server's answers).
        silence: seconds without an answer after which the ack is withdrawn.
    """

    def __init__(self, client: HttpClient, silence: float):
        self.client = client
        self.silence = silence
        #: the server dropped a call or reported another version: wait for it, reconcile it
        self.lost = False
        #: why the served weights cannot be trusted (a failed reload left them half-loaded)
        self.weights_unknown: str | None = None
        #: the label a lost server reported instead of the version held
        self.serves_other: str | None = None
        #: why a full reload is owed (an audit found other bytes served; its repair failed)
        self.repair_owed: str | None = None
        #: the version a reload or relabel in flight takes (until the engine holds it)
        self.loading: int | None = None
        self._changes = 0  # + 1 as each change starts and ends: a label read across one

    @property
    def why_withdrawn(self) -> str | None:
        """Why the server is not known to serve the version held (no ack names it), or None."""
        if self.serves_other is not None:
            return f"the server reports version {self.serves_other!r}"
        if self.weights_unknown is not None or self.repair_owed is not None:
            return self.weights_unknown or self.repair_owed
        if self.client.refused:
            return "the server refuses connections (stopped or restarting)"
        quiet = self.client.silent_for()
        if quiet >= self.silence and self.loading is None:  # (a reload may keep it busy)
            return f"the server has answered nothing for {quiet:.0f}s"
        return None

    @property
    def withdrawn(self) -> bool:
        return self.why_withdrawn is not None

    @contextlib.contextmanager
    def changing(self, version: int) -> Iterator[None]:
        """Around a reload or relabel to ``version``, until the engine holds it."""
        before, self.loading = self.loading, version
        self._changes += 1
        try:
            yield
        finally:
            self.loading = before
            self._changes += 1

    def mark(self) -> int:
        """Taken before a label read, handed to :meth:`judge` after it."""
        return self._changes

    def judge(self, label: str | None, held: int, mark: int) -> tuple[int | None, bool]:
        """(the version the server serves, whether ``label`` shows it lost) after a label
        read begun at ``mark`` while the engine held ``held``. A read across a change in flight
        is not judged: it may show the version being loaded, which the server then serves."""
        if label == str(held):
            return held, False
        if self.loading is not None or self._changes != mark:
            return (self.loading if label == str(self.loading) else None), False
        return None, True

    def confirmed(self) -> None:
        """A reload was confirmed (the server reports the version loaded): all is known."""
        self.lost = False
        self.weights_unknown = self.serves_other = self.repair_owed = None

    def info(self) -> dict[str, Any]:
        return {
            "server_lost": self.lost,
            "weights_unknown": self.weights_unknown,
            "ack_withdrawn": self.why_withdrawn,
        }
