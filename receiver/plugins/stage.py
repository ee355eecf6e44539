"""The staged delta: one version's change, decoded, on the engine's host, for the engine to apply.

The receiver reads, verifies and decodes a version while the engine serves; then it writes
the change here and asks the engine to apply it (one call; the engine's pause holds only the
in-place apply). The engine reads nothing else: FORMAT.md section 8's trust rules hold for it
as for a shard, so the file carries its own checksum and the reader refuses anything that does
not verify or does not parse exactly.

A stage is a directory (the receiver keeps it under ``<checkpoint>/.asyncsync/engine-stage/``)::

    delta.xor     the arrays, little-endian, each at a 64-byte aligned offset
    stage.json    written last, atomically: the stage exists once this file does

``stage.json`` (format ``asyncsync-stage``, ``format_version`` 1)::

    {"format": "asyncsync-stage", "format_version": 1,
     "target": {"version": N, "run_id": R, "fingerprint": F},    the version it makes
     "base":   {"version": B, "run_id": R, "fingerprint": G},    the version it applies to
     "checksum_algorithm": "xxh3-128",
     "data": {"file": "delta.xor", "bytes": S, "checksum": "<of the whole file>"},
     "tensors": [{"name", "dtype", "shape", "changed",
                  "positions": {"offset", "count", "dtype": "int32"|"int64"} | null,
                  "values":    {"offset", "count", "dtype": "uint8"|"int16"|"int32"|"int64"}}],
     "checksums": {name: checksum of the target's complete bytes, for EVERY tensor},
     "parts": {name: [[offset, numel], ...]}     tensors published in parts (FORMAT.md 3.1)
    }

Per changed tensor: ``positions`` are flat element indices into the HF tensor (row-major),
strictly increasing; ``values`` are the XOR of old and new bytes at those positions, as the
integer dtype of the element's width (``new = old ^ value``). ``positions: null``: dense, one
value per element. ``checksums`` and ``parts`` describe the whole target version (what the
engine holds after the apply, which its audit compares against).

:class:`StageWriter` writes one (receiver side), :func:`read_stage` reads and verifies one
(engine side). Engine-agnostic; imports no engine.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import stat
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from asyncsync import fsio
from asyncsync.codec import native
from asyncsync.errors import FormatError
from asyncsync.format.checksum import ALGORITHMS, Hasher, new_hasher
from asyncsync.format.names import dtype_from_name, dtype_name

__all__ = [
    "DATA_NAME",
    "STAGE_CAPABILITY",
    "STAGE_DIR",
    "STAGE_FORMAT",
    "STAGE_NAME",
    "Stage",
    "StageWriter",
    "StagedTensor",
    "VersionRef",
    "is_stage",
    "read_stage",
    "remove_stage",
    "stage_record",
]

STAGE_FORMAT = "asyncsync-stage"
FORMAT_VERSION = 1
STAGE_NAME = "stage.json"
STAGE_DIR = "engine-stage"  # stages live in <checkpoint>/.asyncsync/engine-stage/
#: an engine plugin that applies stages ends every answer with this (the receiver sends stages
#: only to a server whose last answer carried it: one without the plugin cannot read them)
STAGE_CAPABILITY = " [asyncsync-stage/1]"
#: not ``*.bin``: SGLang's own loader reads every ``*.bin`` of a directory as a PyTorch pickle,
#: and its scheduler dies on one that is not (a stage handed to a server without the plugin)
DATA_NAME = "delta.xor"
ALIGN = 64
MAX_STAGE_JSON = 256 << 20
_INT_BY_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_INDEX32_MAX = 2**31 - 1


@dataclass(frozen=True)
class VersionRef:
    """A version by identity: number, run and model fingerprint (FORMAT.md section 3)."""

    version: int
    run_id: str | None
    fingerprint: str | None

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "run_id": self.run_id, "fingerprint": self.fingerprint}

    @classmethod
    def from_dict(cls, d: Any, where: str) -> VersionRef:
        if not isinstance(d, dict):
            raise FormatError(f"{where}: expected an object")
        v, run, fp = d.get("version"), d.get("run_id"), d.get("fingerprint")
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise FormatError(f"{where}: version must be an int >= 0, got {v!r}")
        for k, x in (("run_id", run), ("fingerprint", fp)):
            if x is not None and not isinstance(x, str):
                raise FormatError(f"{where}: {k} must be a string or null")
        return cls(v, run, fp)

    def __str__(self) -> str:
        return f"v{self.version} (run {self.run_id}, fingerprint {self.fingerprint})"


@dataclass(frozen=True)
class StagedTensor:
    """One changed tensor: its XOR ``values`` at ``positions`` (None: dense, every element)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    changed: int
    positions: torch.Tensor | None  # int32/int64, sorted, unique, < numel
    values: torch.Tensor  # the int dtype of the element width

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def dense(self, device: Any = "cpu") -> torch.Tensor:
        """The dense XOR tensor in the HF shape: the values at the positions, zero elsewhere."""
        if self.positions is None:
            flat = self.values.to(device)
        else:
            flat = torch.zeros(self.numel, dtype=self.values.dtype, device=device)
            if not self.positions.numel():
                pass
            elif flat.device.type == "cpu":  # NumPy's scatter: no intra-op pool, int32 indices
                flat.numpy()[self.positions.numpy()] = self.values.numpy()
            else:  # positions and values copied to the device once, scattered there
                flat[self.positions.to(device, torch.int64)] = self.values.to(device)
        return flat.view(self.dtype).view(self.shape)


