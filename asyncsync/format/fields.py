"""Strict readers of JSON fields: every value read from the shared directory is checked here.

Public: :func:`load_json` (the strict reader of every JSON file of a root) and
:func:`check_density` (its refusal of JSON denser than any valid record); the ``_int``,
``_str``, ... field readers are the format package's own."""

from __future__ import annotations

import collections
import json
import math
from typing import Any

from asyncsync.errors import ManifestError, ManifestUnreadable
from asyncsync.format.names import _HEX_RE, MAX_INT

_MISSING: Any = object()


def _get(d: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    v = d.get(key, _MISSING)
    if type(v) is kind:  # the common case, first: exactly the type asked (a bool is not an int)
        return v
    if v is _MISSING:
        raise ManifestError(f"{where}: missing field {key!r}")
    # bool is an int subclass; never accept it where a number is meant.
    if isinstance(v, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise ManifestError(f"{where}: field {key!r} must be {kind}, got a bool")
    if not isinstance(v, kind):
        raise ManifestError(f"{where}: field {key!r} must be {kind}, got {type(v).__name__}")
    return v


def _int(d: dict[str, Any], key: str, where: str, *, lo: int = 0, hi: int = MAX_INT) -> int:
    v = _get(d, key, int, where)
    if not lo <= v <= hi:
        raise ManifestError(f"{where}: field {key!r}={v} out of range {lo}..{hi}")
    return int(v)


def _opt_int(
    d: dict[str, Any], key: str, where: str, *, lo: int = 0, hi: int = MAX_INT
) -> int | None:
    if d.get(key) is None:
        return None
    return _int(d, key, where, lo=lo, hi=hi)


def _float(d: dict[str, Any], key: str, where: str) -> float:
    """A number (timestamp, ttl, density): an integer or a fraction, finite, in 0..2^53-1
    whichever way it is written (``1e20`` is refused as ``10**20`` is)."""
    v = _get(d, key, (int, float), where)
    # an int above 2^53-1 is not exact as a double (and 10**400 overflows); a float is held
    # to the same range, so 1e20 is refused as 10**20 is
    if not (math.isfinite(v) if isinstance(v, float) else True) or not 0 <= v <= MAX_INT:
        raise ManifestError(
            f"{where}: field {key!r}={v} must be a finite non-negative number at most {MAX_INT}"
        )
    return float(v)


def _hex(d: dict[str, Any], key: str, where: str) -> str:
    v = _get(d, key, str, where)
    if not _HEX_RE.match(v):
        raise ManifestError(f"{where}: field {key!r} must be a lowercase hex digest")
    return str(v)


def _str(d: dict[str, Any], key: str, where: str, max_len: int = 4096) -> str:
    v = _get(d, key, str, where)
    if len(v) > max_len:
        raise ManifestError(f"{where}: field {key!r} longer than {max_len}")
    return str(v)


def _known(d: dict[str, Any], key: str, known: tuple[str, ...], where: str) -> str:
    v = _str(d, key, where, 64)
    if v not in known:
        raise ManifestError(
            f"{where}: {key} {v!r} is unknown to this reader (it reads {', '.join(known)}); "
            "upgrade asyncsync on this host"
        )
    return v


def _dict(v: object, where: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise ManifestError(f"{where}: expected a JSON object, got {type(v).__name__}")
    return v


def _no_constant(name: str) -> Any:
    # Python's json reads NaN/Infinity, which are not JSON: what we accept must re-serialise.
    raise ValueError(f"{name} is not valid JSON")


class _DuplicateKey(Exception):
    pass


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        counts = collections.Counter(k for k, _ in pairs)
        raise _DuplicateKey(next(k for k, n in counts.items() if n > 1))
    return d


# JSON denser than any valid record is refused before it is parsed (FORMAT.md, "Conventions"):
# parsing costs memory per value, not per byte (a file of `{},` takes ~25x its size, so a 125
# MiB one needed 2.6 GiB), while a valid manifest has ~60 bytes per container and ~7 per value
# separator, and takes ~5x its size. At most one `{`/`[` per 16 bytes and one `,`/`:` per 5
# bytes bounds any accepted file to ~10x, the order of a valid manifest of its size.
_DENSITY_CHECK_FROM = 64 << 10
_BYTES_PER_CONTAINER = 16
_BYTES_PER_SEPARATOR = 5


def check_density(data: bytes, what: str) -> None:
    """Refuse (ManifestError) JSON bytes denser than any valid record, before parsing them.

    Used by :func:`load_json` and by the publisher on a manifest it is about to commit."""
    n = len(data)
    if n < _DENSITY_CHECK_FROM:
        return
    containers = data.count(b"{") + data.count(b"[")
    separators = data.count(b",") + data.count(b":")
    if containers * _BYTES_PER_CONTAINER > n or separators * _BYTES_PER_SEPARATOR > n:
        raise ManifestError(
            f"{what}: {n} bytes holding {containers} objects/arrays and {separators} values: "
            "far denser than any valid record (parsing it would take many times its size in "
            "memory); refused unparsed"
        )


def load_json(text: str | bytes, what: str) -> dict[str, Any]:
    """A JSON object read from the shared directory: UTF-8 without a BOM, no NaN/Infinity,
    no duplicate key in any object, not denser than a valid record (:func:`check_density`).
    ManifestUnreadable when the bytes are not (yet) JSON, ManifestError for the rest."""
    if isinstance(text, bytes | bytearray):
        check_density(bytes(text), what)
        # json.loads(bytes) would also read UTF-16/32; the files are UTF-8 without a BOM
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ManifestUnreadable(f"{what} is not UTF-8: {exc}") from exc
    else:
        check_density(text.encode("utf-8", "surrogatepass"), what)
    try:
        obj = json.loads(text, parse_constant=_no_constant, object_pairs_hook=_object)
    except _DuplicateKey as exc:
        raise ManifestError(f"{what}: key {exc.args[0]!r} appears twice in one object") from None
    except (ValueError, RecursionError) as exc:
        raise ManifestUnreadable(f"{what} is not valid JSON: {exc}") from exc
    except MemoryError:
        raise ManifestError(f"{what}: too large to parse in the memory available") from None
    return _dict(obj, what)
