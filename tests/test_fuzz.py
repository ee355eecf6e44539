"""Fuzzing the readers of the shared directory (issue 5, section 2): nothing crashes the agent.

Whatever a manifest or shard holds, the reader answers with the library's own errors:

* ``Manifest.from_json`` on mutated valid manifests (deleted keys, wrong types, huge, negative
  and non-finite numbers, ``../``, absolute paths, NUL, long strings, unknown format versions,
  nested garbage, byte-level damage) and on raw bytes: a Manifest that is safe and consistent,
  or :class:`~asyncsync.errors.ManifestError`, nothing else. Which it must be is decided by
  tests/manifest_oracle.py, a second reader of FORMAT.md that shares no code with the
  package: what it finds broken must be refused; near-valid manifests (one or two edits
  aimed at one rule of section 3 or 3.1) must be judged exactly as it judges them.
* the shard reader (``parse_shard`` + ``decode_delta``, as the agent composes them) on mutated
  valid shards of every encoding (bit flips, truncation, header edits: giant lengths, bad
  dtypes, overlapping offsets, metadata naming another version), whose checksum we bypass:
  only :class:`~asyncsync.errors.FormatError`. The codec alone on mutated blobs, likewise.
* end to end: an agent whose next version's manifest or shard is replaced by fuzzed content
  (shard mutations re-sign the manifest with the new size and checksum, so they reach the
  parser) raises an AsyncSyncError and keeps its engine at the last good version, bytes
  unchanged, not acknowledged; or, when the mutation changed nothing that matters, holds the
  true next version bit for bit.

And nothing in the packages can unpickle (an AST scan of the source).

Case counts: ~1,150 in all by default (``make test``, well under 30 s); with
``ASYNCSYNC_LONG=1`` twelve times as many (13,800)::

    ASYNCSYNC_LONG=1 .venv/bin/pytest tests/test_fuzz.py
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import copy
import functools
import json
import math
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import pytest
import torch
import zstandard
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from asyncsync import AsyncSyncError, FormatError, ManifestError, Publisher
from asyncsync.codec import ENCODINGS, decode_delta
from asyncsync.codec.shards import parse_shard
from asyncsync.format import FORMAT_VERSION, MAX_VERSION, Manifest, ShardInfo
from asyncsync.format.acks import read_acks, write_ack
from asyncsync.format.checksum import checksum_bytes
from asyncsync.format.store import read_manifest
from receiver import ReceiverAgent
from receiver.engines.checkpoint import LocalCheckpoint, verify_checkpoint
from receiver.rules import check_patch
from receiver.shard_reader import decode_shard, int_dtype
from tests import manifest_oracle as oracle
from tests.conftest import mixed_state, mutate

LONG = os.environ.get("ASYNCSYNC_LONG") == "1"
_SCALE = 12 if LONG else 1
# Default examples per fuzzer (x12 with ASYNCSYNC_LONG=1); 1,150 in all.
CASES = {"manifest": 200, "near_valid": 300, "raw": 100, "shard": 200, "codec": 200}
CASES["e2e_manifest"] = CASES["e2e_shard"] = 75

pytestmark = pytest.mark.timeout(1500 if LONG else 300)

Mode = Literal["delta", "full"]


def fuzz_settings(name: str) -> settings:
    return settings(
        max_examples=CASES[name] * _SCALE,
        deadline=None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.large_base_example,
        ],
        print_blob=True,
    )


# --------------------------------------------------------------------------- valid material


@dataclass(frozen=True)
class Sample:
    """A committed keyframe-with-delta version (v1) of one encoding: manifest and shards."""

    encoding: str
    manifest: Manifest
    text: bytes
    shards: tuple[tuple[int, ShardInfo, bytes], ...]


def _states() -> list[dict[str, torch.Tensor]]:
    s0 = mixed_state(0)
    s1 = mutate(s0, 0.03, seed=1)
    s1 = mutate(s1, 0.95, seed=2, names=["model.layers.8.weight"])  # xef dense mode
    return [s0, s1]


async def _publish(root: Path, encoding: str) -> None:
    s0, s1 = _states()
    async with Publisher(root, encoding=encoding, bucket_bytes=4096, keyframe_interval=0) as pub:
        await pub.seed(s0)
        await pub.publish(s1, keyframe=True)  # both delta and full shards


@functools.cache
def samples() -> tuple[Sample, ...]:
    out = []
    with tempfile.TemporaryDirectory() as d:
        for enc in ENCODINGS:
            root = Path(d) / enc
            asyncio.run(_publish(root, enc))
            m = read_manifest(root, 1)
            vdir = root / "v000000000001"
            shards = tuple((i, s, (vdir / s.file).read_bytes()) for i, s in enumerate(m.shards))
            out.append(Sample(enc, m, (vdir / "manifest.json").read_bytes(), shards))
    return tuple(out)


# --------------------------------------------------------------------------- JSON mutations

NASTY_STRINGS = [
    "", "../x", "../../etc/passwd", "/abs/path", "/", ".", "..", "a/b", "a\\b", "x\x00y", "\x00",
    ".tmp.x", ".hidden", "manifest.json", "delta-00000.safetensors", "v000000000001",
    "a" * 300, "é" * 100, "\ud800", "NaN", "-1", "1e309", "xxh3-128", "xef", "dense", "sparse",
    "full", "delta", "float128", "bfloat16", "bool", "F8_E8M0", "asyncsync", "t0.pos", "t0.val",
]  # fmt: skip
NASTY_NUMBERS = [
    -1, 0, 1, 2, 2**31 - 1, 2**31, 2**32, 2**53 - 1, 2**53, 2**53 + 1, 2**63 - 1, 2**63, 2**64,
    -(2**63), 10**30, MAX_VERSION, MAX_VERSION + 1, FORMAT_VERSION + 1, 0.5, -0.0, 1e308, 1.0,
]  # fmt: skip
_leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8))
GARBAGE = st.recursive(
    _leaf,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
    max_leaves=12,
)
NASTY = st.one_of(
    st.sampled_from(NASTY_STRINGS),
    st.sampled_from(NASTY_NUMBERS),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
    GARBAGE,
    st.lists(st.integers(min_value=-(2**70), max_value=2**70), max_size=70),  # shapes, offsets
)


@st.composite
def mutate_json(draw: st.DrawFn, doc: Any, max_ops: int = 4) -> Any:
    """``doc`` with 1..max_ops random edits at random depths: delete, replace, add, duplicate."""
    doc = copy.deepcopy(doc)
    for _ in range(draw(st.integers(1, max_ops))):
        node = doc
        while True:
            inner = [
                k
                for k in (node if isinstance(node, dict) else range(len(node)))
                if isinstance(node[k], dict | list) and node[k] is not None
            ]
            if not inner or draw(st.integers(0, 2)) == 0:
                break
            node = node[draw(st.sampled_from(inner))]
        op = draw(st.sampled_from(["delete", "replace", "replace", "add", "duplicate"]))
        if isinstance(node, dict):
            if op == "add" or not node:
                key = draw(st.text(max_size=6) | st.sampled_from(["version", "file", "shape"]))
                node[key] = draw(NASTY)
                continue
            key = draw(st.sampled_from(sorted(node)))
            if op == "delete":
                del node[key]
            elif op == "duplicate":
                node[key + "_"] = copy.deepcopy(node[key])
            else:
                node[key] = draw(NASTY)
        else:
            if op == "add" or not node:
                node.append(draw(NASTY))
                continue
            i = draw(st.integers(0, len(node) - 1))
            if op == "delete":
                del node[i]
            elif op == "duplicate":
                node.append(copy.deepcopy(node[i]))
            else:
                node[i] = draw(NASTY)
    return doc


@st.composite
def damage_bytes(draw: st.DrawFn, data: bytes) -> bytes:
    """Byte-level damage: flipped bits, truncation, inserted or appended bytes."""
    buf = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "append"]))
        if op == "flip" and buf:
            i = draw(st.integers(0, len(buf) - 1))
            buf[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "truncate":
            del buf[draw(st.integers(0, len(buf))) :]
        elif op == "insert":
            i = draw(st.integers(0, len(buf)))
            buf[i:i] = draw(st.binary(min_size=1, max_size=16))
        else:
            buf += draw(st.binary(min_size=1, max_size=64))
    return bytes(buf)


@st.composite
def fuzzed_manifest(draw: st.DrawFn) -> bytes:
    """A mutated valid manifest: JSON-level edits, then maybe byte-level damage."""
    sample = draw(st.sampled_from(samples()))
    doc = draw(mutate_json(json.loads(sample.text)))
    data = json.dumps(doc) if _dumpable(doc) else "{}"  # NaN/Infinity tokens included
    if draw(st.integers(0, 4)) == 0:
        return draw(damage_bytes(data.encode("utf-8", "surrogatepass")))
    return data.encode("utf-8", "surrogatepass")


def _dumpable(doc: Any) -> bool:
    try:
        json.dumps(doc)
    except ValueError:
        return False
    return True


def _reason(exc: Exception) -> str:
    """A short label of why a reader refused (for ``--hypothesis-show-statistics``)."""
    text = str(exc).split(": ", 1)[-1]
    return f"{type(exc).__name__}: {text[:40]}"


def check_manifest_bytes(data: bytes, *, exact: bool = False) -> Manifest | None:
    """The property: the reader agrees with the oracle (tests/manifest_oracle.py, FORMAT.md
    read a second time). A manifest that breaks a rule is refused with a ManifestError (no
    other error); one that is accepted breaks no rule but a known gap and re-serialises to
    itself. ``exact``: and one that breaks no rule is accepted (near-valid manifests, which
    stay within the reader's own limits on string lengths, ranks and counts)."""
    broken = oracle.broken_rules_of_bytes(data)
    try:
        m = Manifest.from_json(data, where="fuzz")
    except ManifestError as exc:
        event(f"refused: {_reason(exc)}")
        assert broken or not exact, f"refused a manifest that FORMAT.md allows: {exc}"
        return None
    unexplained = [rule for rule in broken if rule not in oracle.KNOWN_GAPS]
    assert not unexplained, f"accepted a manifest that breaks {unexplained}"
    event(f"accepted despite: {', '.join(broken)}" if broken else "accepted")
    assert Manifest.from_json(m.to_json()) == m
    return m


@fuzz_settings("manifest")
@given(fuzzed_manifest())
def test_fuzzed_manifests_are_valid_or_a_manifest_error(data: bytes) -> None:
    check_manifest_bytes(data)


@fuzz_settings("raw")
@given(
    st.one_of(
        st.binary(max_size=2048),
        st.text(max_size=512).map(lambda t: t.encode("utf-8", "surrogatepass")),
        GARBAGE.map(lambda g: json.dumps(g).encode()),
    )
)
def test_raw_bytes_as_a_manifest_are_a_manifest_error(data: bytes) -> None:
    assert check_manifest_bytes(data) is None


# --------------------------------------------------------------------------- near-valid manifests
# Valid manifests (some tensors split in parts) with a few edits that each break, or keep, one
# rule of FORMAT.md section 3: here the reader must agree with the oracle both ways.


def _spans(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The places the rules of section 3 apply to: each part, or the tensor when not in parts."""
    return [p for t in doc["tensors"] for p in (t.get("parts") or [t])]


def _refs(doc: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [s[kind] for s in _spans(doc) if s.get(kind)]


def split_in_parts(doc: dict[str, Any], t: dict[str, Any]) -> None:
    """Publish tensor ``t`` in two parts instead (section 3.1), keeping the manifest valid."""
    numel = math.prod(t["shape"])
    if numel < 2 or t.get("parts"):
        return
    algo, k = doc["checksum_algorithm"], numel // 2
    c0 = min(t["changed"], k)
    parts = []
    for j, (offset, n, changed) in enumerate([(0, k, c0), (k, numel - k, t["changed"] - c0)]):
        p = {"offset": offset, "numel": n, "changed": changed, "delta": None, "full": None}
        p["checksum"] = oracle.digest(f"{t['name']}#{j}", algo)
        if t["delta"] is not None and changed > 0:
            d = t["delta"]
            p["delta"] = {**d, "positions": f"{d['positions']}#{j}", "values": f"{d['values']}#{j}"}
        if t["full"] is not None:
            p["full"] = {"shard": t["full"]["shard"], "key": f"{t['full']['key']}#{j}"}
        parts.append(p)
    t.update(delta=None, full=None, parts=parts, checksum=oracle.composite(parts, algo))


def fix_fingerprint(doc: dict[str, Any]) -> None:
    """The fingerprint of the tensor entries again (readers recompute it: FORMAT.md section 3),
    so that edits of tensor entries reach the other rules."""
    doc["fingerprint"] = oracle.fingerprint(doc["tensors"], doc["checksum_algorithm"])


def fix_totals(doc: dict[str, Any]) -> None:
    """Totals that agree with the tensors and shards again (so that edits reach other rules)."""
    ts, shards = doc["tensors"], doc["shards"]
    elements = sum(math.prod(t["shape"]) for t in ts)
    changed = sum(t["changed"] for t in ts)
    doc["totals"].update(
        tensors=len(ts),
        elements=elements,
        changed=changed,
        density=changed / elements if elements else 0.0,
        wire_bytes=sum(s["bytes"] for s in shards if not doc["shard_dir"] or s["role"] == "delta"),
        delta_bytes=sum(s["bytes"] for s in shards if s["role"] == "delta"),
    )


Edit = Callable[[st.DrawFn, dict[str, Any]], None]


def _pick(draw: st.DrawFn, items: list[Any]) -> Any:
    return draw(st.sampled_from(items)) if items else None


def _share_delta_key(draw: st.DrawFn, doc: dict[str, Any]) -> None:
    a, b = _pick(draw, _refs(doc, "delta")), _pick(draw, _refs(doc, "delta"))
    if a is not None:
        mine = _pick(draw, ["positions", "values"])
        theirs = (
            _pick(draw, ["positions", "values"])
            if a is not b
            else {"positions": "values"}.get(mine, "positions")
        )
        a["shard"] = b["shard"]
        a[mine] = b[theirs]


def _share_full_key(draw: st.DrawFn, doc: dict[str, Any]) -> None:
    a, b = _pick(draw, _refs(doc, "full")), _pick(draw, _refs(doc, "full"))
    if a is not None:
        a.update(b)


def _rename(draw: st.DrawFn, doc: dict[str, Any]) -> None:
    a, b = _pick(draw, doc["tensors"]), _pick(draw, doc["tensors"])
    a["name"] = b["name"]


def _reindex(draw: st.DrawFn, doc: dict[str, Any]) -> None:
    ref = _pick(draw, _refs(doc, "delta") + _refs(doc, "full"))
    if ref is not None:
        ref["shard"] = draw(st.integers(0, len(doc["shards"]) + 1))


def _totals(draw: st.DrawFn, doc: dict[str, Any]) -> None:
    key = _pick(draw, sorted(doc["totals"]))
    doc["totals"][key] += _pick(draw, [-1, 1, 0.5])


def _changed(draw: st.DrawFn, doc: dict[str, Any]) -> None:
    s = _pick(draw, _spans(doc))
    s["changed"] = _pick(draw, [0, s["changed"] + 1, max(s["changed"] - 1, 0)])


def _drop_ref(draw: st.DrawFn, doc: dict[str, Any]) -> None:
    _pick(draw, _spans(doc))[_pick(draw, ["delta", "full"])] = None


def _add_delta(draw: st.DrawFn, doc: dict[str, Any]) -> None:
    s = _pick(draw, _spans(doc))
    shard = _pick(draw, [i for i, sh in enumerate(doc["shards"]) if sh["role"] == "delta"] or [0])
    s["delta"] = {"shard": shard, "mode": "sparse", "positions": "new.pos", "values": "new.val"}


def _shard_file(draw: st.DrawFn, doc: dict[str, Any]) -> None:
    others = [sh["file"] for sh in doc["shards"]]
    names = [*others, "manifest.json", "../x", "x..y", ".x", "a/b", "fine-name.safetensors"]
    _pick(draw, doc["shards"])["file"] = _pick(draw, names)


def _shard_role(draw: st.DrawFn, doc: dict[str, Any]) -> None:
    sh = _pick(draw, doc["shards"])
    sh["role"] = "delta" if sh["role"] == "full" else "full"


def _shard_bytes(draw: st.DrawFn, doc: dict[str, Any]) -> None:
    _pick(draw, doc["shards"])["bytes"] = _pick(
        draw, [0, oracle.SHARD_LIMIT - 1, oracle.SHARD_LIMIT]
    )


def _parts(draw: st.DrawFn, doc: dict[str, Any]) -> None:
    """Break a rule of section 3.1 (or not): offsets, sizes, sums, checksums, entry refs."""
    t = _pick(draw, [t for t in doc["tensors"] if t.get("parts")])
    if t is None:
        return
    p = _pick(draw, t["parts"])
    how = _pick(draw, ["offset", "numel", "changed", "checksum", "ref", "format"])
    if how in ("offset", "numel"):
        p[how] += _pick(draw, [-1, 1])
    elif how == "changed":
        p["changed"] = max(p["changed"] - 1, 0) if p["changed"] else 1
    elif how == "checksum":
        p["checksum"] = oracle.digest("another part", doc["checksum_algorithm"])
    elif how == "ref":
        t["full"] = {"shard": 0, "key": "whole"}
    else:
        doc["format_version"] = 1


def _set(key: str, values: list[Any]) -> Edit:
    def edit(draw: st.DrawFn, doc: dict[str, Any]) -> None:
        doc[key] = _pick(draw, values)

    return edit


def _delete_one(draw: st.DrawFn, doc: dict[str, Any]) -> None:
    where = _pick(draw, [doc, doc, _pick(draw, doc["tensors"])])
    key = _pick(
        draw,
        [
            k
            for k in ("base_version", "shard_dir", "producer", "delta", "full", "attempt")
            if k in where
        ],
    )
    if key is not None:
        del where[key]


def _drop_list_item(draw: st.DrawFn, doc: dict[str, Any]) -> None:
    items = doc[_pick(draw, ["tensors", "shards"])]
    if items:
        del items[draw(st.integers(0, len(items) - 1))]


def _duplicate_list_item(draw: st.DrawFn, doc: dict[str, Any]) -> None:
    items = doc[_pick(draw, ["tensors", "shards"])]
    items.append(copy.deepcopy(_pick(draw, items)))


NEAR_EDITS: dict[str, Edit] = {
    "share a delta key": _share_delta_key,
    "share a full key": _share_full_key,
    "rename to another tensor's name": _rename,
    "point a reference at another shard": _reindex,
    "change a total": _totals,
    "change a changed count": _changed,
    "drop a delta or full reference": _drop_ref,
    "add a delta reference": _add_delta,
    "rename a shard": _shard_file,
    "flip a shard's role": _shard_role,
    "resize a shard": _shard_bytes,
    "edit a tensor in parts": _parts,
    "drop a tensor or shard": _drop_list_item,
    "duplicate a tensor or shard": _duplicate_list_item,
    "delete a field": _delete_one,
    "base_version": lambda draw, doc: doc.update(
        base_version=_pick(draw, [None, doc["version"], doc["version"] - 2, doc["version"] - 1])
    ),
    "version": lambda draw, doc: doc.update(version=doc["version"] + _pick(draw, [-1, 1])),
    "kind": _set("kind", ["full", "delta"]),
    "encoding": _set("encoding", [*oracle.ENCODINGS, "rot13", "XEF"]),
    "checksum_algorithm": _set("checksum_algorithm", ["xxh3-128", "xxh3-64", "md5"]),
    "format_version": _set("format_version", [1, 2, 3, 4]),
    "shard_dir": _set("shard_dir", [None, "/registered/checkpoint"]),
    "attempt": _set("attempt", [None, "0123abcd", "0123ABCD"]),
}


@st.composite
def near_valid_manifest(draw: st.DrawFn) -> bytes:
    doc = json.loads(draw(st.sampled_from(samples())).text)
    n = len(doc["tensors"])
    for i in draw(st.lists(st.integers(0, n - 1), max_size=2, unique=True)):
        split_in_parts(doc, doc["tensors"][i])
    fix_fingerprint(doc)
    edits = st.sampled_from(sorted(NEAR_EDITS))
    names = [draw(edits)] if draw(st.integers(0, 7)) else []  # mostly one edit: one rule
    if names and draw(st.integers(0, 3)) == 0:
        names.append(draw(edits))
    for name in names:
        NEAR_EDITS[name](draw, doc)
    if draw(st.booleans()):
        with contextlib.suppress(KeyError, TypeError):  # an edit took what the totals need
            fix_totals(doc)
    if draw(st.integers(0, 3)):  # mostly: an edit of the entries is not caught by this alone
        with contextlib.suppress(KeyError, TypeError, AttributeError):
            fix_fingerprint(doc)
    return json.dumps(doc).encode()


@fuzz_settings("near_valid")
@given(near_valid_manifest())
def test_near_valid_manifests_are_judged_as_the_spec_judges_them(data: bytes) -> None:
    check_manifest_bytes(data, exact=True)


def _without_base(doc: dict[str, Any]) -> dict[str, Any]:
    """The sample as a plain full version (no base_version, no delta data, every element new):
    still valid."""
    doc["base_version"] = None
    for t in doc["tensors"]:
        t["delta"] = None
        t["changed"] = math.prod(t["shape"])
    fix_totals(doc)
    return doc


def _as_delta(doc: dict[str, Any]) -> dict[str, Any]:
    """The sample as a delta version (no full data): still valid."""
    doc["kind"] = "delta"
    for t in doc["tensors"]:
        t["full"] = None
    return doc


def _gap(edit: Callable[[dict[str, Any]], object]) -> Callable[[dict[str, Any]], bytes]:
    def make(doc: dict[str, Any]) -> bytes:
        edit(doc)
        return json.dumps(doc).encode()

    return make


# rules the reader once let through (tests/manifest_oracle.py found them); refused now
GAP_CASES: dict[str, Callable[[dict[str, Any]], bytes]] = {
    "unique (shard, key) of full data": _gap(
        lambda d: d["tensors"][1].update(full=d["tensors"][0]["full"])
    ),
    "totals.density is changed/elements": _gap(lambda d: d["totals"].update(density=0.75)),
    "totals.delta_bytes is the delta bytes": _gap(lambda d: d["totals"].update(delta_bytes=1)),
    "digest length of the algorithm": _gap(lambda d: d["tensors"][0].update(checksum="0123abcd")),
    "integers below 2^53": _gap(lambda d: d["totals"].update(raw_bytes=2**53)),
    "manifest is UTF-8 JSON": lambda d: json.dumps(d).encode("utf-16"),
    # issue 22: where two readers of FORMAT.md disagreed, the spec now says which is right
    "no duplicate key in an object": lambda d: (
        b'{"run_id": "another run", ' + json.dumps(d).encode()[1:]
    ),  # Python's json keeps the last: the real run_id
    "fingerprint over the tensors": _gap(
        lambda d: d.update(fingerprint=oracle.digest("another model", d["checksum_algorithm"]))
    ),
    "changed is numel without a base_version": _gap(
        lambda d: (
            _without_base(d)["tensors"][0].update(changed=d["tensors"][0]["changed"] - 1),
            fix_totals(d),
        )
    ),
    "tensor name": _gap(
        lambda d: (d["tensors"][0].update(name="__metadata__"), fix_fingerprint(d))
    ),
    "created_at": _gap(lambda d: d.update(created_at=1e20)),  # as 10**20 is refused
}


@pytest.mark.parametrize("rule", sorted(GAP_CASES))
def test_rules_the_reader_once_let_through_are_refused(rule: str) -> None:
    """Each rule here was a gap of the reader (the fuzzer's oracle found it): a manifest that
    breaks it alone is refused now, and the oracle still names that rule alone."""
    data = GAP_CASES[rule](json.loads(samples()[0].text))
    assert oracle.broken_rules_of_bytes(data) == [rule]
    with pytest.raises(ManifestError):
        Manifest.from_json(data)


def test_a_huge_integer_timestamp_is_a_manifest_error() -> None:
    data = _gap(lambda d: d.update(created_at=10**400))(json.loads(samples()[0].text))
    assert oracle.broken_rules_of_bytes(data) == ["integers below 2^53"]
    with pytest.raises(ManifestError, match="created_at"):  # was a bare OverflowError
        Manifest.from_json(data)


def test_optional_fields_read_as_null_when_absent() -> None:
    """FORMAT.md section 3: readers take an absent base_version, shard_dir, delta or full as
    null, an absent producer as {}, and attempt or parts null as absent."""

    def sample() -> dict[str, Any]:
        return cast(dict[str, Any], json.loads(samples()[0].text))

    edits: list[tuple[dict[str, Any], Callable[[dict[str, Any]], object]]] = [
        (_without_base(sample()), lambda d: d.pop("base_version")),
        (sample(), lambda d: d.pop("shard_dir")),
        (sample() | {"producer": {}}, lambda d: d.pop("producer")),
        (_without_base(sample()), lambda d: d["tensors"][0].pop("delta")),
        (_as_delta(sample()), lambda d: d["tensors"][0].pop("full")),
        (sample(), lambda d: d.update(attempt=None)),
        (sample(), lambda d: d["tensors"][0].update(parts=None)),
    ]
    for d, edit in edits:
        whole = Manifest.from_json(json.dumps(d))
        edit(d)
        assert oracle.broken_rules(d) == []
        assert Manifest.from_json(json.dumps(d)) == whole


def test_the_oracle_accepts_what_the_publisher_writes() -> None:
    for sample in samples():
        doc = json.loads(sample.text)
        assert oracle.broken_rules(doc) == []
        for t in doc["tensors"]:
            split_in_parts(doc, t)
        fix_fingerprint(doc)
        assert oracle.broken_rules(doc) == [], sample.encoding


def _edit(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def apply(d: dict[str, Any]) -> None:
        node = d
        for k in path[:-1]:
            node = node[k]
        if value is _DELETE:
            del node[path[-1]]
        else:
            node[path[-1]] = value

    return apply


_DELETE = object()
HOSTILE_EDITS: dict[str, Callable[[dict[str, Any]], None]] = {
    "unknown format_version": _edit(("format_version",), FORMAT_VERSION + 1),
    "format_version 0": _edit(("format_version",), 0),
    "format_version as a string": _edit(("format_version",), "1"),
    "no format_version": _edit(("format_version",), _DELETE),
    "another format": _edit(("format",), "pickle"),
    "negative version": _edit(("version",), -1),
    "huge version": _edit(("version",), 10**30),
    "float version": _edit(("version",), 1.0),
    "bool version": _edit(("version",), True),
    "NaN version": _edit(("version",), float("nan")),
    "Infinity in producer": _edit(("producer",), {"x": float("inf")}),
    "shard ../": _edit(("shards", 0, "file"), "../x.safetensors"),
    "shard absolute path": _edit(("shards", 0, "file"), "/etc/passwd"),
    "shard in a subdir": _edit(("shards", 0, "file"), "a/b.safetensors"),
    "shard with NUL": _edit(("shards", 0, "file"), "a\x00b"),
    "shard hidden": _edit(("shards", 0, "file"), ".tmp.delta-00000.safetensors"),
    "shard named manifest.json": _edit(("shards", 0, "file"), "manifest.json"),
    "shard name 300 chars": _edit(("shards", 0, "file"), "a" * 300),
    "negative shard size": _edit(("shards", 0, "bytes"), -1),
    "huge shard size": _edit(("shards", 0, "bytes"), 2**64),
    "shard role": _edit(("shards", 0, "role"), "pickle"),
    "negative dim": _edit(("tensors", 0, "shape"), [-1, 5]),
    "huge shape": _edit(("tensors", 0, "shape"), [2**40, 2**40]),
    "float dim": _edit(("tensors", 0, "shape"), [1.5]),
    "rank 65": _edit(("tensors", 0, "shape"), [1] * 65),
    "unknown dtype": _edit(("tensors", 0, "dtype"), "float128"),
    "empty tensor name": _edit(("tensors", 0, "name"), ""),
    "changed > numel": _edit(("tensors", 0, "changed"), 10**9),
    "delta shard out of range": _edit(("tensors", 0, "delta"), {
        "shard": 99, "mode": "sparse", "positions": "t0.pos", "values": "t0.val"}),
    "negative delta shard": _edit(("tensors", 0, "delta"), {
        "shard": -1, "mode": "sparse", "positions": "t0.pos", "values": "t0.val"}),
    "checksum not hex": _edit(("tensors", 0, "checksum"), "../../../../"),
    "unknown encoding": _edit(("encoding",), "rot13"),
    "unknown checksum": _edit(("checksum_algorithm",), "md5"),
    "base_version not version-1": _edit(("base_version",), 7),
    "tensors not a list": _edit(("tensors",), {"a": 1}),
    "totals wrong": _edit(("totals", "changed"), 1),
}  # fmt: skip


@pytest.mark.parametrize("what", sorted(HOSTILE_EDITS))
def test_hostile_manifest_edits_are_refused(what: str) -> None:
    sample = samples()[0]
    d = json.loads(sample.text)
    HOSTILE_EDITS[what](d)
    with pytest.raises(ManifestError):
        Manifest.from_json(json.dumps(d).encode())


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"{",
        b"[]",
        b"null",
        b'"manifest"',
        b"\xff\xfe\x00",
        b"[" * 100_000 + b"]" * 100_000,  # deeper than the recursion limit
        b'{"version": ' + b"9" * 5000 + b"}",  # more digits than int() accepts
        b'{"format": "asyncsync", "format_version": 1} trailing',
    ],
    ids=["empty", "open-brace", "list", "null", "string", "utf16-bom", "deep", "digits", "trail"],
)
def test_bad_json_is_a_manifest_error(data: bytes) -> None:
    with pytest.raises(ManifestError):
        Manifest.from_json(data)


# --------------------------------------------------------------------------- shard mutations

_ST_DTYPES = ["BOOL", "U8", "I8", "I16", "I32", "I64", "F16", "BF16", "F32", "F64", "F8_E4M3"]
_HEADER_VALUES = st.one_of(
    NASTY,
    st.sampled_from([*_ST_DTYPES, "F128", "U16", "U64", "C64", "F8_E8M0", "", "u8"]),
    st.lists(st.sampled_from([0, 1, 7, 2**31, 2**40, 2**62, 2**64 - 1]), min_size=2, max_size=2),
)


def _split(data: bytes) -> tuple[dict[str, Any], bytes] | None:
    if len(data) < 8:
        return None
    (n,) = struct.unpack("<Q", data[:8])
    try:
        return json.loads(data[8 : 8 + n]), data[8 + n :]
    except ValueError:
        return None


@st.composite
def mutate_header(draw: st.DrawFn, data: bytes, version: int) -> bytes:
    """Edit a safetensors header: offsets, dtypes, shapes, metadata; re-frame it."""
    split = _split(data)
    if split is None:
        return data
    header, body = split
    names = [k for k in header if k != "__metadata__"]
    op = draw(st.sampled_from(["json", "offsets", "overlap", "dtype", "shape", "meta", "length"]))
    if op == "json":
        header = draw(mutate_json(header, max_ops=2))
    elif op in ("offsets", "overlap", "dtype", "shape") and names:
        info = header[draw(st.sampled_from(names))]
        if op == "offsets":
            info["data_offsets"] = draw(_HEADER_VALUES)
        elif op == "overlap":
            other = header[draw(st.sampled_from(names))]
            info["data_offsets"] = list(other["data_offsets"])
            info["shape"], info["dtype"] = list(other["shape"]), other["dtype"]
        elif op == "dtype":
            info["dtype"] = draw(_HEADER_VALUES)
        else:
            info["shape"] = draw(_HEADER_VALUES)
    elif op == "meta":
        meta = header.setdefault("__metadata__", {})
        key = draw(st.sampled_from(["asyncsync.version", "asyncsync.run_id", "asyncsync.role"]))
        meta[key] = draw(
            st.sampled_from([str(version - 1), str(version + 1), "full", "delta", "0" * 16])
            | st.text(max_size=8)
        )
    raw = json.dumps(header).encode()
    n = len(raw)
    if op == "length":
        n = draw(st.sampled_from([0, 1, n - 1, n + 1, len(data), 100 << 20, 2**63, 2**64 - 1]))
    return struct.pack("<Q", n) + raw + body


@st.composite
def damage_body(draw: st.DrawFn, data: bytes) -> bytes:
    """Flip bits in the tensor data only (the header stays valid): reaches the decoders."""
    (n,) = struct.unpack("<Q", data[:8])
    start = 8 + n
    if start >= len(data):
        return data
    buf = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        i = len(buf) - 1 - draw(st.integers(0, len(buf) - start - 1))  # biased to the end
        if draw(st.booleans()):
            i = start + draw(st.integers(0, len(buf) - start - 1))  # ... or to the start
        buf[i] ^= 1 << draw(st.integers(0, 7))
    return bytes(buf)


@st.composite
def mutate_shard(draw: st.DrawFn, data: bytes, version: int) -> bytes:
    """One of: header edits, byte-level damage, bit flips in the tensor data (or a mix)."""
    how = draw(st.sampled_from(["header", "damage", "body", "header+damage"]))
    if how.startswith("header"):
        data = draw(mutate_header(data, version))
    if how.endswith("damage"):
        data = draw(damage_bytes(data))
    if how == "body":
        data = draw(damage_body(data))
    return data


@st.composite
def fuzzed_shard(draw: st.DrawFn) -> tuple[Sample, int, ShardInfo, bytes]:
    sample = draw(st.sampled_from(samples()))
    idx, info, data = draw(st.sampled_from(sample.shards))
    data = draw(mutate_shard(data, sample.manifest.version))
    return sample, idx, info, data


def check_shard(m: Manifest, idx: int, info: ShardInfo, data: bytes) -> None:
    """The property: FormatError, or updates an engine can take (or refuse with ApplyFailed)."""
    try:
        updates = decode_shard(m, info.role, idx, info, data, "fuzz")
    except FormatError as exc:
        event(f"refused: {_reason(exc)}")
        return
    event(f"decoded ({info.role})")
    for u in updates:
        e = u.entry
        if u.patch is not None:
            flat = torch.zeros(e.numel, dtype=int_dtype(e.torch_dtype))
            with contextlib.suppress(AsyncSyncError):  # an engine may still refuse it
                check_patch(u.patch, flat, e.name)
        else:
            assert u.full is not None
            assert u.full.dtype == e.torch_dtype and tuple(u.full.shape) == e.shape


@fuzz_settings("shard")
@given(fuzzed_shard())
def test_fuzzed_shards_decode_or_raise_a_format_error(
    case: tuple[Sample, int, ShardInfo, bytes],
) -> None:
    sample, idx, info, data = case
    check_shard(sample.manifest, idx, info, data)


def test_shard_metadata_naming_another_version_run_or_role_is_refused() -> None:
    sample = samples()[0]
    _idx, info, data = sample.shards[0]
    m = sample.manifest
    other = "delta" if info.role == "full" else "full"
    for kw in ({"version": m.version + 1}, {"run_id": "0" * 16}, {"role": other}):
        args: dict[str, Any] = {"version": m.version, "run_id": m.run_id, "role": info.role}
        args.update(kw)
        with pytest.raises(FormatError, match="another version"):
            parse_shard(data, where="x", **args)


# --------------------------------------------------------------------------- codec blobs


@dataclass(frozen=True)
class Blob:
    encoding: str
    mode: str
    positions: bytes
    values: bytes
    changed: int
    numel: int
    dtype: torch.dtype


@functools.cache
def blobs() -> tuple[Blob, ...]:
    out = []
    for sample in samples():
        m = sample.manifest
        tensors = {
            i: parse_shard(data, where="x") for i, s, data in sample.shards if s.role == "delta"
        }
        for e in m.tensors:
            if e.delta is None:
                continue
            t = tensors[e.delta.shard]
            pos = t[e.delta.positions].numpy().tobytes()
            val = t[e.delta.values].numpy().tobytes()
            dt = int_dtype(e.torch_dtype)
            out.append(Blob(m.encoding, e.delta.mode, pos, val, e.changed, e.numel, dt))
    return tuple(out)


@st.composite
def fuzzed_blob(draw: st.DrawFn) -> Blob:
    b = draw(st.sampled_from(blobs()))
    pos, val, changed, mode = b.positions, b.values, b.changed, b.mode
    for _ in range(draw(st.integers(1, 2))):
        op = draw(st.sampled_from(["pos", "val", "frame", "changed", "mode", "swap"]))
        if op == "pos":
            pos = draw(damage_bytes(pos))
        elif op == "val":
            val = draw(damage_bytes(val))
        elif op == "frame":  # a well-formed zstd frame with garbage inside: reaches the checks
            size = draw(st.sampled_from([len(val), b.changed * b.dtype.itemsize, 0, 1]))
            junk = zstandard.ZstdCompressor().compress(
                draw(st.binary(min_size=size, max_size=size))
            )
            if draw(st.booleans()):
                val = junk
            else:
                pos = bytes([draw(st.integers(0, 255))]) + junk
        elif op == "changed":
            changed = draw(st.integers(0, b.numel))
        elif op == "mode":
            mode = draw(st.sampled_from(["sparse", "dense", "", "pickle"]))
        else:
            pos, val = val, pos
    return Blob(b.encoding, mode, pos, val, changed, b.numel, b.dtype)


@fuzz_settings("codec")
@given(fuzzed_blob())
def test_fuzzed_delta_blobs_decode_or_raise_a_format_error(b: Blob) -> None:
    try:
        patch = decode_delta(
            b.encoding, b.mode, b.positions, b.values, changed=b.changed, numel=b.numel,
            dtype=b.dtype,
        )  # fmt: skip
    except FormatError as exc:
        event(f"refused: {_reason(exc)}")
        return
    event("decoded")
    check_patch(patch, torch.zeros(b.numel, dtype=b.dtype), "fuzz")


# --------------------------------------------------------------------------- end to end


class Target:
    """A root at v2, an agent whose LocalCheckpoint holds v1, and pristine copies to restore."""

    def __init__(self, tmp: Path, runner: asyncio.Runner) -> None:
        self.tmp, self.runner = tmp, runner
        self.root, self.ckpt = tmp / "root", tmp / "ckpt"
        s0 = mixed_state(0)
        self.states = [s0, mutate(s0, 0.05, seed=1), mutate(s0, 0.05, seed=2)]
        runner.run(self._build())
        self.m1, self.m2 = read_manifest(self.root, 1), read_manifest(self.root, 2)
        self.v2 = self.root / "v000000000002"
        self.pristine = {p.name: p.read_bytes() for p in self.v2.iterdir()}
        shutil.copytree(self.ckpt, tmp / "ckpt-v1", ignore=shutil.ignore_patterns("lock"))
        self.accepted = 0

    def _agent(self) -> ReceiverAgent:
        return ReceiverAgent(
            self.root,
            LocalCheckpoint(self.ckpt),
            "e",
            use_inotify=False,
            prefetch=False,
            verify_deadline=0,
        )

    async def _build(self) -> None:
        async with Publisher(self.root, bucket_bytes=4096, keyframe_interval=0) as pub:
            await pub.seed(self.states[0])
            await pub.publish(self.states[1])
            self.agent = self._agent()
            await self.agent.open()
            assert await self.agent.sync_once() == 1
            # v1's flush (state.json "synced") runs on after the ack: the checkpoint is copied
            # below, which must not race with it (its state.json temp file vanished mid-copy)
            await self.agent.engine.flushed()  # type: ignore[attr-defined]
            await pub.publish(self.states[2])

    def restore(self) -> None:
        for name, data in self.pristine.items():
            path = self.v2 / name
            if not path.is_file() or path.is_symlink() or path.read_bytes() != data:
                path.unlink(missing_ok=True)
                path.write_bytes(data)

    def sync_and_check(self) -> None:
        """The property: refused and untouched at v1, or bit-exact at the true v2."""
        try:
            got = self.runner.run(self.agent.sync_once())
        except AsyncSyncError as exc:
            event(f"refused: {type(exc).__name__}")
            assert self.agent.version == 1
            assert verify_checkpoint(self.ckpt, self.m1) == []
            ack = read_acks(self.root)["e"]
            assert ack.version == 1 and ack.fingerprint == self.m1.fingerprint
            return
        event("accepted")
        assert got == 2  # accepted: then it must be exactly the true v2
        assert verify_checkpoint(self.ckpt, self.m2) == []
        self.accepted += 1
        self.runner.run(self.agent.close())  # back to v1 for the next example
        shutil.rmtree(self.ckpt)
        shutil.copytree(self.tmp / "ckpt-v1", self.ckpt)
        write_ack(self.root, "e", 1, self.m1.fingerprint, self.m1.run_id)
        self.agent = self._agent()
        self.runner.run(self.agent.open())
        assert self.agent.version == 1

    def close(self) -> None:
        self.runner.run(self.agent.close())


@pytest.fixture
def target(tmp_path: Path) -> Any:
    with asyncio.Runner() as runner:
        t = Target(tmp_path, runner)
        yield t
        t.close()


def test_agent_refuses_a_fuzzed_next_manifest(target: Target) -> None:
    text = target.pristine["manifest.json"]

    @fuzz_settings("e2e_manifest")
    @given(st.data())
    def run(data: st.DataObject) -> None:
        target.restore()
        if data.draw(st.integers(0, 9)) == 0:
            fuzzed = data.draw(st.binary(max_size=512))
        else:
            doc = data.draw(mutate_json(json.loads(text)))
            fuzzed = json.dumps(doc).encode() if _dumpable(doc) else b"{}"
        (target.v2 / "manifest.json").write_bytes(fuzzed)
        target.sync_and_check()

    run()


def test_agent_refuses_a_fuzzed_next_shard(target: Target) -> None:
    m2 = target.m2
    doc = json.loads(target.pristine["manifest.json"])

    @fuzz_settings("e2e_shard")
    @given(st.data())
    def run(data: st.DataObject) -> None:
        target.restore()
        k = data.draw(st.integers(0, len(m2.shards) - 1))
        info = m2.shards[k]
        raw = data.draw(mutate_shard(target.pristine[info.file], m2.version))
        (target.v2 / info.file).write_bytes(raw)
        if data.draw(st.integers(0, 4)) > 0:  # re-sign: size and checksum match the new bytes
            d = copy.deepcopy(doc)
            d["shards"][k]["bytes"] = len(raw)
            d["shards"][k]["checksum"] = checksum_bytes(raw, m2.checksum_algorithm)
            total = sum(s["bytes"] for s in d["shards"])
            d["totals"]["wire_bytes"] = d["totals"]["delta_bytes"] = total
            (target.v2 / "manifest.json").write_text(json.dumps(d))
        target.sync_and_check()

    run()


# --------------------------------------------------------------------------- never pickle

_PICKLERS = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}
PACKAGES = [Path(__file__).resolve().parent.parent / p for p in ("asyncsync", "receiver")]


def unpickling_calls(source: str, where: str) -> list[str]:
    """Places in ``source`` that import a pickler or load data in a way that can unpickle."""
    found = []
    for node in ast.walk(ast.parse(source)):
        line = f"{where}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names if a.name.split(".")[0] in _PICKLERS]
            found += [f"{line}: import {m}" for m in mods]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in _PICKLERS:
            found.append(f"{line}: from {node.module} import ...")
        elif isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            kw = {k.arg: ast.unparse(k.value) for k in node.keywords}
            args = [ast.unparse(a) for a in node.args]
            torch_load = name.split(".")[-2:] == ["torch", "load"] and "safetensors" not in name
            if torch_load and kw.get("weights_only") != "True":
                found.append(f"{line}: {name}() without weights_only=True")
            elif name in ("np.load", "numpy.load") and kw.get("allow_pickle") not in (
                None,
                "False",
            ):
                found.append(f"{line}: {name}(allow_pickle=...)")
            elif name.endswith(("read_pickle", "torch.jit.load")):
                found.append(f"{line}: {name}()")
            elif name in ("__import__", "importlib.import_module") and any(
                a.strip("'\"").split(".")[0] in _PICKLERS for a in args
            ):
                found.append(f"{line}: {name}({args[0]})")
    return found


def test_nothing_in_the_packages_can_unpickle() -> None:
    files = sorted(p for pkg in PACKAGES for p in pkg.rglob("*.py"))
    assert len(files) > 20
    found = [f for p in files for f in unpickling_calls(p.read_text(), str(p))]
    assert found == [], "only safetensors and JSON may be parsed from the shared directory"


def test_the_unpickling_scan_finds_what_it_looks_for() -> None:
    bad = (
        "import pickle\nfrom dill import loads\nimport torch, numpy as np\n"
        "torch.load(f)\ntorch.load(f, weights_only=False)\nnp.load(f, allow_pickle=True)\n"
        "__import__('cPickle')\n"
    )
    assert len(unpickling_calls(bad, "x")) == 6
    good = "import json\ntorch.load(f, weights_only=True)\nnp.load(f)\n"
    assert unpickling_calls(good, "x") == []
