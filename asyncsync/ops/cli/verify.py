"""``asyncsync verify``: is a LocalCheckpoint directory bit-exact at a version?"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncsync.errors import ConfigError
from asyncsync.format.store import read_manifest
from asyncsync.fsio import FileLock
from asyncsync.ops.cli.common import check_root, non_negative_int

__all__ = ["VerifyReport", "cmd_verify", "register", "verify_checkpoint_dir"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VerifyReport:
    """Outcome of checking a checkpoint directory against one version's manifest."""

    directory: Path
    version: int
    tensors: int
    mismatched: list[str] = field(default_factory=list)
    note: str | None = None  # e.g. redo records held beside the files

    @property
    def ok(self) -> bool:
        return not self.mismatched

    def describe(self) -> str:
        if self.ok:
            return (
                f"OK: {self.directory} is bit-exact at version {self.version} "
                f"({self.tensors} tensors)" + (f"; {self.note}" if self.note else "")
            )
        return (
            f"MISMATCH: {self.directory} differs from version {self.version} in "
            f"{len(self.mismatched)} of {self.tensors} tensors: " + ", ".join(self.mismatched)
        )


def verify_checkpoint_dir(
    root: str | Path,
    checkpoint: str | Path,
    version: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> VerifyReport:
    """Check every tensor of a LocalCheckpoint directory against ``version``'s checksums.

    ``version`` defaults to the version the checkpoint's state says it holds, else the newest
    in ``root``. Read-only and lock-free: run it when no receiver is applying to the directory.
    """
    from receiver.engines.checkpoint import verify_checkpoint
    from receiver.state import LOCK_NAME, STATE_DIR_NAME, StateStore

    root, checkpoint = Path(root), Path(checkpoint)
    versions = check_root(root)
    if not checkpoint.is_dir():
        what = "is not a directory" if checkpoint.exists() else "does not exist"
        raise ConfigError(f"checkpoint directory {checkpoint} {what}")
    state = StateStore(checkpoint / STATE_DIR_NAME).load()
    if state is None and not (checkpoint / "model.safetensors.index.json").exists():
        raise ConfigError(
            f"{checkpoint} is not an asyncsync checkpoint (no {STATE_DIR_NAME}/state.json and no "
            "model.safetensors.index.json): pass the --checkpoint DIR of a receiver"
        )
    note = None
    if state is not None and state.applying:
        lock = FileLock(checkpoint / STATE_DIR_NAME / LOCK_NAME)
        if lock.taken() is False:  # its receiver is gone (killed mid-apply): no answer to wait for
            note = (
                f"its apply of v{state.target_version} was interrupted (no receiver holds it): "
                f"its files may mix v{state.version} and v{state.target_version} until a "
                f"receiver opens it again, which rolls them back to v{state.version} (then "
                "verify again)"
            )
            logger.warning("%s: %s", checkpoint, note)
        elif version is None:
            logger.warning(
                "%s is in the middle of applying version %s: stop its receiver for a stable answer",
                checkpoint,
                state.target_version,
            )
    if version is None:
        if state is not None and state.version is not None:
            version = state.version  # the files' (redo records held on top: not merged yet)
        elif versions:
            version = versions[-1]
        else:
            raise ConfigError(f"{root} has no committed version to verify against")
    try:
        manifest = read_manifest(root, version)
    except FileNotFoundError:
        raise ConfigError(
            f"version {version} is not committed in {root}; pass --version with one that is"
        ) from None
    if state is not None and state.run_id is not None and state.run_id != manifest.run_id:
        raise ConfigError(
            f"{checkpoint} holds version {state.version} of run {state.run_id}, but {root} is "
            f"run {manifest.run_id} (the publisher started over): the checkpoint is of another "
            "run; its receiver re-initialises it from the root's newest keyframe"
        )
    if state is not None and state.redo:
        held = [v for v, _ in state.redo]
        redo = (
            f"{len(held)} redo records (v{held[0]}..v{held[-1]}) are held beside the files, not "
            f"merged into them yet: the files are at v{state.version}, the receiver holds "
            f"v{held[-1]} (it merges them when idle, at its next start or stop; no server may "
            "load the files meanwhile)"
        )
        logger.warning("%s: %s", checkpoint, redo)
        note = f"{note}; {redo}" if note else redo
        if version != state.version:
            raise ConfigError(
                f"{checkpoint}: its files are at v{state.version}, not v{version}: {note}; "
                f"verify v{state.version}, or once the records are merged"
            )
    bad = verify_checkpoint(checkpoint, manifest, progress=progress)
    return VerifyReport(checkpoint, version, len(manifest.tensors), list(bad), note)


def cmd_verify(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    # a bar on a terminal (tensor by tensor: a large checkpoint takes minutes), nothing in logs
    with tqdm(desc="verify", unit="tensor", file=sys.stderr, leave=False,
              disable=not sys.stderr.isatty()) as bar:  # fmt: skip

        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        report = verify_checkpoint_dir(args.root, args.checkpoint, args.version, progress)
    if report.ok:
        print(report.describe())
        return 0
    if report.note:
        print(f"note: {report.note}")
    print(
        f"MISMATCH: {report.directory} differs from version {report.version} in "
        f"{len(report.mismatched)} of {report.tensors} tensors:"
    )
    for name in report.mismatched:
        print(f"  {name}")
    return 1


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    sp = sub.add_parser(
        "verify", parents=[common], help="check a LocalCheckpoint directory bit for bit"
    )
    sp.add_argument("root", metavar="ROOT", help="the shared root")
    sp.add_argument("--checkpoint", required=True, metavar="DIR", help="the checkpoint directory")
    sp.add_argument(
        "--version",
        type=non_negative_int,
        default=None,
        metavar="N",
        help="version to check against (default: the one the checkpoint holds, else the newest)",
    )
    sp.set_defaults(func=cmd_verify)
