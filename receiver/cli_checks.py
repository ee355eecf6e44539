"""What ``asyncsync-receiver`` checks of its arguments before anything is opened: the engine
id and the status port (as argparse types), the paths, the status options and the secrets
read from files (never from the command line, where ``ps`` would show them)."""

from __future__ import annotations

import argparse
import logging
import os
import stat
from pathlib import Path

from asyncsync import fsio
from asyncsync.errors import AsyncSyncError, ConfigError
from asyncsync.format.names import check_engine_id
from receiver.acking import check_root_for_receiver
from receiver.listen import bind_sockets
from receiver.server import MIN_TOKEN_CHARS, check_token

__all__ = [
    "MAX_SECRET_BYTES",
    "MIN_TOKEN_CHARS",
    "TOKEN_ENV",
    "check_paths",
    "check_status_options",
    "engine_id_arg",
    "port_arg",
    "read_secret",
]

logger = logging.getLogger(__name__)

TOKEN_ENV = "ASYNCSYNC_RECEIVER_TOKEN"
MAX_SECRET_BYTES = 64 << 10  # a token or an API key file: a few dozen bytes in practice


def engine_id_arg(text: str) -> str:
    """``--engine-id``: checked at parse time (a bad one is bad usage, exit 2; it also names
    the receiver in every error line, which must stay one line)."""
    try:
        return check_engine_id(text)
    except AsyncSyncError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def port_arg(text: str) -> int:
    """A TCP port for argparse: 0 (any free port) to 65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} out of range 0..65535")
    return port


def check_paths(args: argparse.Namespace) -> None:
    """Refuse, before anything is opened, paths that cannot work.

    A checkpoint equal to or inside the root would write engine files into the shared root;
    a root that does not exist is an error for ``--once`` (nothing to apply) and is waited
    for, with a log line saying so, by the daemon (the trainer may create it later).
    """
    root = os.path.realpath(args.root)
    ckpt = os.path.realpath(args.checkpoint)
    if ckpt == root or ckpt.startswith(root.rstrip(os.sep) + os.sep):
        raise ConfigError(
            f"--checkpoint {args.checkpoint} is inside --root {args.root}: the checkpoint is "
            "this host's own copy; give a local directory outside the shared root"
        )
    if root.startswith(ckpt.rstrip(os.sep) + os.sep):
        raise ConfigError(f"--root {args.root} is inside --checkpoint {args.checkpoint}")
    if os.path.exists(root) and not os.path.isdir(root):
        raise ConfigError(f"--root {args.root} is not a directory")
    _no_file_above(root, args.root)
    # a file, a FIFO, a symlink to nothing there: the engine's mkdir said only "File exists"
    if os.path.lexists(args.checkpoint) and not os.path.isdir(args.checkpoint):
        kinds = {stat.S_IFLNK: "a symlink to nothing", stat.S_IFIFO: "a FIFO",
                 stat.S_IFREG: "a regular file"}  # fmt: skip
        what = kinds.get(stat.S_IFMT(os.lstat(args.checkpoint).st_mode), "a special file")
        raise ConfigError(
            f"--checkpoint {args.checkpoint} is {what}, not a directory: give the engine's "
            "checkpoint directory (made where missing)"
        )
    _no_file_above(ckpt, args.checkpoint, "--checkpoint")
    if not os.path.exists(root):
        if args.once:
            raise ConfigError(f"--root {args.root} does not exist: nothing to apply")
        logger.warning(
            "root %s does not exist (yet); waiting for the publisher to create it", args.root
        )
    # another directory (a checkpoint, a typo): refused before anything is created in it
    elif not check_root_for_receiver(Path(args.root)) and not args.once:
        logger.warning("root %s is empty; waiting for the publisher to open it", args.root)


def _no_file_above(path: str, given: str, option: str = "--root") -> None:
    """Refuse a root (or checkpoint) below a file (``FILE/sub``): it can never be created, so
    the daemon's wait for the publisher to create it would never end."""
    try:
        os.stat(path)
    except NotADirectoryError:
        above = os.path.dirname(path)
        while above != os.path.dirname(above) and not os.path.exists(above):
            above = os.path.dirname(above)  # (the deepest part that exists: the file)
        raise ConfigError(f"{option} {given}: {above} is a file, not a directory") from None
    except OSError:
        pass  # missing (waited for), or unreadable: said when it is read


def check_status_options(args: argparse.Namespace) -> str | None:
    """The control token, and the status port free: checked before the engine is opened."""
    token = read_secret(args.control_token_file, TOKEN_ENV, "--control-token-file")
    where = f"--control-token-file {args.control_token_file}" if args.control_token_file else (
        f"${TOKEN_ENV}")  # fmt: skip
    check_token(token, where)
    if args.status_port is not None:  # port 0 too: the host is checked by a bind all the same
        for sock in bind_sockets(  # as the server binds them
            args.status_host,
            args.status_port,
            host_option="--status-host",
            port_option="--status-port",
            check=True,  # (the server's bind warns, once)
        ):
            sock.close()
    return token


def read_secret(path: str | None, env: str, what: str) -> str | None:
    """A secret from a file, else from the environment; never from the command line.

    A byte order mark (a Windows editor's) is dropped; the secret must be ASCII. The file must
    be a regular file (a symlink to one is fine, as Kubernetes mounts secrets) of
    UTF-8 text of at most :data:`MAX_SECRET_BYTES`: a FIFO is refused at once, never waited on,
    and ``/dev/zero`` is not read without end. Errors name ``what`` (the option) and the file.
    """
    where = f"{what} {path}" if path else f"${env}"
    try:
        value = os.environ.get(env, "") if not path else fsio.read_bytes(
            path, limit=MAX_SECRET_BYTES, follow_symlinks=True).decode("utf-8-sig")  # fmt: skip
    except fsio.UnsafePath:
        raise ConfigError(
            f"{where} is not a regular file (a FIFO, a device or a directory?): "
            "point it at a file holding the secret"
        ) from None
    except OSError as exc:
        raise ConfigError(f"cannot read {where}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError:
        raise ConfigError(f"{where} is not UTF-8 text: it must hold the secret") from None
    except ValueError:  # larger than the limit
        raise ConfigError(
            f"{where} is larger than {MAX_SECRET_BYTES >> 10} KiB: it must hold the secret"
        ) from None
    value = value.strip()
    if not value and path:
        raise ConfigError(f"{where} is empty")
    if not value.isprintable():  # a second line, a tab, a NUL: no HTTP header can carry it
        i, c = next((i, c) for i, c in enumerate(value) if not c.isprintable())
        raise ConfigError(
            f"{where} must hold the secret alone, on one line: it holds {c!a} at character {i + 1}"
        )
    if not value.isascii():  # clients and servers encode it differently (Latin-1, UTF-8)
        raise ConfigError(
            f"{where} holds a non-ASCII character: HTTP clients and servers encode one "
            "differently, so the other side would see other bytes; use an ASCII secret"
        )
    return value or None
