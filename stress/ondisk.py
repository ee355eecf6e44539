"""What a kill left on disk, and the invariants a root must keep whatever the kill hit.

Named ``ondisk`` (not ``inspect``) so that running ``python stress/crash.py`` never shadows a
standard-library module with one of ours.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from asyncsync.codec.shards import parse_shard
from asyncsync.errors import AsyncSyncError
from asyncsync.format import MANIFEST_NAME, parse_version_dir, version_dir
from asyncsync.format.checksum import checksum_bytes, checksum_tensor
from asyncsync.format.log import read_log
from asyncsync.format.store import list_versions, read_manifest, read_root_info
from asyncsync.fsio import is_temp_name

__all__ = ["Leftovers", "RootChecker", "leftovers", "state_diff", "temp_files"]

StateFn = Callable[[int], dict[str, torch.Tensor]]


def temp_files(directory: Path) -> list[Path]:
    """Temp files (``.tmp.*``) anywhere under ``directory``."""
    out = []
    for dirpath, _dirs, files in os.walk(directory):
        out += [Path(dirpath) / f for f in files if is_temp_name(f)]
    return sorted(out)


@dataclass(frozen=True)
class Leftovers:
    """Traces of an interrupted publish in a root."""

    uncommitted: dict[int, list[str]]  # version -> files in its directory (no manifest.json)
    temps: list[Path]
    log_lag: int  # committed versions missing from the end of log.jsonl

    @property
    def mid_publish(self) -> bool:
        return bool(self.uncommitted or self.temps or self.log_lag)

    @property
    def clean(self) -> bool:
        return not (self.uncommitted or self.temps)


def leftovers(root: Path) -> Leftovers:
    uncommitted: dict[int, list[str]] = {}
    for e in os.scandir(root):
        v = parse_version_dir(e.name)
        if v is not None and e.is_dir(follow_symlinks=False):
            names = sorted(os.listdir(e.path))
            if MANIFEST_NAME not in names:
                uncommitted[v] = names
    versions = list_versions(root)
    logged = [r.get("version") for r in read_log(root)]
    last_logged = max((v for v in logged if isinstance(v, int)), default=-1)
    lag = sum(1 for v in versions if v > last_logged)
    return Leftovers(uncommitted, temp_files(root), lag)


@dataclass
class RootChecker:
    """Checks the invariants of a publisher root after each kill.

    Every committed version's manifest validates and names this root's run; every shard it
    names exists with the right size, checksum and header metadata; its tensors are exactly
    ``state(v)`` (when ``state`` is given); committed versions are 0..N without holes and never
    change or disappear afterwards; the log lists only committed versions, in order.
    """

    root: Path
    state: StateFn | None = None
    seen: dict[int, str] = field(default_factory=dict)  # version -> checksum of its manifest

    def check(self) -> list[str]:
        """The invariants that do not hold (empty: all good)."""
        bad: list[str] = []
        info = read_root_info(self.root)
        if info is None:
            return [f"{self.root}: no asyncsync.json"]
        versions = list_versions(self.root)
        if versions != list(range(len(versions))):
            bad.append(f"committed versions are not 0..N without holes: {versions}")
        gone = sorted(set(self.seen) - set(versions))
        if gone:
            bad.append(f"committed versions disappeared: {gone}")
        for v in versions:
            bad += self._check_version(v, info.run_id)
        committed = set(versions)
        last = -1
        for rec in read_log(self.root):
            lv = rec.get("version")
            if not isinstance(lv, int) or lv not in committed:
                bad.append(f"log.jsonl lists version {lv!r}, which is not committed")
            elif lv <= last:
                bad.append(f"log.jsonl lists version {lv} after {last}")
            else:
                last = lv
        return bad

    def _check_version(self, v: int, run_id: str) -> list[str]:
        mpath = version_dir(self.root, v) / MANIFEST_NAME
        try:
            raw = mpath.read_bytes()
            m = read_manifest(self.root, v)
        except (OSError, AsyncSyncError) as exc:
            return [f"v{v}: committed but its manifest is unreadable: {exc!r}"]
        digest = checksum_bytes(raw)
        if v in self.seen:
            return [] if self.seen[v] == digest else [f"v{v}: manifest changed after commit"]
        bad = []
        if m.run_id != run_id:
            bad.append(f"v{v}: run_id {m.run_id} is not the root's {run_id}")
        vdir = version_dir(self.root, v)
        for s in m.shards:
            path = m.shard_path(vdir, s)
            try:
                data = path.read_bytes()
            except OSError as exc:
                bad.append(f"v{v}: committed without its shard {s.file}: {exc!r}")
                continue
            if len(data) != s.bytes or checksum_bytes(data, m.checksum_algorithm) != s.checksum:
                bad.append(f"v{v}: shard {s.file} is not the bytes its manifest names")
                continue
            try:
                parse_shard(data, where=str(path), version=v, run_id=m.run_id, role=s.role)
            except AsyncSyncError as exc:
                bad.append(f"v{v}: shard {s.file}: {exc}")
        if self.state is not None:
            want = self.state(v)
            got = {e.name: e for e in m.tensors}
            if set(got) != set(want):
                bad.append(f"v{v}: tensors {sorted(set(got) ^ set(want))} differ from state(v)")
            for name, t in want.items():
                e = got.get(name)
                if e is not None and e.checksum != checksum_tensor(t, m.checksum_algorithm):
                    bad.append(f"v{v}: tensor {name!r} is not state({v})[{name!r}]")
        if not bad:
            self.seen[v] = digest
        return bad


def state_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """How ``got`` differs from ``want`` byte for byte (empty: identical)."""
    out = [f"tensor {n!r} missing" for n in sorted(set(want) - set(got))]
    out += [f"unexpected tensor {n!r}" for n in sorted(set(got) - set(want))]
    for name in sorted(set(got) & set(want)):
        a, b = got[name], want[name]
        if a.dtype != b.dtype or a.shape != b.shape:
            out.append(f"{name!r} is {a.dtype}{list(a.shape)}, want {b.dtype}{list(b.shape)}")
            continue
        ua = a.contiguous().reshape(-1).view(torch.uint8)
        ub = b.contiguous().reshape(-1).view(torch.uint8)
        if not torch.equal(ua, ub):
            out.append(f"{name!r}: {int((ua != ub).sum())} bytes differ")
    return out
