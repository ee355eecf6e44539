"""Streaming checksums of files and tensor bytes.

The default algorithm is XXH3-128 (``xxhash``): it runs at memory bandwidth (tens of GB/s
per core), releases the GIL on large buffers so shards hash in parallel threads, and its
128-bit output makes an accidental collision between two versions of a tensor negligible.
It is not a cryptographic MAC: it detects corruption and torn writes, not an attacker who
can write to the shared directory (whoever can write there can also rewrite the manifest).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

import xxhash

from asyncsync import fsio, memory
from asyncsync.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = [
    "ALGORITHMS",
    "DEFAULT_ALGORITHM",
    "Hasher",
    "checksum_bytes",
    "checksum_file",
    "checksum_tensor",
    "entry_checksum",
    "layout_checksum",
    "new_hasher",
    "parts_checksum",
    "tensor_bytes",
]

DEFAULT_ALGORITHM = "xxh3-128"
_CHUNK = 8 << 20


class Hasher(Protocol):
    def update(self, data: bytes | bytearray | memoryview, /) -> None: ...
    def hexdigest(self) -> str: ...


_FACTORIES: dict[str, Callable[[], Hasher]] = {
    "xxh3-128": xxhash.xxh3_128,
    "xxh3-64": xxhash.xxh3_64,
}
ALGORITHMS = tuple(_FACTORIES)


def new_hasher(algorithm: str = DEFAULT_ALGORITHM) -> Hasher:
    """A fresh incremental hasher for ``algorithm`` (one of :data:`ALGORITHMS`)."""
    try:
        return _FACTORIES[algorithm]()
    except KeyError:
        raise ConfigError(
            f"unknown checksum algorithm {algorithm!r}; use one of {', '.join(ALGORITHMS)}"
        ) from None


def checksum_bytes(data: bytes | bytearray | memoryview, algorithm: str = DEFAULT_ALGORITHM) -> str:
    h = new_hasher(algorithm)
    h.update(data)
    return h.hexdigest()


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes, row-major, as a memoryview (copied to CPU / contiguous if needed: a
    CUDA tensor through a reused pinned buffer, :func:`asyncsync.memory.host_copy`)."""
    import torch  # reading a root needs no torch: imported on first use

    t = t.detach()
    if t.dtype == torch.bool:  # copied as bytes: torch copies a bool's elements as 0/1
        t = t.view(torch.uint8)
    flat = memory.host_copy(t).reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]


def _streamed(
    t: torch.Tensor,
    itemsize: int,
    layout: Sequence[tuple[int, int]] | None,
    algorithm: str,
) -> str:
    """:func:`layout_checksum` of a device tensor's bytes, hashed as they come to the host a
    chunk at a time (:func:`asyncsync.memory.host_chunks`): no host copy of the whole tensor."""

    def one(start: int, stop: int) -> str:
        h = new_hasher(algorithm)
        for chunk in memory.host_chunks(t, start, stop):
            h.update(chunk)
        return h.hexdigest()

    if layout is None:
        return one(0, t.numel() * t.element_size())
    return parts_checksum(
        ((o, n, one(o * itemsize, (o + n) * itemsize)) for o, n in layout), algorithm
    )


def checksum_tensor(
    t: torch.Tensor,
    algorithm: str = DEFAULT_ALGORITHM,
    layout: Sequence[tuple[int, int]] | None = None,
) -> str:
    """Checksum of a tensor's complete bytes (row-major, little-endian as stored), or with
    ``layout`` the composite of its parts' (:func:`layout_checksum`). A device tensor is hashed
    as its bytes come to the host, a chunk at a time."""
    if t.device.type != "cpu":
        return _streamed(t, t.element_size(), layout, algorithm)
    return layout_checksum(tensor_bytes(t), t.element_size(), layout, algorithm)


def checksum_file(
    path: str | os.PathLike[str], algorithm: str = DEFAULT_ALGORITHM
) -> tuple[str, int]:
    """(checksum, size) of a regular file, read in chunks (opened by
    :func:`asyncsync.fsio.open_file`: a FIFO or a socket is refused, never waited on; a symlink
    is followed: the files of a checkpoint being registered may be, FORMAT.md section 5)."""
    h = new_hasher(algorithm)
    size = 0
    with os.fdopen(fsio.open_file(path, follow_symlinks=True), "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
            size += n
    return h.hexdigest(), size


def parts_checksum(
    parts: Iterable[tuple[int, int, str]], algorithm: str = DEFAULT_ALGORITHM
) -> str:
    """The checksum of a tensor published in parts (docs/FORMAT.md, "Tensors in parts").

    ``parts`` are ``(offset, numel, checksum)``; the result is the checksum of the UTF-8 text of
    the lines ``offset:numel:checksum`` in offset order, joined by ``\n`` (no trailing newline).
    """
    text = "\n".join(f"{o}:{n}:{c}" for o, n, c in sorted(parts))
    return checksum_bytes(text.encode(), algorithm)


def layout_checksum(
    data: bytes | bytearray | memoryview,
    itemsize: int,
    layout: Sequence[tuple[int, int]] | None,
    algorithm: str = DEFAULT_ALGORITHM,
) -> str:
    """Checksum of a tensor's complete bytes ``data``: plain, or, with ``layout`` (the
    ``(offset, numel)`` of its parts, in elements), the composite of :func:`parts_checksum`."""
    if layout is None:
        return checksum_bytes(data, algorithm)
    with memoryview(data) as mv, mv.cast("B") as flat:
        return parts_checksum(
            (
                (o, n, checksum_bytes(flat[o * itemsize : (o + n) * itemsize], algorithm))
                for o, n in layout
            ),
            algorithm,
        )


class _Layout(Protocol):
    """What :func:`entry_checksum` reads of a manifest entry (a :class:`TensorEntry`)."""

    @property
    def torch_dtype(self) -> torch.dtype: ...
    @property
    def layout(self) -> Sequence[tuple[int, int]] | None: ...


def entry_checksum(
    entry: _Layout,
    data: torch.Tensor | bytes | bytearray | memoryview,
    algorithm: str = DEFAULT_ALGORITHM,
) -> str:
    """The checksum a manifest entry records for a tensor whose complete bytes are ``data``
    (a tensor, or its row-major bytes), for plain entries and entries in parts alike."""
    itemsize = entry.torch_dtype.itemsize
    if isinstance(data, bytes | bytearray | memoryview):
        return layout_checksum(data, itemsize, entry.layout, algorithm)
    if data.device.type != "cpu":
        return _streamed(data, itemsize, entry.layout, algorithm)
    return layout_checksum(tensor_bytes(data), itemsize, entry.layout, algorithm)
