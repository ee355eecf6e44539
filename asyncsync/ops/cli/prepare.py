"""``asyncsync prepare ROOT --group G``: let receivers under other uids write their acks and leases.

A receiver writes ``ROOT/acks/<engine_id>.json`` and ``ROOT/leases/`` (FORMAT.md section 7).
When it runs as another uid than the publisher (a non-root container, a systemd
``DynamicUser``, a k8s ``runAsUser``), those two directories must be writable for it: this
command creates them (and the root, if missing) with the group ``G`` and mode ``2775``.
Everything else in the root stays ``0644``/``0755``: receivers only read it. It is the one
subcommand that writes; run it once, as the publisher's uid or root, before the receivers start.
An existing root that the group may not read and enter (``mkdir`` under umask 077 makes it
``0700``) is refused, naming the ``chmod`` that fixes it, before anything is created.
"""

from __future__ import annotations

import argparse
import os
import stat
from pathlib import Path
from typing import Any

from asyncsync.errors import ConfigError
from asyncsync.format.store import MAX_GID

__all__ = ["cmd_prepare", "group_spec", "register"]


def cmd_prepare(args: argparse.Namespace) -> int:
    from asyncsync.format.store import not_a_root, prepare_shared_dirs

    root = Path(args.root)
    if root.exists() and not root.is_dir():
        raise ConfigError(f"{root} is not a directory: give the shared root's directory")
    foreign = not_a_root(root) if root.is_dir() else []
    if foreign:
        raise ConfigError(
            f"{root} is not an asyncsync root and not empty (it holds "
            f"{', '.join(foreign[:5])}): pass the directory given to Publisher(...)"
        )
    for d in prepare_shared_dirs(root, args.group):
        st = os.lstat(d)  # a real directory: prepare_shared_dirs refused anything else
        print(f"{d}: group {st.st_gid}, mode {stat.S_IMODE(st.st_mode):04o}")
    return 0


def group_spec(text: str) -> str | int:
    """An argparse type: a gid (ASCII digits, 0 to :data:`MAX_GID`) or a group name. A number
    outside that range, or digits of another script (``int("٣")`` is 3), is a usage error."""
    if not text.isdigit():
        return text  # a name: looked up (before anything is created) by prepare_shared_dirs
    if not text.isascii():
        raise argparse.ArgumentTypeError(f"a gid is ASCII digits, got {text!r}")
    if len(text) > 10 or int(text) > MAX_GID:  # 4294967295 is (gid_t)-1: "leave unchanged"
        raise argparse.ArgumentTypeError(f"gid {text} is out of range: give 0 to {MAX_GID}")
    return int(text)


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    sp = sub.add_parser(
        "prepare",
        parents=[common],
        help="make ROOT/acks and ROOT/leases writable for a group (receivers under other uids)",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    sp.add_argument("root", metavar="ROOT", help="the shared root (created if missing)")
    sp.add_argument(
        "--group", required=True, metavar="G", type=group_spec,
        help="the group (name or gid) the receivers run with",
    )  # fmt: skip
    sp.set_defaults(func=cmd_prepare)
