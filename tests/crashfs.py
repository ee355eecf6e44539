"""Crash states of a recorded window of filesystem calls, ALICE-style (tests/test_durability.py).

:class:`Recorder` wraps the ``os`` calls asyncsync makes (``open`` with ``O_CREAT``, ``fsync``
of files and directories, ``rename``/``replace``, ``link``, ``unlink``, ``mkdir``, ``rmdir``)
and, after each one, walks the watched trees: the names each directory holds (by inode) and the
bytes of every file. Directory changes are taken from the difference between two walks, so a
file a library creates without ``os.open`` (safetensors writes in Rust) is seen too, and the
rename of one call is kept as one atomic change. Every call is a crash point.

The persistence model (:func:`crash_states`), a weak POSIX one:

* a file's bytes are durable only after an ``fsync`` of that file (or of its mmap); before
  that a crash leaves the last durable bytes, the bytes at the crash, or a torn mix of the two
  (a prefix of the new bytes for a file that grew, alternate 4 KiB pages of old and new for a
  file rewritten in place);
* a directory entry change (create, rename, link, unlink, mkdir, rmdir) is durable only after
  an ``fsync`` of its directory; until then *any subset* of one directory's pending changes may
  have reached the disk, in any order (ALICE's weaker model, not its default "directory
  operations persist in order"); a rename is atomic, also across two directories (the fsync
  of either makes all of it durable);
* the state before the window is durable.

For each crash point every combination of (subset of each directory's pending changes) x
(bytes of each file not yet durable) is a crash state. When a crash point has more than
``cap`` of them, the all-or-nothing ones and ``cap`` draws of a ``random.Random(seed)`` are
taken. :func:`materialise` writes one as a real tree.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

PAGE = 4096
_NAMES = ("open", "fsync", "replace", "rename", "link", "unlink", "mkdir", "rmdir")


@dataclass
class Walk:
    """The logical tree after one call: directory -> name -> inode; inode -> bytes digest."""

    entries: dict[str, dict[str, int]]
    dirs: set[int]
    data: dict[int, str]


@dataclass(frozen=True)
class Change:
    """One entry of a directory set (``ino``) or removed (``ino`` None)."""

    directory: str
    name: str
    ino: int | None


@dataclass
class Window:
    """What the recorder saw: the walk before the first call, then per call its events."""

    base: Walk
    # per call: (the call as recorded, [event]) with event one of
    #   ("dirop", group id, [Change]), ("fsync", ino, digest), ("fsync_dir", directory)
    calls: list[tuple[tuple[str, ...], list[tuple[Any, ...]]]] = field(default_factory=list)
    after: list[Walk] = field(default_factory=list)  # the walk after each call
    blobs: dict[str, bytes] = field(default_factory=dict)


class Recorder:
    """Records the calls of the module docstring, and the trees under ``watched`` after each.

    ``ops`` keeps the plain call log (as tuples of kind and paths) for the ordering rules."""

    def __init__(self, *watched: Path) -> None:
        self.watched = [os.path.realpath(p) for p in watched]
        self.ops: list[tuple[str, ...]] = []
        self._lock = threading.RLock()
        self._gid = itertools.count()
        self._ids: dict[int, int] = {}  # inode number -> identity (numbers are reused)
        self._next_id = itertools.count()
        self.window = Window(Walk({}, set(), {}))
        self.window.base = self._walk(self.window)
        self._last = self.window.base

    # -- walking ---------------------------------------------------------------------------
    def _blob(self, w: Window, data: bytes) -> str:
        d = hashlib.blake2b(data, digest_size=16).hexdigest()
        w.blobs.setdefault(d, data)
        return d

    def _id(self, ino: int) -> int:
        if ino not in self._ids:
            self._ids[ino] = next(self._next_id)
        return self._ids[ino]

    def _walk(self, w: Window) -> Walk:
        """The trees now; an inode number no longer seen gets a new identity when reused."""
        out = Walk({}, set(), {})
        seen: set[int] = set()
        todo = [p for p in self.watched if os.path.isdir(p)]
        while todo:
            d = todo.pop()
            names: dict[str, int] = {}
            try:
                with os.scandir(d) as it:
                    listing = list(it)
            except OSError:
                continue
            for e in listing:
                try:
                    st = e.stat(follow_symlinks=False)
                    ident = self._id(st.st_ino)
                    if e.is_dir(follow_symlinks=False):
                        out.dirs.add(ident)
                        todo.append(e.path)
                    elif ident not in out.data:
                        with open(e.path, "rb") as f:
                            out.data[ident] = self._blob(w, f.read())
                except OSError:
                    continue  # vanished meanwhile
                seen.add(st.st_ino)
                names[e.name] = ident
            out.entries[d] = names
        for ino in set(self._ids) - seen:
            del self._ids[ino]
        return out

    def _watched(self, p: str) -> bool:
        return any(p == r or p.startswith(r + os.sep) for r in self.watched)

    def _after(self, op: tuple[str, ...], events: list[tuple[Any, ...]]) -> None:
        """Called with the lock held, right after the real call ``op``."""
        self.ops.append(op)
        w = self.window
        events = [("fsync", self._id(e[1]), e[2]) if e[0] == "fsync" else e for e in events]
        now = self._walk(w)
        mine = set(op[1:]) if op[0] != "fsync" and op[0] != "fsync_dir" else set()
        own: list[Change] = []
        for d in sorted(set(self._last.entries) | set(now.entries)):
            a, b = self._last.entries.get(d, {}), now.entries.get(d, {})
            for name in sorted(set(a) | set(b)):
                if a.get(name) != b.get(name):
                    c = Change(d, name, b.get(name))
                    if os.path.join(d, name) in mine:
                        own.append(c)
                    else:  # another thread's, or a file made without os.open
                        events.insert(0, ("dirop", next(self._gid), [c]))
        if own:
            events.append(("dirop", next(self._gid), own))
        w.calls.append((op, events))
        w.after.append(now)
        self._last = now

    @staticmethod
    def _path(path: Any, dir_fd: int | None = None) -> str:
        p = os.fsdecode(path)
        if dir_fd is not None and not os.path.isabs(p):
            p = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), p)
        d, name = os.path.split(os.path.abspath(p))
        return os.path.join(os.path.realpath(d), name)

    # -- the wrappers ----------------------------------------------------------------------
    def install(self, mp: pytest.MonkeyPatch) -> None:
        real = {n: getattr(os, n) for n in _NAMES}
        lock = self._lock

        def open_(path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
            with lock:
                fd = real["open"](path, flags, mode, dir_fd=dir_fd)
                p = self._path(path, dir_fd)
                if flags & os.O_CREAT and self._watched(p):
                    self._after(("create", p), [])
                return fd

        def fsync(fd: int) -> None:
            with lock:
                real["fsync"](fd)
                p = os.readlink(f"/proc/self/fd/{fd}")
                if not self._watched(p):
                    return
                if os.path.isdir(p):
                    self._after(("fsync_dir", p), [("fsync_dir", p)])
                    return
                st = os.fstat(fd)
                with open(f"/proc/self/fd/{fd}", "rb") as f:  # fd may be write-only
                    data = f.read()
                ev = ("fsync", st.st_ino, self._blob(self.window, data))
                self._after(("fsync", p), [ev])

        def move(name: str) -> Any:
            def f(src: Any, dst: Any, **kw: Any) -> None:
                with lock:
                    s = self._path(src, kw.get("src_dir_fd"))
                    d = self._path(dst, kw.get("dst_dir_fd"))
                    real[name](src, dst, **kw)
                    if self._watched(d):
                        self._after(("rename" if name != "link" else "link", s, d), [])

            return f

        def one(name: str) -> Any:
            def f(path: Any, *args: Any, dir_fd: int | None = None) -> None:
                with lock:
                    p = self._path(path, dir_fd)
                    real[name](path, *args, dir_fd=dir_fd)
                    if self._watched(p):
                        self._after((name, p), [])

            return f

        fns = {"open": open_, "fsync": fsync, "replace": move("replace"),
               "rename": move("rename"), "link": move("link"), "unlink": one("unlink"),
               "mkdir": one("mkdir"), "rmdir": one("rmdir")}  # fmt: skip
        for name, fn in fns.items():
            mp.setattr(os, name, fn)


# ------------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class CrashState:
    """One state the disk may hold after a crash at ``point`` (index of the last call done)."""

    point: int
    entries: dict[str, dict[str, int]]  # the durable namespace
    dirs: frozenset[int]
    data: dict[int, bytes]  # inode -> the bytes it holds
    how: str  # which choices made it, for a failure message

    def key(self) -> str:
        """Equal for states that differ only in temp files (``.tmp.*``: every reader ignores
        them and every writer removes them, docs/FORMAT.md) and lock files."""
        h = hashlib.blake2b(digest_size=16)
        for root in sorted(self.entries):
            for name, ino in sorted(self.entries[root].items()):
                if name.startswith(".tmp.") or name.endswith("lock"):
                    continue
                h.update(f"{root}/{name}\0{ino in self.dirs}\0".encode())
                if ino not in self.dirs:
                    h.update(self.data.get(ino, b""))
                h.update(b"\1")
        return h.hexdigest()


def _torn(old: bytes, new: bytes) -> bytes | None:
    if len(new) > len(old) and new.startswith(old):
        cut = len(old) + (len(new) - len(old)) // 2
        return new[:cut] if cut not in (len(old), len(new)) else None
    pages = max(len(old), len(new)) // PAGE + 1
    if pages < 2:
        return None
    out = bytearray(new)
    for i in range(1, pages, 2):
        out[i * PAGE : (i + 1) * PAGE] = old[i * PAGE : (i + 1) * PAGE]
    return bytes(out[: len(new)])


def crash_states(
    w: Window, cap: int, seed: int = 0, stats: dict[str, int] | None = None
) -> Iterator[CrashState]:
    """Every crash state of ``w`` the model allows (at most about ``cap`` per crash point).

    ``stats`` (if given) counts ``allowed`` (the states the model allows, summed over crash
    points) and ``sampled_points`` (crash points with more than ``cap``)."""
    rng = random.Random(seed)
    stats = {} if stats is None else stats
    durable = {d: dict(n) for d, n in w.base.entries.items()}
    ddata = {ino: w.blobs[dg] for ino, dg in w.base.data.items()}
    pending: dict[str, list[tuple[int, Change]]] = {}
    dirs = set(w.base.dirs)
    for point, ((_op, events), walk) in enumerate(zip(w.calls, w.after, strict=True)):
        dirs |= walk.dirs
        for ev in events:
            if ev[0] == "dirop":
                for c in ev[2]:
                    pending.setdefault(c.directory, []).append((ev[1], c))
            elif ev[0] == "fsync":
                ddata[ev[1]] = w.blobs[ev[2]]
            else:  # a directory fsync: its changes, and the other half of a rename, durable
                gids = {gid for gid, _ in pending.get(ev[1], [])}
                for d in list(pending):
                    for gid, c in pending[d]:
                        if gid in gids:
                            _set(durable, c)
                    pending[d] = [(g, c) for g, c in pending[d] if g not in gids]
        current = {ino: w.blobs[dg] for ino, dg in walk.data.items()}
        yield from _states_at(
            point, durable, ddata, current, pending, frozenset(dirs), cap, rng, stats
        )


def _set(entries: dict[str, dict[str, int]], c: Change) -> None:
    names = entries.setdefault(c.directory, {})
    if c.ino is None:
        names.pop(c.name, None)
    else:
        names[c.name] = c.ino


def _states_at(
    point: int,
    durable: dict[str, dict[str, int]],
    ddata: dict[int, bytes],
    current: dict[int, bytes],
    pending: dict[str, list[tuple[int, Change]]],
    dirs: frozenset[int],
    cap: int,
    rng: random.Random,
    stats: dict[str, int],
) -> Iterator[CrashState]:
    groups = sorted({gid for ops in pending.values() for gid, _ in ops})
    changes = {gid: [c for ops in pending.values() for g, c in ops if g == gid] for gid in groups}
    dirty = sorted(i for i, b in current.items() if ddata.get(i, b"") != b)

    def options(ino: int) -> list[tuple[str, bytes]]:
        old, new = ddata.get(ino, b""), current[ino]
        torn = _torn(old, new)
        return [("old", old), ("new", new)] + ([("torn", torn)] if torn is not None else [])

    opts = {ino: options(ino) for ino in dirty}
    n_total = 2 ** len(groups)
    for ino in dirty:
        n_total *= len(opts[ino])
    picks: list[tuple[tuple[bool, ...], tuple[int, ...]]]
    stats["allowed"] = stats.get("allowed", 0) + n_total
    stats["sampled_points"] = stats.get("sampled_points", 0) + (n_total > cap)
    if n_total <= cap:
        picks = [
            (inc, ch)
            for inc in itertools.product((False, True), repeat=len(groups))
            for ch in itertools.product(*(range(len(opts[i])) for i in dirty))
        ]
    else:
        picks = [((b,) * len(groups), (c,) * len(dirty)) for b in (False, True) for c in (0, 1)]
        for _ in range(cap):
            picks.append(
                (
                    tuple(rng.random() < 0.5 for _ in groups),
                    tuple(rng.randrange(len(opts[i])) for i in dirty),
                )
            )
    for inc, ch in picks:
        entries = {d: dict(n) for d, n in durable.items()}
        for gid, on in zip(groups, inc, strict=True):
            if on:
                for c in changes[gid]:
                    _set(entries, c)
        data = dict(ddata)
        chosen = []
        for ino, k in zip(dirty, ch, strict=True):
            label, data[ino] = opts[ino][k]
            chosen.append(label)
        how = f"groups {''.join('1' if x else '0' for x in inc)} data {','.join(chosen)}"
        yield CrashState(point, entries, dirs, data, how)


def materialise(state: CrashState, mapping: dict[str, Path]) -> None:
    """Write ``state`` as real trees: each watched root of ``mapping`` to its new path."""
    for src, dst in mapping.items():
        dst.mkdir(parents=True, exist_ok=True)
        todo = [(src, dst)]
        while todo:
            s, d = todo.pop()
            for name, ino in state.entries.get(s, {}).items():
                if ino in state.dirs:
                    (d / name).mkdir()
                    todo.append((os.path.join(s, name), d / name))
                else:
                    (d / name).write_bytes(state.data.get(ino, b""))
