"""Lossless sparse-delta codecs: how one tensor's change between two versions goes on the wire.

Everything works on *int views* (:func:`int_view`): a tensor's bytes seen as the integer dtype of
the same width, so a delta is bitwise exact for every dtype (NaN payloads, ``-0.0``, float8 and
bool included) and float values are never compared. All byte layouts are little-endian (the
hosts we run on are). Encodings, per tensor, with ``n`` changed elements out of ``numel``:

``indices``      positions as int32 absolute indices (int64 when numel > 2**31-1); values raw.
``deltas``       positions as gaps ``idx[k] - idx[k-1] - 1`` (``idx[-1] = -1``) in the narrowest
                 of uint16/uint32/uint64 holding the largest gap; values raw.
``deltas_zstd``  the ``deltas`` positions blob compressed with zstd level 1; values raw.
``xef``          (default) Elias-Fano positions; values are ``new ^ old`` (the receiver holds
                 old) split into byte planes (all byte 0s, then all byte 1s, ...) and zstd'd.
                 The high planes of a small float update's XOR are almost all zero, so they
                 vanish under zstd. Above :data:`DENSE_THRESHOLD` changed/numel, no positions
                 are stored and the whole-tensor XOR (zero where unchanged) is sent instead.

The first three are the generation-1 baselines of the slime project: always mode "sparse",
patch op "set". xef patches XOR. A sparse xef positions blob is one header byte
(``L | 0x80`` when the rest is zstd-compressed, which is kept only when smaller) followed by the
Elias-Fano payload of :mod:`asyncsync.codec.ef` (about ``L + 2`` bits per position).

``changed == 0`` encodes as two empty blobs in every encoding. Decoding validates everything and
raises :class:`~asyncsync.errors.FormatError` on any inconsistency; decompressed sizes are known
in advance, so a hostile blob cannot make the decoder allocate more than the tensor's size.

On CPU the diff (:func:`diff_tensors`), the sparse patch (:func:`apply_patch`) and the Elias-Fano
coder run in the optional C extension ``asyncsync.codec._native`` (``asyncsync/codec/_native.c``):
one pass over the 8-byte words of old and new that writes each differing element's position, new
value and ``old ^ new`` (about one ``torch.ne``; the NumPy path's ``!=``, ``flatnonzero`` and two
``take`` gathers cost ~3x), and one loop that saves the old values and patches. :data:`NATIVE` says
whether it is in use (not when it did not build or ``ASYNCSYNC_NATIVE=0``); the switch is
:data:`asyncsync.codec.native.kernels`, read at call time, and the NumPy fallback's results are
byte-identical. Accelerator tensors always take the torch path.

The package is pure (no I/O): :mod:`~asyncsync.codec.views` (int views, gathers),
:mod:`~asyncsync.codec.diff` (the one-pass diff), :mod:`~asyncsync.codec.delta` (the encodings),
:mod:`~asyncsync.codec.patch` (applying a decoded delta), :mod:`~asyncsync.codec.ef`
(Elias-Fano), :mod:`~asyncsync.codec.native` (the switch to the C kernels of ``_native.c``) and
:mod:`~asyncsync.codec.shards` (bucket and shard bytes <-> tensors).
"""

from __future__ import annotations

from asyncsync.codec import native
from asyncsync.codec.delta import (
    DEFAULT_ENCODING,
    DENSE_THRESHOLD,
    ENCODINGS,
    EncodedDelta,
    decode_delta,
    decode_xef_many,
    decode_xef_positions,
    encode_change,
    encode_delta,
    encoded_size,
)
from asyncsync.codec.diff import Change, changed_positions, diff_tensors, revert
from asyncsync.codec.patch import Patch, apply_patch
from asyncsync.codec.patch_hash import (
    JournalPass,
    can_journal_in_pass,
    journal_pass,
    journal_patch,
    patch_and_checksum,
)
from asyncsync.codec.views import gather, int_dtype, int_view, raw_clone, raw_view

__all__ = [
    "Change",
    "DEFAULT_ENCODING",
    "DENSE_THRESHOLD",
    "ENCODINGS",
    "EncodedDelta",
    "JournalPass",
    "NATIVE",
    "Patch",
    "apply_patch",
    "changed_positions",
    "decode_delta",
    "decode_xef_many",
    "decode_xef_positions",
    "diff_tensors",
    "encode_change",
    "encode_delta",
    "encoded_size",
    "gather",
    "int_dtype",
    "int_view",
    "can_journal_in_pass",
    "journal_pass",
    "journal_patch",
    "patch_and_checksum",
    "raw_clone",
    "raw_view",
    "revert",
]

NATIVE: bool = native.kernels is not None  # the C kernels run on CPU (see the module docstring)
