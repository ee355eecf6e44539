"""The keywords of :class:`~receiver.agent.ReceiverAgent` and their checks, in one place: the
agent checks its own with them, and a Ray ``ReceiverSpec`` checks its ``agent_options`` with
them when it is made, on the driver (a typo, or a value the agent refuses, surfaced inside the
actor on the engine's node, after placement, as a TypeError or a remote ConfigError)."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from typing import Any

from asyncsync.errors import ConfigError, check_bytes, check_poll_interval, check_seconds

__all__ = ["AGENT_OPTIONS", "check_agent_options"]


def _flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {value!r}")


def _flag_or_none(name: str, value: Any) -> None:
    if value is not None:
        _flag(name, value)


#: each keyword-only option of ReceiverAgent, with its check (name, value)
AGENT_OPTIONS: dict[str, Callable[[str, Any], None]] = {
    "poll_interval": check_poll_interval,
    "verify_deadline": check_seconds,
    "use_inotify": _flag_or_none,
    "pipelined": _flag,
    "prefetch": _flag,
    "prefetch_bytes": lambda n, v: check_bytes(n, v, minimum=0),
    "apply_group_bytes": lambda n, v: check_bytes(n, v, optional=True),
    "lease_ttl": lambda n, v: check_seconds(n, v, above=True),
    "lease_settle": lambda n, v: check_seconds(n, v, optional=True),
    "stream_timeout": lambda n, v: check_seconds(n, v, above=True),
}


def check_agent_options(options: Mapping[str, Any], what: str = "") -> None:
    """ConfigError (its message starting with ``what``) for a name ReceiverAgent does not take
    or a value it refuses; the message names the option as the agent's own check does."""
    for name, value in options.items():
        check = AGENT_OPTIONS.get(name)
        if check is None:
            near = difflib.get_close_matches(str(name), AGENT_OPTIONS, n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise ConfigError(
                f"{what}ReceiverAgent takes no option {name!r}; {hint}it takes "
                f"{', '.join(AGENT_OPTIONS)}"
            )
        check(f"{what}{name}", value)
