"""The manifest log: ``ROOT/log.jsonl``, one JSON line per committed version, append-only.

It is for operators (``asyncsync tail -f``); receivers never depend on it. A line is appended
after the manifest is durable, so the log may lag a crash by one version but never lists a
version that is not committed. Lines that do not parse (a torn last line after a crash) are
skipped by readers; ``asyncsync tail``, with ``-f`` or without, says so in one line each.

Retention trims it (:func:`trim_log`): the lines of deleted versions are dropped by writing
the rest to a new file that replaces the log atomically (FORMAT.md section 6), so the log
grows with the versions kept, not with the versions ever published.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import stat
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from asyncsync.errors import FormatError, check_poll_interval
from asyncsync.format import LOG_NAME, Manifest
from asyncsync.format.notices import NoticeCap
from asyncsync.fsio import append_bytes, append_line, atomic_write, lstat, open_file

__all__ = [
    "MAX_LINE_BYTES",
    "MAX_LOG_BYTES",
    "MAX_SKIP_NOTICES",
    "append_manifest",
    "follow_log",
    "parse_record",
    "read_log",
    "trim_log",
]

logger = logging.getLogger(__name__)

# The largest log a reader or the trimmer reads whole (trimmed with the versions, a log holds
# ~300 bytes per kept version). Like every file of a root it is opened through asyncsync.fsio:
# a log that is a symlink or a FIFO is refused (UnsafePath), never followed nor waited on.
MAX_LOG_BYTES = 256 << 20
# The longest line a reader keeps (a log line is a few hundred bytes): a longer one is skipped
# up to its newline, its bytes never held (one warning), so a reader's memory stays bounded.
MAX_LINE_BYTES = 1 << 20
_READ_BYTES = 4 << 20  # a reader's reads
_HEAD_BYTES = 256  # the first bytes of the log a follower compares, to see it made again
# The skipped-line notices a reader says (`tail`: of its one read of the log; `tail -f`: of each
# minute, SKIP_NOTICE_WINDOW): the rest are counted in one more line at the end of the read or
# poll, said again at most once a window (3 MB of random bytes is ~11,000 such lines; a steady
# stream of them gave `tail -f` 21 lines at every poll).
MAX_SKIP_NOTICES = 20
SKIP_NOTICE_WINDOW = 60.0


def append_manifest(root: Path, manifest: Manifest) -> None:
    """Append the manifest's line to the log; after a last line torn by a machine crash (no
    newline), on a line of its own, so that the torn line does not swallow it."""
    line = json.dumps(manifest.log_record(), allow_nan=False)
    if _ends_torn(root / LOG_NAME, root):
        append_bytes(root / LOG_NAME, b"\n" + line.encode() + b"\n", root=root)
    else:
        append_line(root / LOG_NAME, line, root=root)


def _ends_torn(path: Path, root: Path) -> bool:
    """Whether the log's last byte is no newline (False for a missing or empty log)."""
    try:
        fd = open_file(path, root=root)
    except FileNotFoundError:
        return False
    try:
        size = os.fstat(fd).st_size
        return size > 0 and os.pread(fd, 1, size - 1) != b"\n"
    finally:
        os.close(fd)


#: the fields of a log line (``Manifest.log_record``) and the types a reader accepts for each;
#: a line with one of them of another type is skipped like a line that does not parse
_COUNTS = ("changed", "elements", "wire_bytes", "delta_bytes", "shards")
_TEXTS = ("kind", "run_id", "fingerprint")
MAX_TIME = 253402300799  # 9999-12-31: what datetime can show


def _whole(v: Any, optional: bool = False) -> bool:
    if optional and v is None:
        return True
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63


def _real(v: Any, high: float) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= high