@dataclass(frozen=True)
class Stage:
    """A verified stage (see the module docstring)."""

    directory: Path
    target: VersionRef
    base: VersionRef
    algorithm: str
    tensors: tuple[StagedTensor, ...]
    checksums: dict[str, str]
    parts: dict[str, list[tuple[int, int]]]
    data_bytes: int
    #: the bytes of ``stage.json`` this stage was read from (they name the data's checksum)
    record: bytes = field(default=b"", repr=False, compare=False)

    def __repr__(self) -> str:
        return (
            f"<Stage {self.directory} {self.base.version}->{self.target.version} "
            f"tensors={len(self.tensors)} bytes={self.data_bytes}>"
        )


def is_stage(directory: str | os.PathLike[str]) -> bool:
    """Whether ``directory`` holds a stage (its ``stage.json``); says nothing of its validity."""
    return os.path.lexists(os.path.join(directory, STAGE_NAME))


# --------------------------------------------------------------------------- writing


class StageWriter:
    """Writes one stage (receiver side). ``add`` each changed tensor, then ``commit``.

    Example::

        w = StageWriter(dir, target=VersionRef(7, run, fp7), base=VersionRef(6, run, fp6),
                        algorithm="xxh3-128")
        w.add("w", torch.float32, (4, 4), positions, xor_values)
        w.commit(checksums_of_v7, parts_of_v7)

    Nothing is fsynced: a stage is consumed at once and verified by its checksum; after a
    crash it is discarded (:meth:`abort`, or the receiver clears the folder at start).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        target: VersionRef,
        base: VersionRef,
        algorithm: str,
    ):
        if algorithm not in ALGORITHMS:
            raise FormatError(f"unknown checksum algorithm {algorithm!r}")
        self.directory = Path(directory)
        self.target, self.base, self.algorithm = target, base, algorithm
        if self.directory.exists() or self.directory.is_symlink():
            remove_stage(self.directory)
        self.directory.mkdir(parents=True)
        self._f = open(self.directory / DATA_NAME, "wb")  # noqa: SIM115 - closed in commit/abort
        self._hash: Hasher = new_hasher(algorithm)
        self._size = 0
        self._tensors: list[dict[str, Any]] = []
        self._names: set[str] = set()

    def __repr__(self) -> str:
        return f"<StageWriter {self.directory} tensors={len(self._tensors)} bytes={self._size}>"

    @property
    def tensors(self) -> int:
        return len(self._tensors)

    @property
    def nbytes(self) -> int:
        return self._size

    def _put(self, t: torch.Tensor) -> int:
        pad = -self._size % ALIGN
        if pad:
            self._write(b"\0" * pad)
        offset = self._size
        if t.numel():
            self._write(memoryview(t.contiguous().view(torch.uint8).numpy()))  # type: ignore[arg-type]
        return offset

    def _write(self, data: bytes | memoryview) -> None:
        self._f.write(data)
        self._hash.update(data)
        self._size += len(data)

    def add(
        self,
        name: str,
        dtype: torch.dtype,
        shape: Sequence[int],
        positions: torch.Tensor | None,
        values: torch.Tensor,
    ) -> None:
        """One changed tensor: XOR ``values`` (the int dtype of ``dtype``'s width) at the
        sorted flat ``positions`` (None: dense, ``numel`` values)."""
        if name in self._names:
            raise FormatError(f"tensor {name!r} staged twice")
        shape = tuple(int(s) for s in shape)
        numel = math.prod(shape)
        want = _INT_BY_WIDTH.get(torch.empty(0, dtype=dtype).element_size())
        if values.dtype != want or values.device.type != "cpu":
            raise FormatError(f"tensor {name!r}: values must be CPU {want}, got {values.dtype}")
        values = values.reshape(-1)
        entry: dict[str, Any] = {"name": name, "dtype": dtype_name(dtype), "shape": list(shape)}
        if positions is None:
            if values.numel() != numel:
                raise FormatError(f"tensor {name!r}: dense values {values.numel()} != {numel}")
            entry["changed"] = int(torch.count_nonzero(values))
            entry["positions"] = None
        else:
            positions = positions.reshape(-1)
            if positions.numel() != values.numel():
                raise FormatError(f"tensor {name!r}: {positions.numel()} positions, "
                                  f"{values.numel()} values")  # fmt: skip
            pdt = torch.int32 if numel <= _INDEX32_MAX else torch.int64
            entry["changed"] = int(positions.numel())
            entry["positions"] = {
                "offset": self._put(positions.to(pdt)),
                "count": int(positions.numel()),
                "dtype": str(pdt).removeprefix("torch."),
            }
        entry["values"] = {
            "offset": self._put(values),
            "count": int(values.numel()),
            "dtype": str(want).removeprefix("torch."),
        }
        self._names.add(name)
        self._tensors.append(entry)

    def commit(
        self, checksums: Mapping[str, str], parts: Mapping[str, Sequence[tuple[int, int]]]
    ) -> Path:
        """Finish the data file and write ``stage.json`` (last): returns the stage directory."""
        missing = self._names - set(checksums)
        if missing:
            raise FormatError(f"staged tensors without a checksum: {sorted(missing)[:3]}")
        self._f.close()
        doc = {
            "format": STAGE_FORMAT,
            "format_version": FORMAT_VERSION,
            "target": self.target.to_dict(),
            "base": self.base.to_dict(),
            "checksum_algorithm": self.algorithm,
            "data": {"file": DATA_NAME, "bytes": self._size, "checksum": self._hash.hexdigest()},
            "tensors": self._tensors,
            "checksums": dict(checksums),
            "parts": {n: [list(p) for p in v] for n, v in parts.items()},
            "created_at": time.time(),
        }
        fsio.atomic_write(
            self.directory / STAGE_NAME, json.dumps(doc).encode(), fsync=False, sync_dir=False
        )
        return self.directory

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self._f.close()
        remove_stage(self.directory)


def remove_stage(directory: str | os.PathLike[str]) -> None:
    """Remove a stage directory (a symlink in its place is unlinked, never followed)."""
    p = Path(directory)
    if p.is_symlink() or p.is_file():
        p.unlink()
    elif p.exists():
        shutil.rmtree(p)


# --------------------------------------------------------------------------- reading


def _read_regular(path: Path, limit: int) -> bytearray:
    """The bytes of a regular file (read once, into a writable buffer), never through a
    symlink, never blocking on a FIFO; a file that grew past ``limit`` is refused."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise FormatError(f"{path}: cannot open ({exc})") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FormatError(f"{path} is not a regular file")
        if st.st_size > limit:
            raise FormatError(f"{path} is larger than {limit} bytes ({st.st_size})")
        buf = bytearray(st.st_size + 1)  # one more: a file that grew is noticed
        view, got = memoryview(buf), 0
        while got < len(buf) and (n := os.readv(fd, [view[got:]])):
            got += n
        if got > st.st_size:
            raise FormatError(f"{path} grew while it was read")
        del view
        del buf[got:]
        return buf
    finally:
        os.close(fd)


def read_stage(directory: str | os.PathLike[str], *, max_bytes: int = 1 << 40) -> Stage:
    """Read and verify a stage; raises FormatError for anything that does not verify or parse.

    The data file is read whole (it holds only the changed elements), its checksum checked
    against ``stage.json``, then every array is bounds-checked and the positions checked
    sorted, unique and within the tensor, before anything is returned.
    """
    d = Path(directory)
    if d.is_symlink() or not d.is_dir():
        raise FormatError(f"{d} is not a stage directory")
    where = str(d / STAGE_NAME)
    record = stage_record(d)
    try:
        doc = json.loads(record, parse_constant=lambda c: _bad(where, f"non-JSON constant {c}"))
    except ValueError as exc:
        raise FormatError(f"{where}: not JSON ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("format") != STAGE_FORMAT:
        raise FormatError(f"{where}: not an {STAGE_FORMAT} record")
    if doc.get("format_version") != FORMAT_VERSION:
        raise FormatError(
            f"{where}: format_version {doc.get('format_version')!r}, this reader knows "
            f"{FORMAT_VERSION} (update the engine's asyncsync plugin)"
        )
    target = VersionRef.from_dict(doc.get("target"), f"{where}: target")
    base = VersionRef.from_dict(doc.get("base"), f"{where}: base")
    algorithm = doc.get("checksum_algorithm")
    if algorithm not in ALGORITHMS:
        raise FormatError(f"{where}: unknown checksum_algorithm {algorithm!r}")
    data_ref = doc.get("data")
    if not isinstance(data_ref, dict) or data_ref.get("file") != DATA_NAME:
        raise FormatError(f"{where}: data must name {DATA_NAME}")
    size = data_ref.get("bytes")
    if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= max_bytes:
        raise FormatError(f"{where}: bad data size {size!r}")
    data = _read_regular(d / DATA_NAME, size)
    if len(data) != size:
        raise FormatError(f"{d / DATA_NAME}: {len(data)} bytes, stage.json says {size}")
    h = new_hasher(algorithm)
    h.update(data)
    if h.hexdigest() != data_ref.get("checksum"):
        raise FormatError(
            f"{d / DATA_NAME}: checksum {h.hexdigest()} != {data_ref.get('checksum')!r} "
            "(damaged or changed after it was staged)"
        )
    checksums = doc.get("checksums")
    if not isinstance(checksums, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in checksums.items()
    ):
        raise FormatError(f"{where}: checksums must map names to strings")
    parts = _parts(doc.get("parts", {}), where)
    buf = data  # writable, so torch.frombuffer shares it without a warning
    entries = doc.get("tensors")
    if not isinstance(entries, list):
        raise FormatError(f"{where}: tensors must be a list")
    tensors, seen = [], set()
    for i, e in enumerate(entries):
        t = _tensor(e, buf, f"{where}: tensors[{i}]")
        if t.name in seen or t.name not in checksums:
            raise FormatError(f"{where}: tensor {t.name!r} repeated or without a checksum")
        seen.add(t.name)
        tensors.append(t)
    return Stage(d, target, base, algorithm, tuple(tensors), dict(checksums), parts, size, record)


def stage_record(directory: str | os.PathLike[str]) -> bytes:
    """The bytes of a stage's ``stage.json`` as they are now (FormatError if unreadable)."""
    return bytes(_read_regular(Path(directory) / STAGE_NAME, MAX_STAGE_JSON))


def _bad(where: str, why: str) -> Any:
    raise FormatError(f"{where}: {why}")


def _parts(raw: Any, where: str) -> dict[str, list[tuple[int, int]]]:
    if not isinstance(raw, dict):
        raise FormatError(f"{where}: parts must be an object")
    out: dict[str, list[tuple[int, int]]] = {}
    for name, spans in raw.items():
        if not isinstance(spans, list) or not all(
            isinstance(s, list) and len(s) == 2 and all(_is_count(x) for x in s) for s in spans
        ):
            raise FormatError(f"{where}: parts of {name!r} must be [[offset, numel], ...]")
        out[name] = [(int(a), int(b)) for a, b in spans]
    return out


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _count(x: Any, where: str) -> int:
    if not _is_count(x):
        raise FormatError(f"{where}: expected an int >= 0, got {x!r}")
    return int(x)


def _array(ref: Any, buf: bytearray, names: Mapping[str, torch.dtype], where: str) -> torch.Tensor:
    if not isinstance(ref, dict):
        raise FormatError(f"{where}: expected an array reference")
    off, count = _count(ref.get("offset"), where), _count(ref.get("count"), where)
    dt = names.get(str(ref.get("dtype")))
    if dt is None or off % ALIGN:
        raise FormatError(f"{where}: bad array reference {ref!r}")
    nbytes = count * dt.itemsize
    if off + nbytes > len(buf):
        raise FormatError(f"{where}: array {off}+{nbytes} beyond the data file ({len(buf)})")
    if count == 0:
        return torch.empty(0, dtype=dt)
    return torch.frombuffer(buf, dtype=dt, count=count, offset=off)


def _increasing(positions: torch.Tensor, limit: int) -> bool:
    """Whether ``positions`` are >= 0, strictly increasing and < ``limit`` (one C pass when the
    kernels are loaded)."""
    k = native.kernels
    if k is not None and hasattr(k, "increasing"):
        return bool(k.increasing(positions.numpy(), positions.element_size(), limit))
    return (
        int(positions[0]) >= 0
        and int(positions[-1]) < limit
        and (positions.numel() < 2 or bool((positions[1:] > positions[:-1]).all()))
    )


def _tensor(e: Any, buf: bytearray, where: str) -> StagedTensor:
    if not isinstance(e, dict) or not isinstance(e.get("name"), str):
        raise FormatError(f"{where}: expected an object with a name")
    name = e["name"]
    try:
        dtype = dtype_from_name(str(e.get("dtype")))
    except Exception as exc:
        raise FormatError(f"{where}: tensor {name!r}: unknown dtype {e.get('dtype')!r}") from exc
    shape = e.get("shape")
    if not isinstance(shape, list) or not all(_is_count(s) for s in shape):
        raise FormatError(f"{where}: tensor {name!r}: bad shape {shape!r}")
    numel = math.prod(shape)
    want = _INT_BY_WIDTH[dtype.itemsize]
    values = _array(e.get("values"), buf, {str(want).removeprefix("torch."): want}, where)
    changed = _count(e.get("changed"), where)
    if changed > numel:
        raise FormatError(f"{where}: tensor {name!r}: bad changed {changed!r}")
    if e.get("positions") is None:
        positions = None
        if values.numel() != numel:
            raise FormatError(f"{where}: tensor {name!r}: dense with {values.numel()} values")
    else:
        positions = _array(e["positions"], buf, {"int32": torch.int32, "int64": torch.int64}, where)
        n = positions.numel()
        if n != values.numel() or n != changed:
            raise FormatError(f"{where}: tensor {name!r}: {n} positions, {values.numel()} "
                              f"values, changed {changed}")  # fmt: skip
        if n and not _increasing(positions, numel):
            raise FormatError(
                f"{where}: tensor {name!r}: positions not strictly increasing within {numel}"
            )
    return StagedTensor(name, dtype, tuple(shape), changed, positions, values)
