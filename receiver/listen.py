"""The listening sockets of the status server, bound one way for the server and for the
receiver's check before the engine is opened (a port the check found free is the port the
server binds, on the same addresses).

``::``, the IPv6 unspecified address, is bound dual-stack (``IPV6_V6ONLY`` off where the
system allows it): it serves IPv4 clients too, as an operator who writes ``::`` for "every
interface" means (asyncio's own server binds each IPv6 address IPv6 only, so 127.0.0.1 found
nothing). Any other IPv6 address is bound IPv6 only, as asyncio does. A name that resolves to
several addresses (``localhost`` to 127.0.0.1 and ::1) is bound on each, on one port: with
port 0 asyncio gave each its own free port, and the URL named one of them. With port 0, a
free port of the first address that is taken on another (by a socket of the other family) is
given up for a new one, a few times. On a host whose kernel has no IPv6 (booted with
``ipv6.disable=1``), ``::`` is bound as ``0.0.0.0``, with a warning: "every interface" is every
IPv4 one there, and a deployment written for every host works on this one too; any other IPv6
address is refused, saying to give an IPv4 one.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import socket
from typing import Any

from asyncsync.errors import ConfigError

__all__ = ["bind_sockets", "is_dual_stack", "is_unspecified", "resolve", "url_host"]

Infos = list[tuple[Any, Any, int, str, tuple[Any, ...]]]  # what socket.getaddrinfo returns

logger = logging.getLogger(__name__)

_ANY_HINT = "0.0.0.0 for every IPv4 interface, :: for every interface, IPv4 and IPv6"


def _unprivileged_start() -> int:
    """The first port any user may bind (Linux: net.ipv4.ip_unprivileged_port_start)."""
    try:
        with open("/proc/sys/net/ipv4/ip_unprivileged_port_start") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1024


def is_dual_stack(host: str) -> bool:
    """Whether ``host`` is the IPv6 unspecified address, which is bound for IPv4 too."""
    try:
        return ipaddress.ip_address(host) == ipaddress.IPv6Address("::")
    except ValueError:
        return False


def is_unspecified(host: str) -> bool:
    """Whether ``host`` is ``0.0.0.0`` or ``::``: every interface, no address to connect to."""
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def url_host(host: str, sock: socket.socket) -> str:
    """``host`` as a URL writes it, for a client on this host: the unspecified address (``::``,
    ``0.0.0.0``: "every interface", no address a client can reach) becomes the loopback that
    ``sock`` (the first socket bound for it) serves, an IPv6 address is bracketed (its scope's
    ``%`` escaped), a name stays."""
    if is_unspecified(host):
        v6only = sock.family == socket.AF_INET6 and sock.getsockopt(
            socket.IPPROTO_IPV6, socket.IPV6_V6ONLY
        )
        return "[::1]" if v6only else "127.0.0.1"  # a dual-stack socket serves 127.0.0.1 too
    return f"[{host.replace('%', '%25')}]" if ":" in host else host  # (a name has no ":")


def _hint(host: str, port_option: str) -> str:
    """What to write instead of a host that does not resolve, when its shape tells."""
    name, _, port = host.rpartition(":")
    if "://" in host:
        return "an address, not a URL: e.g. 127.0.0.1"
    if host.startswith("[") and host.endswith("]"):
        return f"an IPv6 address is written without brackets: {host[1:-1]!r}"
    if port.isdigit() and name and ":" not in name:
        return f"the port goes in {port_option}: {name!r}"
    return f"give an address of this host (default 127.0.0.1; {_ANY_HINT})"


def resolve(host: str, port: int, *, host_option: str, port_option: str) -> Infos:
    """The addresses of ``host`` (blocking: a name may ask a slow DNS); ConfigError naming
    ``host_option`` for one that does not resolve."""
    try:
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        why = exc.strerror if isinstance(exc, socket.gaierror) else str(exc)
        raise ConfigError(f"{host_option} {host!r}: {why}; {_hint(host, port_option)}") from exc


def bind_sockets(
    host: str,
    port: int,
    *,
    host_option: str = "host",
    port_option: str = "port",
    infos: Infos | None = None,
    check: bool = False,
) -> list[socket.socket]:
    """Bound (not yet listening) TCP sockets for ``host``:``port``, one per address ``host``
    resolves to (``infos``, when resolved already), all on one port; ConfigError naming
    ``host_option`` or ``port_option`` for a host that is no address of this host or a port
    that is taken. ``check``: a check before the real bind, which warns (a host without IPv6
    for ``::``) only once, itself."""
    if is_dual_stack(host) and (missing := _no_ipv6()) is not None:
        # "every interface" on a host whose kernel has no IPv6 (ipv6.disable=1): every
        # interface it has, as a deployment written for all hosts means
        if not check:
            logger.warning(
                "%s %r: this host has no IPv6 (%s): serving every IPv4 interface (0.0.0.0) "
                "instead", host_option, host, missing,
            )  # fmt: skip
        host, infos = "0.0.0.0", None
    if infos is None:
        infos = resolve(host, port, host_option=host_option, port_option=port_option)
    tried: list[str] = []
    cause: BaseException | None = None
    for _ in range(_PORT_TRIES):
        try:
            return _bind_all(host, port, infos, host_option, port_option)
        except _Taken as taken:
            # port 0: the free port the first address took is taken on another (another
            # family's socket holds it): every address again, on a new free port
            tried.append(f"{taken.port} on {taken.addr}")
            cause = taken.error.__cause__
            logger.debug("%s %s: %s; again on another port", port_option, host, taken.error)
    why = getattr(cause, "strerror", None) or "taken"
    raise ConfigError(
        f"{port_option} 0 on {host}: tried {_PORT_TRIES} free ports, each taken on another "
        f"address of it ({why}: {', '.join(tried)}); give a port free on every address, or "
        "a host of one address"
    ) from cause


def _no_ipv6() -> str | None:
    """Why this host cannot make an IPv6 socket (a kernel without IPv6), or None if it can."""
    try:
        socket.socket(socket.AF_INET6, socket.SOCK_STREAM).close()
    except OSError as exc:
        if exc.errno == errno.EAFNOSUPPORT:
            return exc.strerror or str(exc)
    return None


#: how many free ports ``bind_sockets`` tries for port 0 and a host of several addresses
_PORT_TRIES = 5


class _Taken(Exception):
    """Port 0's free port, taken on an address after the first (``error``: the ConfigError;
    ``port`` and ``addr``: which port, on which address)."""

    def __init__(self, error: ConfigError, port: int, addr: str) -> None:
        self.error = error
        self.port = port
        self.addr = addr


def _bind_all(
    host: str, port: int, infos: Infos, host_option: str, port_option: str
) -> list[socket.socket]:
    seen: set[tuple[int, object]] = set()
    out: list[socket.socket] = []
    try:
        for family, kind, proto, _, addr in infos:
            if (family, addr[0]) in seen:
                continue
            seen.add((family, addr[0]))
            if out:  # the port the first one took (port 0: the same free port for each)
                addr = (addr[0], out[0].getsockname()[1], *addr[2:])
            try:
                out.append(_bind(host, port, family, kind, proto, addr, host_option, port_option))
            except ConfigError as exc:
                cause = exc.__cause__
                if port == 0 and out and getattr(cause, "errno", None) == errno.EADDRINUSE:
                    raise _Taken(exc, addr[1], addr[0]) from None
                raise
    except BaseException:
        for s in out:
            s.close()
        raise
    return out


def _bind(
    host: str,
    port: int,
    family: int,
    kind: int,
    proto: int,
    addr: tuple[object, ...],
    host_option: str,
    port_option: str,
) -> socket.socket:
    try:
        sock = socket.socket(family, kind, proto)
    except OSError as exc:  # e.g. an IPv6 address on a host without IPv6
        hint = ""
        if family == socket.AF_INET6 and exc.errno == errno.EAFNOSUPPORT:
            hint = "; this host has no IPv6: give an IPv4 address (127.0.0.1, or 0.0.0.0)"
        raise ConfigError(f"{host_option} {host!r}: {exc.strerror}{hint}") from exc
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            dual = is_dual_stack(host)
            try:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0 if dual else 1)
            except OSError as exc:  # a system whose IPv6 sockets are IPv6 only, always
                logger.warning(
                    "%s %s: serving IPv6 only (this system refuses dual-stack sockets: %s); "
                    "give 0.0.0.0 for IPv4 clients", host_option, host, exc.strerror,
                )  # fmt: skip
        try:
            sock.bind(addr)
        except OSError as exc:
            if exc.errno in (errno.EADDRNOTAVAIL, errno.EINVAL):
                hint = " (a link-local IPv6 address needs its scope: fe80::1%eth0)"
                raise ConfigError(
                    f"{host_option} {host!r}: {exc.strerror}: not an address this host can "
                    f"serve on{hint if ':' in host else ''}"
                ) from exc
            why = "pick a free port (0: any free one)"
            if exc.errno == errno.EACCES:
                why = (f"ports below {_unprivileged_start()} need root or CAP_NET_BIND_SERVICE; "
                       "pick one above (0: any free one)")  # fmt: skip
            raise ConfigError(f"{port_option} {port} on {host}: {exc.strerror}; {why}") from exc
    except BaseException:
        sock.close()
        raise
    return sock