def parse_record(line: str | bytes) -> dict[str, Any] | None:
    """One log line as a record, or None: not JSON (a torn last line after a crash), NaN or
    Infinity, nested too deep to parse, not an object, no whole ``version``, or a known field
    of another type than the publisher writes (any receiver host may write the root: a forged
    line must not reach an operator's display or the publisher's recovery as a crash)."""
    try:
        rec = json.loads(line, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return None
    if not isinstance(rec, dict) or not _whole(rec.get("version")):
        return None
    ok = (
        all(_whole(rec[k]) for k in _COUNTS if k in rec)
        and all(isinstance(rec[k], str) for k in _TEXTS if k in rec)
        and _whole(rec.get("base_version"), optional=True)
        and ("density" not in rec or _real(rec["density"], 1.0))
        and ("committed_at" not in rec or _real(rec["committed_at"], MAX_TIME))
    )
    return rec if ok else None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _parse_lines_one(line: str | bytes) -> dict[str, Any] | None:
    if not line.strip():
        return None
    rec = parse_record(line)
    if rec is None:
        logger.debug("skipping unreadable log line %r", line[:80])
    return rec


def _not_a_record(raw: bytes) -> str:
    """What a reader says of a whole line that is no log record (its start, escaped)."""
    return f"{LOG_NAME}: skipped a line that is not a log record: {raw[:80]!r}"


def _overlong(at: int) -> str:
    """What a reader says of a line longer than ``MAX_LINE_BYTES`` (at byte ``at``)."""
    return f"{LOG_NAME}: skipped a line longer than {MAX_LINE_BYTES} bytes (at byte {at})"


def _skips(say: Callable[[str], None] | None) -> NoticeCap:
    """The skipped-line notices of a reader: the first ``MAX_SKIP_NOTICES`` of a minute."""
    return NoticeCap(
        say,
        lambda more: f"{LOG_NAME}: and {more} more lines skipped (no log records, or too long)",
        limit=MAX_SKIP_NOTICES,
        window=SKIP_NOTICE_WINDOW,
    )


def read_log(root: Path, notice: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """The records of the log, [] when there is none. FormatError when it is larger than
    ``MAX_LOG_BYTES`` (a reader never reads more; retention keeps a log far smaller).

    The log is read in chunks and split into lines as :func:`follow_log` splits them (at
    newline bytes only): a line longer than ``MAX_LINE_BYTES`` is skipped without its bytes
    being held. ``notice``, when given, gets one line, as :func:`follow_log` says it, for each
    such line and each whole line that is no log record (the first ``MAX_SKIP_NOTICES``, then
    one line with how many more); an unfinished last line (an append
    under way, a line torn by a crash) is read if it parses and skipped without a word if it
    does not."""
    path = root / LOG_NAME
    try:
        f = os.fdopen(open_file(path, root=root), "rb")
    except FileNotFoundError:
        return []
    lines, out, offset, skips = _Lines(), [], 0, _skips(notice)
    with f:
        if os.fstat(f.fileno()).st_size > MAX_LOG_BYTES:
            raise _too_large(path)
        while chunk := f.read(_READ_BYTES):
            got = lines.feed(chunk, offset)
            offset += len(chunk)
            if offset > MAX_LOG_BYTES:  # it grew meanwhile
                raise _too_large(path)
            for at, _key in lines.overlong:
                skips(_overlong(at))
            lines.overlong.clear()
            for raw in got:
                rec = _parse_lines_one(raw.decode("utf-8", errors="replace"))
                if rec is not None:
                    out.append(rec)
                elif raw.strip():
                    skips(_not_a_record(raw))
            del chunk, got  # before the next read: one read's bytes held at a time
    skips.done()
    if (rec := _parse_lines_one(lines.buf.decode("utf-8", errors="replace"))) is not None:
        out.append(rec)
    return out


def _too_large(path: Path) -> FormatError:
    return FormatError(
        f"{path} is larger than {MAX_LOG_BYTES} bytes, the most a reader reads: move it away "
        "(receivers never read it; the publisher starts a new one)"
    )


def _line_version(line: bytes) -> int | None:
    rec = parse_record(line)
    return None if rec is None else int(rec["version"])


def trim_log(root: Path, first_kept: int) -> int:
    """Drop the lines of versions below ``first_kept``; return how many were dropped.

    The kept lines go to a new file that atomically replaces the log. A line the publisher
    appends meanwhile lands in the old file, which is still open here: it is copied over
    after the rename. An unparseable line is kept unless a complete line follows it.
    """
    path = root / LOG_NAME
    try:
        f = os.fdopen(open_file(path, root=root), "rb")  # held open across the replace
    except FileNotFoundError:
        return 0
    with f:
        if os.fstat(f.fileno()).st_size > MAX_LOG_BYTES:
            logger.warning("log %s is larger than %d bytes: not trimmed", path, MAX_LOG_BYTES)
            return 0
        data = f.read(MAX_LOG_BYTES + 1)
        *complete, tail = data.split(b"\n")
        keep = []
        for i, line in enumerate(complete):
            v = _line_version(line)
            if v is None:
                if line.strip() and i == len(complete) - 1:
                    keep.append(line)  # maybe a torn line: readers skip it anyway
            elif v >= first_kept:
                keep.append(line)
        dropped = len([ln for ln in complete if ln.strip()]) - len(keep)
        if dropped <= 0:
            return 0
        atomic_write(path, b"".join(ln + b"\n" for ln in keep) + tail, root=root)
        late = os.pread(f.fileno(), 1 << 24, len(data))  # appended before the rename
    if late:
        append_bytes(path, late, root=root)
    logger.info("log %s: dropped %d lines of versions below %d", path, dropped, first_kept)
    return dropped


def _stat(path: Path, root: Path) -> tuple[int, tuple[int, int]]:
    """(size, (device, inode)) of the log, (0, (0, 0)) when there is none; UnsafePath for a
    symlink or FIFO."""
    st = lstat(path, root=root)
    if st is None:
        return 0, (0, 0)
    if not stat.S_ISREG(st.st_mode):
        open_file(path, root=root)  # raises UnsafePath naming what it is
    return st.st_size, (st.st_dev, st.st_ino)


def _read_at(path: Path, root: Path, offset: int, n: int) -> bytes:
    fd = open_file(path, root=root)
    try:
        return os.pread(fd, n, offset)
    finally:
        os.close(fd)


def _read_lines(
    path: Path, root: Path, offset: int, n: int, lines: _Lines, head: int
) -> tuple[int, bytes, list[bytes]]:
    """Read up to ``n`` bytes of the log at ``offset`` and feed them to ``lines``: (how many
    were read, the first ``head`` of them, the whole lines they end). One thread call for both,
    so that the chunk is dropped before it returns: a follower holds one read's bytes at a
    time, never the last one's while it makes the next (nor does an executor worker late to
    drop its result: `tail -f` held up to four 4 MiB reads under load)."""
    chunk = _read_at(path, root, offset, n)
    return len(chunk), chunk[:head], lines.feed(chunk, offset)


def _read_head(path: Path, root: Path, n: int) -> bytes:
    """The first ``n`` bytes of the log (b"" when there is none): a file made again under the
    same inode number (the root wiped and seeded again) starts with other bytes."""
    try:
        fd = open_file(path, root=root)
    except FileNotFoundError:
        return b""
    try:
        return os.pread(fd, n, 0)
    finally:
        os.close(fd)


def _open_as(path: Path, root: Path, ident: tuple[int, int]) -> int | None:
    """The log opened, if it is still the file ``ident`` names (None otherwise, or gone)."""
    try:
        fd = open_file(path, root=root)
    except FileNotFoundError:
        return None
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) == ident:
        return fd
    os.close(fd)
    return None


def _drain(fd: int, offset: int, lines: _Lines) -> tuple[int, list[bytes]]:
    """Read a held log at ``offset`` and feed the bytes to ``lines``: (how many, whole lines)."""
    chunk = os.pread(fd, _READ_BYTES, offset)
    return len(chunk), lines.feed(chunk, offset)


class _Lines:
    """Whole lines out of a file's bytes fed in order. Only the unfinished last line is kept,
    and at most ``MAX_LINE_BYTES`` of it: a longer line is dropped up to its newline without
    keeping its bytes (a log line is a few hundred bytes), and counted in ``overlong`` with the
    offset it starts at and the hash of its first ``MAX_LINE_BYTES + 1`` bytes (which name it
    in a replaced log, as a kept line's hash does: longer than any kept line, never one)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.buf = b""
        self.start = 0  # the offset in the file of the line being gathered
        self.skipping = False
        self.overlong: list[tuple[int, int]] = []  # (offset, hash of its start)

    def feed(self, chunk: bytes, offset: int) -> list[bytes]:
        out = []
        pos = 0
        if not self.buf and not self.skipping:
            self.start = offset
        while (i := chunk.find(b"\n", pos)) >= 0:
            if self.skipping:  # the end of a line already counted: its bytes are never copied
                pass
            elif len(self.buf) + i - pos > MAX_LINE_BYTES:
                head = self.buf + chunk[pos : pos + MAX_LINE_BYTES + 1 - len(self.buf)]
                self.overlong.append((self.start, hash(head)))
            else:
                out.append(chunk[pos:i] if not self.buf else self.buf + chunk[pos:i])
            self.buf, self.skipping = b"", False
            pos = i + 1
            self.start = offset + pos
        if not self.skipping and len(self.buf) + len(chunk) - pos > MAX_LINE_BYTES:
            head = self.buf + chunk[pos : pos + MAX_LINE_BYTES + 1 - len(self.buf)]
            self.overlong.append((self.start, hash(head)))
            self.buf, self.skipping = b"", True
        elif not self.skipping and pos < len(chunk):
            self.buf += chunk[pos:]
        return out


def follow_log(
    root: Path,
    *,
    poll_interval: float = 0.5,
    from_start: bool = True,
    notice: Callable[[str], None] | None = None,
) -> AsyncIterator[dict[str, Any]]:
    """An async iterator of the log's records as they are appended (polling: NFS, FUSE too).

    A log replaced (a trim, the root wiped and seeded again, a restore) or truncated is read
    again from its start: its lines that were in the file it replaced, byte for byte, are not
    yielded again (a trim keeps the lines of the versions it keeps), every other line is, so a
    forged or stray line never hides a later one. The file read is held open, and read to its
    end before that: lines appended just before it was renamed away are not lost. ``notice``
    (default: a logged warning) gets one line when a new run's records follow another run's,
    and when a line that is no record or is longer than ``MAX_LINE_BYTES`` is skipped: once,
    not again for the same line in a log that replaced it, the first ``MAX_SKIP_NOTICES`` of
    each minute, then one line with how many more (at most one such line a minute).
    ``poll_interval`` is checked as the call is made (at least ``MIN_POLL_SECONDS``, 0.01).
    """
    check_poll_interval("follow_log: poll_interval", poll_interval)
    return _follow(root, poll_interval, from_start, notice)


async def _follow(
    root: Path,
    poll_interval: float,
    from_start: bool,
    notice: Callable[[str], None] | None,
) -> AsyncIterator[dict[str, Any]]:
    say = notice or logger.warning
    skips = _skips(say)  # the skipped-line notices of a poll
    path = root / LOG_NAME
    offset = 0
    lines = _Lines()
    ident: tuple[int, int] | None = None  # (device, inode) of the file read
    fd: int | None = None  # that file, held: its last lines are read once it is moved away
    head = b""  # its first bytes, once read
    seen: set[int] = set()  # hashes of the lines of the file read
    shown: set[int] = set()  # ... of the file it replaced: not yielded again
    replaced = False  # since the last record yielded
    run: str | None = None  # the run of the last record yielded

    def take(got: list[bytes]) -> list[dict[str, Any]]:
        """The records of whole lines read, the notices said."""
        nonlocal replaced, run
        out = []
        for at, key in lines.overlong:
            seen.add(key)
            if key not in shown:  # said before the log was replaced (a trim keeps it)
                skips(_overlong(at))
        lines.overlong.clear()
        for raw in got:
            if not raw.strip():
                continue
            key = hash(raw.strip())
            seen.add(key)
            if key in shown:
                continue  # shown before the log was replaced (a trim keeps its lines)
            rec = _parse_lines_one(raw.decode("utf-8", errors="replace"))
            if rec is None:  # not JSON, not a record (a raw control byte in a string...)
                skips(_not_a_record(raw))
                continue
            new_run = rec.get("run_id")
            if isinstance(new_run, str):
                if run is not None and new_run != run:
                    how = "was replaced" if replaced else "goes on with another run"
                    say(f"{LOG_NAME} {how} (new run {new_run})")
                run = new_run
            replaced = False
            out.append(rec)
        got.clear()  # (an executor worker may still hold the list)
        return out

    if not from_start:
        offset, ident = await asyncio.to_thread(_stat, path, root)
        head = await asyncio.to_thread(_read_head, path, root, min(offset, _HEAD_BYTES))
    try:
        while True:
            size, now = await asyncio.to_thread(_stat, path, root)
            if fd is not None and now != ident:  # moved away, removed or replaced: its last
                while True:  # lines first (a rotation right after an append lost them)
                    nread, got = await asyncio.to_thread(_drain, fd, offset, lines)
                    if not nread:
                        break
                    offset += nread
                    for rec in take(got):
                        yield rec
                os.close(fd)
                fd = None
            if now == (0, 0):
                now = ident or now
            remade = size > offset > 0 and (  # made again under the same inode number
                await asyncio.to_thread(_read_head, path, root, len(head)) != head
            )
            if remade or size < offset or ident not in (None, now):  # replaced, truncated: anew
                offset = 0
                lines.reset()
                head = b""
                if seen:
                    shown, seen = seen, set()
                replaced = True
            ident = now
            if fd is None and now != (0, 0):
                fd = await asyncio.to_thread(_open_as, path, root, now)
            while size > offset:
                n = min(size - offset, _READ_BYTES)
                want = _HEAD_BYTES - len(head) if offset == len(head) < _HEAD_BYTES else 0
                try:
                    nread, start, got = await asyncio.to_thread(
                        _read_lines, path, root, offset, n, lines, want
                    )
                except FileNotFoundError:  # removed since the stat: the next poll sees it gone
                    break
                if not nread:
                    break
                head += start
                offset += nread
                for rec in take(got):
                    yield rec
            skips.done()
            await asyncio.sleep(poll_interval)
    finally:
        if fd is not None:
            os.close(fd)
