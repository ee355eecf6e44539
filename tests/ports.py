"""TCP ports on 127.0.0.1 for the servers the tests start, chosen outside the kernel's
ephemeral range.

A port taken with ``bind(("127.0.0.1", 0))`` and closed again is back in the ephemeral pool
at once: in the seconds before the server it was meant for binds it (an SGLang server loads
its model first), any ``connect()`` or ``bind(0)`` on the host may be handed the same port, and
the server then fails with "address already in use". That happened in CI: a real SGLang's
uvicorn could not bind, and its warm-up thread's ``/freeze_gc`` reached whatever held the
port. The kernel never hands out a port below the ephemeral range on its own, so a port from
there stays free until a test binds it on purpose.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path
from typing import Any

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: from here up to the ephemeral range; below it are Ray's worker ports (10002-19999 by default)
_FLOOR = 20000
_given: set[int] = set()  # never hand the same port out twice in one process


def _candidates() -> range:
    try:
        low, high = (int(x) for x in _RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    if low - _FLOOR >= 2048:
        return range(_FLOOR, low)
    return range(high + 1, 65536)  # an unusual range set low: look above it instead


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports nothing on 127.0.0.1 is bound to now, none handed out before by
    this process, all outside the ephemeral range (RuntimeError if too few are left)."""
    pool = _candidates()
    if len(_given) > len(pool) // 2:
        _given.clear()  # a very long session: old servers are long gone
    rng = random.SystemRandom()
    out: list[int] = []
    for _ in range(64 * n):
        port = rng.choice(pool)
        if port not in _given and _bindable(port):
            _given.add(port)
            out.append(port)
            if len(out) == n:
                return out
    raise RuntimeError(f"no {n} free ports in {pool.start}-{pool.stop - 1} on 127.0.0.1")


def free_port() -> int:
    """One port from :func:`free_ports`."""
    return free_ports(1)[0]


__all__ = ["free_port", "free_ports"]


def has_ipv6_loopback() -> bool:
    """Whether ``::1`` can be bound here (IPv6 tests skip, or leave out their IPv6 case, where
    it cannot)."""
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


def resolving_to(name: str, *addresses: str) -> Any:
    """A stand-in for ``socket.getaddrinfo`` that resolves ``name`` to ``addresses`` (in that
    order) and anything else as the real one does: a name of several addresses on demand (this
    machine's /etc/hosts gives ``localhost`` one)."""
    real = socket.getaddrinfo

    def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host != name:
            return real(host, port, *args, **kwargs)
        return [info for a in addresses for info in real(a, port, *args, **kwargs)]

    return getaddrinfo
