"""Strict readers of JSON fields: every value read from the shared directory is checked here."""

from __future__ import annotations

import json
import math
from typing import Any

from asyncsync.errors import ManifestError, ManifestUnreadable
from asyncsync.format.names import _HEX_RE, _MAX_INT


def _get(d: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in d:
        raise ManifestError(f"{where}: missing field {key!r}")
    v = d[key]
    # bool is an int subclass; never accept it where a number is meant.
    if isinstance(v, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise ManifestError(f"{where}: field {key!r} must be {kind}, got a bool")
    if not isinstance(v, kind):
        raise ManifestError(f"{where}: field {key!r} must be {kind}, got {type(v).__name__}")
    return v


def _int(d: dict[str, Any], key: str, where: str, *, lo: int = 0, hi: int = _MAX_INT) -> int:
    v = _get(d, key, int, where)
    if not lo <= v <= hi:
        raise ManifestError(f"{where}: field {key!r}={v} out of range {lo}..{hi}")
    return int(v)


def _opt_int(
    d: dict[str, Any], key: str, where: str, *, lo: int = 0, hi: int = _MAX_INT
) -> int | None:
    if d.get(key) is None:
        return None
    return _int(d, key, where, lo=lo, hi=hi)


def _float(d: dict[str, Any], key: str, where: str) -> float:
    v = _get(d, key, (int, float), where)
    if isinstance(v, int) and v > _MAX_INT:  # not exact as a double (and 10**400 overflows)
        raise ManifestError(f"{where}: field {key!r}={v} out of range 0..{_MAX_INT}")
    if not math.isfinite(v) or v < 0:
        raise ManifestError(f"{where}: field {key!r}={v} must be a finite non-negative number")
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


def _load_json(text: str | bytes, what: str) -> dict[str, Any]:
    if isinstance(text, bytes | bytearray):
        # json.loads(bytes) would also read UTF-16/32; the files are UTF-8 without a BOM
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ManifestUnreadable(f"{what} is not UTF-8: {exc}") from exc
    try:
        obj = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise ManifestUnreadable(f"{what} is not valid JSON: {exc}") from exc
    return _dict(obj, what)
