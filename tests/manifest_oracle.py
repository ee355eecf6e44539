"""A second reader of docs/FORMAT.md sections 3 and 3.1: which rules does a manifest break?

Written from the spec alone, not from ``asyncsync.format``, so that tests/test_fuzz.py can ask
both and insist they agree: a rule weakened in ``Manifest.validate`` no longer weakens the judge
of the fuzzer. Plain on purpose: one check per rule of the spec, every rule checked (not only
the first broken one), and :func:`broken_rules` names the rules a manifest breaks (none: valid).

What the spec says that this reader does not check, because it needs more than the bytes
(``version`` equal to the directory's number, shard sizes and checksums against the files) or
because the spec gives no rule (``model_bytes``, ``raw_bytes``): see FORMAT.md. Issue 22 added
rules this reader checks: no duplicate key in an object, numbers (timestamps, density) within
0..2^53-1 however written, ``fingerprint`` recomputed from the tensor entries, ``changed ==
numel`` with no base, tensor names of 1 to 4096 characters other than ``__metadata__``, and
JSON no denser than a valid manifest ("Conventions").

:data:`KNOWN_GAPS` lists the rules of the spec that asyncsync's reader does not enforce, with
what it does instead; tests/test_fuzz.py lets a manifest that breaks only those through and
checks that each gap is still one (a fixed gap must leave the list).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import xxhash

ENCODINGS = ("xef", "indices", "deltas", "deltas_zstd")  # section 3, `encoding`
DIGEST_HEX = {"xxh3-128": 32, "xxh3-64": 16}  # `checksum_algorithm`: hex digits of a digest
HASHES = {"xxh3-128": xxhash.xxh3_128, "xxh3-64": xxhash.xxh3_64}
DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32",
          "float64", "float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64",
          "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "complex64")  # fmt: skip
INT_LIMIT = 2**53  # "all integers in JSON are exact (below 2^53)"
MAX_VERSION = 10**12 - 1  # a version directory is "v" + 12 decimal digits
SHARD_LIMIT = 2**40  # section 1, Sizes: "a shard's bytes is below 2^40"
FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
HEX = re.compile(r"[0-9a-f]+")

#: rule -> what asyncsync's reader does instead (reported, not changed in the spec)
KNOWN_GAPS: dict[str, str] = {}

_ABSENT = object()


def digest(text: str, algorithm: str) -> str:
    return str(HASHES[algorithm](text.encode()).hexdigest())


def composite(parts: list[dict[str, Any]], algorithm: str) -> str:
    """Section 3.1: the checksum of the lines ``offset:numel:checksum``, joined with newlines."""
    lines = [f"{p['offset']}:{p['numel']}:{p['checksum']}" for p in parts]
    return digest("\n".join(lines), algorithm)


class _Duplicate(Exception):
    pass


def parse(data: bytes) -> Any:
    """The JSON value of a manifest's bytes, ``_ABSENT`` when they are not UTF-8 JSON, or
    ``_DUPLICATE`` when an object repeats a key ("Conventions": readers refuse it)."""

    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in items]
        if len(set(keys)) != len(keys):
            raise _Duplicate
        return dict(items)

    try:
        return json.loads(data.decode("utf-8"), parse_constant=refuse, object_pairs_hook=pairs)
    except _Duplicate:
        return _DUPLICATE
    except (ValueError, RecursionError):
        return _ABSENT


_DUPLICATE = object()


def too_dense(data: bytes) -> bool:
    """ "Conventions": a file of 64 KiB or more with more than one ``{``/``[`` per 16 bytes or
    one ``,``/``:`` per 5 bytes is refused unparsed (the bytes are counted, strings included)."""
    if len(data) < 64 << 10:
        return False
    containers = data.count(b"{") + data.count(b"[")
    separators = data.count(b",") + data.count(b":")
    return containers * 16 > len(data) or separators * 5 > len(data)


def broken_rules_of_bytes(data: bytes) -> list[str]:
    if too_dense(data):
        return ["JSON no denser than a valid record"]
    doc = parse(data)
    if doc is _DUPLICATE:
        return ["no duplicate key in an object"]
    return ["manifest is UTF-8 JSON"] if doc is _ABSENT else broken_rules(doc)


def fingerprint(tensors: list[dict[str, Any]], algorithm: str) -> str:
    """Section 3, ``fingerprint``: the lines ``name\tdtype\tshape\tchecksum`` of every tensor
    sorted by name, joined with newlines, shape's dims joined by commas."""
    lines = [
        f"{t['name']}\t{t['dtype']}\t{','.join(str(n) for n in t['shape'])}\t{t['checksum']}"
        for t in sorted(tensors, key=lambda t: t["name"])
    ]
    return digest("\n".join(lines), algorithm)


def _is_int(v: Any, lo: int = 0, hi: int = INT_LIMIT) -> bool:
    return type(v) is int and lo <= v <= hi


class _Rules:
    def __init__(self) -> None:
        self.broken: list[str] = []

    def check(self, ok: object, rule: str) -> bool:
        if not ok and rule not in self.broken:
            self.broken.append(rule)
        return bool(ok)

    def int(self, v: Any, rule: str, lo: int = 0, hi: int = INT_LIMIT - 1) -> bool:
        """An integer in lo..hi; by default any exact one (below 2^53). Exactly 2^53 where
        any exact integer may stand breaks its own rule (a known gap), not the field's."""
        if _is_int(v, lo) and v == INT_LIMIT and hi == INT_LIMIT - 1:
            return self.check(False, "integers below 2^53")
        return self.check(_is_int(v, lo, hi), rule)

    def number(self, v: Any, rule: str) -> bool:
        if type(v) is int and v >= INT_LIMIT:
            return self.check(False, "integers below 2^53")  # (float(10**400) overflows)
        # "Conventions": a number is in 0..2^53-1 whether written as an integer or not
        ok = type(v) in (int, float) and math.isfinite(v) and 0 <= v < INT_LIMIT
        return self.check(ok, rule)

    def digest(self, v: Any, algorithm: str | None, rule: str) -> bool:
        if not self.check(isinstance(v, str) and HEX.fullmatch(v), rule):
            return False
        return algorithm is None or self.check(
            len(v) == DIGEST_HEX[algorithm], "digest length of the algorithm"
        )

    def present(self, d: dict[str, Any], key: str) -> Any:
        """``d[key]``; FORMAT.md section 3: readers read an absent optional field as null."""
        return d.get(key)


def broken_rules(doc: Any) -> list[str]:
    """The rules of FORMAT.md sections 3 and 3.1 that ``doc`` (a parsed manifest) breaks."""
    r = _Rules()
    if not r.check(isinstance(doc, dict), "manifest is a JSON object"):
        return r.broken
    r.check(doc.get("format") == "asyncsync", "format is asyncsync")
    fv = doc.get("format_version")
    r.check(type(fv) is int and fv in (1, 2, 3), "format_version 1, 2 or 3")
    r.check(isinstance(doc.get("run_id"), str), "run_id is a string")
    version = doc.get("version")
    r.int(version, "version", hi=MAX_VERSION)
    base = r.present(doc, "base_version")
    if base is not None:
        r.int(base, "base_version", hi=MAX_VERSION)
    kind = doc.get("kind")
    r.check(kind in ("full", "delta"), "kind full or delta")
    r.check(isinstance(doc.get("encoding"), str) and doc["encoding"] in ENCODINGS, "encoding")
    algo = doc.get("checksum_algorithm")
    if not r.check(isinstance(algo, str) and algo in DIGEST_HEX, "checksum_algorithm"):
        algo = None  # digests are then only checked for being hex
    shard_dir = r.present(doc, "shard_dir")
    r.check(shard_dir is None or (isinstance(shard_dir, str) and shard_dir), "shard_dir")
    producer = r.present(doc, "producer")
    r.check("producer" not in doc or isinstance(producer, dict), "producer is an object")
    r.number(doc.get("created_at"), "created_at")
    r.number(doc.get("committed_at"), "committed_at")
    r.digest(doc.get("fingerprint"), algo, "fingerprint")
    if "attempt" in doc:
        a = doc["attempt"]
        r.check(a is None or (isinstance(a, str) and HEX.fullmatch(a)), "attempt")

    # -- the invariants of the version as a whole
    if base is not None and _is_int(base) and _is_int(version):
        r.check(base == version - 1, "base_version is version-1")
    r.check(kind != "delta" or base is not None, "a delta version has a base_version")
    r.check(shard_dir is None or kind == "full", "shard_dir only on full versions")

    # -- shards
    shards = doc.get("shards")
    roles: list[Any] = []
    sizes: list[int | None] = []
    if r.check(isinstance(shards, list), "shards is a list"):
        files = []
        for s in shards:
            if not r.check(isinstance(s, dict), "a shard is an object"):
                roles.append(None)
                sizes.append(None)
                continue
            f = s.get("file")
            ok = isinstance(f, str) and FILE_NAME.fullmatch(f) and ".." not in f
            r.check(ok, "shard file name")
            files.append(f)
            r.check(f != "manifest.json", "no shard named manifest.json")
            role = s.get("role")
            r.check(role in ("delta", "full"), "shard role")
            roles.append(role)
            size = s.get("bytes")
            sizes.append(size if r.int(size, "shard bytes", hi=SHARD_LIMIT - 1) else None)
            r.digest(s.get("checksum"), algo, "shard checksum")
        hashable = [f for f in files if isinstance(f, str)]
        r.check(len(set(hashable)) == len(hashable), "unique shard file names")

    # -- tensors
    tensors = doc.get("tensors")
    if not r.check(isinstance(tensors, list), "tensors is a list"):
        tensors = []
    names: list[str] = []
    numels: list[int | None] = []
    changes: list[int | None] = []
    keys: set[tuple[int, str]] = set()

    def ref(v: Any, role: str, fields: tuple[str, ...]) -> None:
        """A span's ``delta`` or ``full``: an object naming a shard of that role and keys."""
        if v is None:
            return
        ok = isinstance(v, dict) and _is_int(v.get("shard"), 0, INT_LIMIT - 1)
        ok = ok and all(isinstance(v.get(k), str) for k in fields)
        if role == "delta":
            ok = ok and v.get("mode") in ("sparse", "dense")
        if not r.check(ok, f"{role} reference"):
            return
        i = v["shard"]
        if r.check(i < len(roles), "shard index in range"):
            r.check(roles[i] == role, "shard of the reference's role")
        for k in fields:
            rule = "unique (shard, key)" if role == "delta" else "unique (shard, key) of full data"
            r.check((i, v[k]) not in keys, rule)
            keys.add((i, v[k]))

    def span(changed: Any, delta: Any, full: Any, numel: Any) -> None:
        """The rules of section 3 that apply to each part, or to a tensor not in parts."""
        ref(delta, "delta", ("positions", "values"))
        ref(full, "full", ("key",))
        r.check(kind != "delta" or full is None, "a delta version carries no full data")
        r.check(kind != "full" or full is not None, "a full version has every tensor's full data")
        if base is None:
            r.check(delta is None, "no delta without a base_version")
            if _is_int(changed) and _is_int(numel):
                r.check(changed == numel, "changed is numel without a base_version")
        elif _is_int(changed):
            r.check((delta is not None) == (changed > 0), "delta if and only if changed > 0")

    for t in tensors:
        if not r.check(isinstance(t, dict), "a tensor is an object"):
            numels.append(None)
            changes.append(None)
            continue
        name = t.get("name")
        ok = isinstance(name, str) and 0 < len(name) <= 4096 and name != "__metadata__"
        if r.check(ok, "tensor name"):
            names.append(name)
        r.check(isinstance(t.get("dtype"), str) and t["dtype"] in DTYPES, "tensor dtype")
        shape = t.get("shape")
        shape_ok = isinstance(shape, list) and all(r.int(n, "tensor shape") for n in shape)
        r.check(shape_ok, "tensor shape")
        numel = math.prod(shape) if shape_ok else None
        numels.append(numel)
        r.digest(t.get("checksum"), algo, "tensor checksum")
        changed = t.get("changed")
        changes.append(changed if r.int(changed, "tensor changed") else None)
        if numel is not None and _is_int(changed):
            r.check(changed <= numel, "changed at most numel")
        parts = t.get("parts", _ABSENT)
        delta, full = r.present(t, "delta"), r.present(t, "full")
        if parts is _ABSENT or parts is None:
            span(changed, delta, full, numel)
            continue
        # -- section 3.1
        r.check(fv in (2, 3), "parts need format_version 2 or later")
        r.check(delta is None and full is None, "a tensor in parts has no delta or full")
        if not r.check(isinstance(parts, list) and parts, "parts is a non-empty list"):
            continue
        end, total, sums_ok = 0, 0, True
        for p in parts:
            if not r.check(isinstance(p, dict), "a part is an object"):
                sums_ok = False
                continue
            ok = r.int(p.get("offset"), "part offset") & r.int(p.get("numel"), "part numel", lo=1)
            ok &= r.digest(p.get("checksum"), algo, "part checksum")
            pc = p.get("changed")
            ok &= r.int(pc, "part changed")
            if not ok:
                sums_ok = False
                continue
            r.check(pc <= p["numel"], "changed at most numel")
            r.check(p["offset"] == end, "parts tile the tensor in offset order")
            end += p["numel"]
            total += pc
            span(pc, r.present(p, "delta"), r.present(p, "full"), p["numel"])
        if sums_ok:
            if numel is not None:
                r.check(end == numel, "parts tile the tensor in offset order")
            if _is_int(changed):
                r.check(changed == total, "changed is the sum of the parts' changed")
            if algo is not None:
                want = composite(parts, algo)
                r.check(t.get("checksum") == want, "checksum is the composite of the parts'")
    r.check(len(set(names)) == len(names), "unique tensor names")
    fp = doc.get("fingerprint")
    if algo is not None and r.broken == [] and isinstance(fp, str):  # every entry well formed
        r.check(fp == fingerprint(tensors, algo), "fingerprint over the tensors")

    # -- totals
    totals = doc.get("totals")
    if not r.check(isinstance(totals, dict), "totals is an object"):
        return r.broken
    fields = ("tensors", "elements", "changed", "model_bytes", "wire_bytes", "delta_bytes")
    got = {k: totals.get(k) if r.int(totals.get(k), f"totals.{k}") else None for k in fields}
    r.int(totals.get("raw_bytes"), "totals.raw_bytes")
    density = totals.get("density")
    r.number(density, "totals.density")
    r.check(got["tensors"] in (None, len(tensors)), "totals.tensors is the number of tensors")
    if None not in numels and got["elements"] is not None:
        r.check(got["elements"] == sum(numels), "totals.elements is the sum of numel")
    if None not in changes and got["changed"] is not None:
        r.check(got["changed"] == sum(changes), "totals.changed is the sum of changed")
    if None not in numels + changes and type(density) in (int, float):
        elements, changed = sum(numels), sum(changes)
        want = changed / elements if elements else 0.0
        r.check(math.isclose(density, want, rel_tol=1e-9), "totals.density is changed/elements")
    if None not in sizes and None not in roles:
        listed = list(zip(sizes, roles, strict=True))
        wire = sum(n for n, role in listed if not shard_dir or role == "delta")
        delta_bytes = sum(n for n, role in listed if role == "delta")
        r.check(got["wire_bytes"] in (None, wire), "totals.wire_bytes is the bytes written")
        r.check(got["delta_bytes"] in (None, delta_bytes), "totals.delta_bytes is the delta bytes")
    return r.broken
