"""The manifest reader's refusals, word for word: the entry parse and ``Manifest.validate`` were
made faster (issue 26: ~8 us a small tensor's entry) without a second copy of their rules, and
these cases hold every refusal to the error and message the reader gave before (recorded from
commit 95845da; a scratch differential fuzz of 9,000 mutated manifests agreed with it too)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from asyncsync.errors import ManifestError
from asyncsync.format import Manifest, TensorEntry
from asyncsync.format.checksum import parts_checksum
from asyncsync.format.names import DTYPE_SIZES
from tests.test_format import H, make_manifest
from tests.test_fuzz import _DELETE, _edit

MISSING = _DELETE
ENTRY: dict[str, Any] = {
    "name": "w",
    "dtype": "bfloat16",
    "shape": [4, 8],
    "checksum": "0123456789abcdef",
    "changed": 3,
    "delta": {"shard": 0, "mode": "sparse", "positions": "w.pos", "values": "w.val"},
    "full": None,
}
AT = "m tensors[0] ('w')"
TYPE = "field {!r} must be <class {!r}>, got {}"
MAXI = 2**53 - 1

ENTRY_CASES: list[tuple[tuple[str, ...], Any, str]] = [
    ((), "x", "m tensors[0]: expected a JSON object, got str"),
    (("name",), MISSING, "m tensors[0]: missing field 'name'"),
    (("name",), 7, "m tensors[0]: " + TYPE.format("name", "str", "int")),
    (("name",), "", "m tensors[0]: tensor name '' is empty or reserved"),
    (("name",), "__metadata__", "m tensors[0]: tensor name '__metadata__' is empty or reserved"),
    (("name",), "n" * 4097, "m tensors[0]: field 'name' longer than 4096"),
    (("dtype",), MISSING, f"{AT}: missing field 'dtype'"),
    (("dtype",), "float99", f"unknown dtype 'float99'; supported: {', '.join(DTYPE_SIZES)}"),
    (("dtype",), 1, f"{AT}: " + TYPE.format("dtype", "str", "int")),
    (("shape",), MISSING, f"{AT}: missing field 'shape'"),
    (("shape",), (4, 8), f"{AT}: " + TYPE.format("shape", "list", "tuple")),
    (("shape",), "4,8", f"{AT}: " + TYPE.format("shape", "list", "str")),
    (("shape",), [4, True], f"{AT}: shape must be a list of non-negative ints, got [4, True]"),
    (("shape",), [4, -1], f"{AT}: shape must be a list of non-negative ints, got [4, -1]"),
    (("shape",), [4, 2**53], f"{AT}: shape must be a list of non-negative ints, got [4, {2**53}]"),
    (("shape",), [4.0, 8], f"{AT}: shape must be a list of non-negative ints, got [4.0, 8]"),
    (("shape",), [1] * 65, f"{AT}: shape must be a list of non-negative ints, got {[1] * 65}"),
    (("shape",), [2**30, 2**30], f"{AT}: shape (1073741824, 1073741824) is too large"),
    (("shape",), [10**400], f"{AT}: shape must be a list of non-negative ints, got [{10**400}]"),
    (("checksum",), MISSING, f"{AT}: missing field 'checksum'"),
    (("checksum",), "0123456789ABCDEF", f"{AT}: field 'checksum' must be a lowercase hex digest"),
    (("checksum",), "0123", f"{AT}: field 'checksum' must be a lowercase hex digest"),
    (("checksum",), 5, f"{AT}: " + TYPE.format("checksum", "str", "int")),
    (("changed",), MISSING, f"{AT}: missing field 'changed'"),
    (("changed",), True, f"{AT}: field 'changed' must be <class 'int'>, got a bool"),
    (("changed",), -1, f"{AT}: field 'changed'=-1 out of range 0..{MAXI}"),
    (("changed",), 33, f"{AT}: changed=33 exceeds numel=32"),
    (("changed",), 2**53, f"{AT}: field 'changed'={2**53} out of range 0..{MAXI}"),
    (("changed",), 3.0, f"{AT}: " + TYPE.format("changed", "int", "float")),
    (("changed",), float("nan"), f"{AT}: " + TYPE.format("changed", "int", "float")),
    (("changed",), 10**400, f"{AT}: field 'changed'={10**400} out of range 0..{MAXI}"),
    (("delta",), "x", f"{AT}: expected a JSON object, got str"),
    (("delta",), [], f"{AT}: expected a JSON object, got list"),
    (("delta", "shard"), MISSING, f"{AT}: missing field 'shard'"),
    (("delta", "shard"), 1 << 20 | 1, f"{AT}: field 'shard'=1048577 out of range 0..1048576"),
    (("delta", "shard"), False, f"{AT}: field 'shard' must be <class 'int'>, got a bool"),
    (("delta", "mode"), "both", f"{AT}: mode must be 'sparse' or 'dense', got 'both'"),
    (("delta", "mode"), MISSING, f"{AT}: missing field 'mode'"),
    (("delta", "positions"), "p" * 1025, f"{AT}: field 'positions' longer than 1024"),
    (("delta", "values"), None, f"{AT}: " + TYPE.format("values", "str", "NoneType")),
    (("full",), 3, f"{AT}: expected a JSON object, got int"),
    (("full",), {"shard": 0}, f"{AT}: missing field 'key'"),
    (("full",), {"shard": 0, "key": 9}, f"{AT}: " + TYPE.format("key", "str", "int")),
    (("parts",), [], f"{AT}: parts must be a non-empty list"),
    (("parts",), "x", f"{AT}: parts must be a non-empty list"),
    (("parts",), [{"offset": 0}], f"{AT} parts[0]: missing field 'numel'"),
    (
        ("parts",),
        [{"offset": 0, "numel": 40, "checksum": "0123456789abcdef", "changed": 0}],
        f"{AT}: a tensor in parts has its delta/full in its parts",
    ),
]


def _mutated(path: tuple[str, ...], value: Any) -> Any:
    if not path:
        return value
    d = copy.deepcopy(ENTRY)
    _edit(path, value)(d)
    return d


@pytest.mark.parametrize(("path", "value", "message"), ENTRY_CASES)
def test_entry_refusals_word_for_word(path: tuple[str, ...], value: Any, message: str) -> None:
    with pytest.raises(ManifestError) as info:
        TensorEntry.from_dict(_mutated(path, value), "m tensors[0]")
    assert str(info.value) == message


def test_an_entry_read_is_the_record_written() -> None:
    """Extra keys are ignored (as before); the record equals, hashes and serialises as one made
    by its constructor; a shape of ints is kept as ints."""
    e = TensorEntry.from_dict({**ENTRY, "extra": [1, {"x": None}]}, "m")
    made = TensorEntry("w", "bfloat16", (4, 8), "0123456789abcdef", 3, e.delta)
    assert e == made and hash(e) == hash(made) and e.to_dict() == made.to_dict()
    assert list(e.__dict__) == list(made.__dict__)
    assert list(e.delta.__dict__) == ["shard", "mode", "positions", "values"]  # type: ignore[union-attr]
    with pytest.raises(AttributeError):
        e.name = "v"  # type: ignore[misc]


P0 = {"offset": 0, "numel": 10, "checksum": H, "changed": 3, "full": None}
P0["delta"] = {"shard": 0, "mode": "sparse", "positions": "p0", "values": "v0"}
P1 = {"offset": 10, "numel": 10, "checksum": H, "changed": 0, "delta": None, "full": None}
ONE = "xxh3-128 digest (32 hex digits)"


def _t0(**fields: Any) -> Any:
    return lambda d: d["tensors"][0].update(fields)


def _in_parts(*parts: dict[str, Any]) -> Any:
    c = parts_checksum(((p["offset"], p["numel"], p["checksum"]) for p in parts), "xxh3-128")
    return _t0(delta=None, parts=list(parts), checksum=c)


def _b(**fields: Any) -> Any:
    return lambda d: d["tensors"][1].update(fields)


def _delta(**fields: Any) -> dict[str, Any]:
    return {"shard": 0, "mode": "sparse", "positions": "y", "values": "x", **fields}


A = "manifest tensor 'a.weight'"
MANIFEST_CASES: list[tuple[Any, str]] = [
    (_t0(delta=_delta(shard=1)), f"{A}: shard index 1 out of range"),
    (
        _b(changed=1, delta=_delta(positions="t0.pos")),
        "manifest tensor 'b': shard key 't0.pos' used twice",
    ),
    (_b(delta=_delta()), "manifest tensor 'b': delta data for an unchanged tensor"),
    (_t0(checksum=H[:16]), f"manifest: tensor 'a.weight': checksum '{H[:16]}' is not a {ONE}"),
    (
        lambda d: d["shards"][0].update(checksum=H[:16]),
        f"manifest: shard 'delta-00000.safetensors': checksum '{H[:16]}' is not a {ONE}",
    ),
    (_t0(full={"shard": 0, "key": "k"}), f"{A}: a delta version carries no full data"),
    (_t0(delta=None), f"{A}: changed=3 but no delta data"),
    (lambda d: d["shards"][0].update(role="full"), f"{A}: shard 0 is not a delta shard"),
    (
        _in_parts(P0, {**P1, "offset": 11, "numel": 9}),
        f"{A}: parts must tile the tensor in offset order; expected a part at 10, found one at 11",
    ),
    (
        _in_parts(P0, {**P1, "checksum": H[:16]}),
        f"manifest: tensor 'a.weight' part at 10: checksum '{H[:16]}' is not a {ONE}",
    ),
    (
        _in_parts({**P0, "delta": _delta(shard=3)}, P1),
        f"{A} part at 0: shard index 3 out of range",
    ),
    (_in_parts(P0, {**P1, "changed": 1}), f"{A}: changed is not the sum of its parts' changed"),
    (
        _in_parts(P0, {**P1, "delta": _delta(mode="dense")}),
        f"{A} part at 10: delta data for an unchanged tensor",
    ),
    (lambda d: d.update(base_version=None), "manifest: a delta version needs a base_version"),
    (
        lambda d: d.update(format_version=1) or _in_parts(P0, P1)(d),
        f"{A}: tensors in parts need format_version 2 or later",
    ),
]


@pytest.mark.parametrize(("change", "message"), MANIFEST_CASES)
def test_manifest_refusals_word_for_word(change: Any, message: str) -> None:
    d = json.loads(make_manifest().to_json())
    change(d)
    with pytest.raises(ManifestError) as info:
        Manifest.from_json(json.dumps(d))
    assert str(info.value) == message
