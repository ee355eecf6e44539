"""ServerStanding: what a reloading engine knows of whether its server serves the version held.

The receiver acknowledges the version its server serves (docs/ENGINES.md, "What the agent
acknowledges"). Between two confirmed reloads the server can stop serving it: restarted with
its launch weights (it reports another label), or left with unknown weights by a failed
reload (vLLM). :class:`ServerStanding` holds what the engine saw; the engine
(:mod:`receiver.engines.reloading`) asks it what may be acknowledged and whether the server must
be waited for and reconciled before the next call.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ServerStanding"]


class ServerStanding:
    """What is known of the server since its last confirmed reload (see the module docstring)."""

    def __init__(self) -> None:
        #: the server dropped a call or reported another version: wait for it, reconcile it
        self.lost = False
        #: why the served weights cannot be trusted (a failed reload left them half-loaded)
        self.weights_unknown: str | None = None
        #: the label a lost server reported instead of the version held
        self.serves_other: str | None = None

    @property
    def withdrawn(self) -> bool:
        """Whether the server is known not to serve the version held: no ack names it."""
        return self.serves_other is not None or self.weights_unknown is not None

    def confirmed(self) -> None:
        """A reload was confirmed (the server reports the version loaded): all is known."""
        self.lost = False
        self.weights_unknown = self.serves_other = None

    def info(self) -> dict[str, Any]:
        return {"server_lost": self.lost, "weights_unknown": self.weights_unknown}
