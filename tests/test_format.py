"""Manifest and ack records: round trip and rejection of malformed or unsafe input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from asyncsync.errors import ManifestError
from asyncsync.format import (
    FORMAT_VERSION,
    AckRecord,
    DeltaRef,
    FullRef,
    Manifest,
    ShardInfo,
    TensorEntry,
    Totals,
    check_engine_id,
    check_file_name,
    fingerprint,
    parse_version_dir,
    version_dir_name,
)

H = "0123456789abcdef0123456789abcdef"


def make_manifest(**over: Any) -> Manifest:
    tensors = (
        TensorEntry(
            "a.weight", "bfloat16", (4, 5), H, 3, DeltaRef(0, "sparse", "t0.pos", "t0.val")
        ),
        TensorEntry("b", "int64", (), H, 0),
    )
    shards = (ShardInfo("delta-00000.safetensors", "delta", 100, H),)
    fields: dict[str, Any] = dict(
        version=5,
        base_version=4,
        kind="delta",
        encoding="xef",
        checksum_algorithm="xxh3-128",
        run_id="abc",
        shards=shards,
        tensors=tensors,
        totals=Totals(2, 21, 3, 3 / 21, 48, 100, 100, 80),
        fingerprint=fingerprint(tensors, "xxh3-128"),
        created_at=1.0,
        committed_at=2.0,
    )
    fields.update(over)
    return Manifest(**fields)


def test_round_trip() -> None:
    m = make_manifest()
    m.validate()
    back = Manifest.from_json(m.to_json())
    assert back == m
    assert back.tensor_map()["a.weight"].numel == 20
    assert back.tensors[1].shape == ()


def mutated(change: Any) -> str:
    d = json.loads(make_manifest().to_json())
    change(d)
    return json.dumps(d)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda d: d.update(format_version=FORMAT_VERSION + 1),
            r"format_version 4 is not supported",
        ),
        (lambda d: d.update(format="other"), r"not an asyncsync manifest"),
        (lambda d: d.update(version=-1), r"'version'=-1 out of range"),
        (lambda d: d.update(version=10**15), r"'version'=1000000000000000 out of range"),
        (lambda d: d.update(version="5"), r"'version' must be .*got str"),
        (lambda d: d.update(version=True), r"'version' must be .*got a bool"),
        (lambda d: d.update(base_version=2), r"base_version 2 must be version-1"),
        (lambda d: d.update(kind="weird"), r"kind must be 'full' or 'delta'"),
        (lambda d: d.update(shards={}), r"'shards' must be .*list"),
        (lambda d: d["shards"][0].update(file="../../etc/passwd"), r"file '\.\./\.\./etc/passwd'"),
        (lambda d: d["shards"][0].update(file="/abs/path"), r"file '/abs/path'"),
        (lambda d: d["shards"][0].update(file=".hidden"), r"file '\.hidden'"),
        (lambda d: d["shards"][0].update(file="manifest.json"), r"may not be named manifest\.json"),
        (lambda d: d["shards"][0].update(bytes=-5), r"'bytes'=-5 out of range"),
        (lambda d: d["shards"][0].update(checksum="XYZ"), r"'checksum' must be a lowercase hex"),
        (lambda d: d["tensors"][0].update(dtype="complex128"), r"unknown dtype 'complex128'"),
        (
            lambda d: d["tensors"][0].update(shape=[-1, 5]),
            r"shape must be a list of non-negative ints",
        ),
        (lambda d: d["tensors"][0].update(shape=[2**40, 2**40]), r"shape .* is too large"),
        (lambda d: d["tensors"][0].update(changed=10**6), r"changed=1000000 exceeds numel"),
        (lambda d: d["tensors"][0]["delta"].update(shard=7), r"shard index 7 out of range"),
        (lambda d: d["tensors"][0].update(delta=None), r"changed=3 but no delta data"),
        (lambda d: d["tensors"][1].update(name="a.weight"), r"duplicate tensor names"),
        (lambda d: d["totals"].update(changed=4), r"totals\.changed does not match"),
        (lambda d: d["totals"].update(density=-1), r"'density'=-1 must be"),
        (lambda d: d["totals"].update(wire_bytes=1), r"totals\.wire_bytes does not match"),
        (lambda d: d.pop("fingerprint"), r"missing field 'fingerprint'"),
        (lambda d: d.update(shard_dir="/elsewhere"), r"shard_dir is only allowed on full versions"),
    ],
)
def test_rejects_bad_manifest(change: Any, message: str) -> None:
    """Each case with its own message: a regression hidden behind an earlier check fails."""
    with pytest.raises(ManifestError, match=message):
        Manifest.from_json(mutated(change))


@pytest.mark.parametrize(
    "text", [b"", b"{", b"[]", b"null", b"\xff\xfe", b'{"format": "asyncsync"}']
)
def test_rejects_garbage(text: bytes) -> None:
    with pytest.raises(ManifestError):
        Manifest.from_json(text)


def test_full_version_rules() -> None:
    t = (TensorEntry("w", "float32", (2,), H, 2, None, FullRef(0, "w")),)
    shards = (ShardInfo("full-00000.safetensors", "full", 10, H),)
    m = make_manifest(
        kind="full",
        base_version=None,
        tensors=t,
        shards=shards,
        totals=Totals(1, 2, 2, 1.0, 8, 10, 0, 0),
        fingerprint=fingerprint(t, "xxh3-128"),
    )
    assert Manifest.from_json(m.to_json()).is_keyframe
    bad = json.loads(m.to_json())
    bad["tensors"][0]["full"] = None
    with pytest.raises(ManifestError, match="full data"):
        Manifest.from_json(json.dumps(bad))


def test_paths_and_names() -> None:
    assert version_dir_name(42) == "v000000000042"
    assert parse_version_dir("v000000000042") == 42
    assert parse_version_dir("v42") is None
    assert parse_version_dir(".tmp.v000000000042") is None
    # a final newline ($ matched before it) and other scripts' digits (\d matched them)
    assert parse_version_dir("v000000000042\n") is None
    assert parse_version_dir("v" + "\u0660" * 10 + "\u0664\u0662") is None
    for bad in ["../x", "a/b", "", ".x", "x" * 300, "a\x00b", "a.safetensors\n"]:
        with pytest.raises(ManifestError):
            check_file_name(bad)
    assert check_engine_id("node-1.gpu_0") == "node-1.gpu_0"
    for bad in ["", "../e", "a/b", "-x", "x" * 200, "gpu0\n"]:
        with pytest.raises(ManifestError):
            check_engine_id(bad)


def test_ack_round_trip_and_rejection() -> None:
    a = AckRecord("e1", 3, H, "run", 5.0, "host")
    assert AckRecord.from_json(a.to_json()) == a
    d = json.loads(a.to_json())
    d["engine_id"] = "../evil"
    with pytest.raises(ManifestError):
        AckRecord.from_json(json.dumps(d))
    d = json.loads(a.to_json())
    d["fingerprint"] = H + "\n"  # (a hex field: $ matched before a final newline)
    with pytest.raises(ManifestError):
        AckRecord.from_json(json.dumps(d))
    d = json.loads(a.to_json())
    d["version"] = -3
    with pytest.raises(ManifestError):
        AckRecord.from_json(json.dumps(d))


def test_fingerprint_depends_on_every_field() -> None:
    base = [TensorEntry("w", "float32", (2,), H, 0)]
    fp = fingerprint(base, "xxh3-128")
    assert fp == fingerprint(list(reversed(base)), "xxh3-128")
    for other in [
        TensorEntry("v", "float32", (2,), H, 0),
        TensorEntry("w", "int32", (2,), H, 0),
        TensorEntry("w", "float32", (1, 2), H, 0),
        TensorEntry("w", "float32", (2,), H[::-1], 0),
    ]:
        assert fingerprint([other], "xxh3-128") != fp


async def test_manifest_cache_rereads_only_a_changed_file(tmp_path: Path) -> None:
    from asyncsync import Publisher
    from asyncsync.format.store import ManifestCache
    from tests.conftest import mixed_state

    async with Publisher(tmp_path) as pub:
        await pub.seed(mixed_state(0))
    cache = ManifestCache()
    first = cache.get(tmp_path, 0)
    assert cache.get(tmp_path, 0) is first  # unchanged file: no re-parse
    path = tmp_path / "v000000000000" / "manifest.json"
    text = path.read_text().replace('"producer":{', '"producer":{"note":"again",', 1)
    path.write_text(text)  # republished with other contents
    again = cache.get(tmp_path, 0)
    assert again is not first and again.producer["note"] == "again"
    path.unlink()
    with pytest.raises(FileNotFoundError):
        cache.get(tmp_path, 0)


async def test_manifest_cache_is_shared_by_threads(tmp_path: Path) -> None:
    """A receiver's syncs and its stream read manifests through one cache from several
    threads at once: gets of more versions than it keeps, from 8 threads, each returning the
    version asked for, none failing. A guard: unlocked, two evictions of one version could
    meet (KeyError), or ``min`` iterate the dict while another thread grew it; this run did
    not make that happen on the unlocked cache (a GIL switch mid-eviction is rare)."""
    import threading

    from asyncsync import Publisher
    from asyncsync.format.store import ManifestCache
    from tests.conftest import mixed_state, mutate

    sd = mixed_state(0)
    async with Publisher(tmp_path, keyframe_interval=0) as pub:
        await pub.seed(sd)
        for v in range(1, 6):
            await pub.publish(mutate(sd, 0.05, seed=v))
    cache = ManifestCache(size=2)
    errors: list[BaseException] = []
    go = threading.Barrier(8)

    def hammer(k: int) -> None:
        go.wait()
        try:
            for i in range(300):
                v = (k + i) % 6
                assert cache.get(tmp_path, v).version == v
        except BaseException as exc:  # reported below, by the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=hammer, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert len(cache._entries) <= 2


def test_unknown_fields_are_ignored_and_integers_are_json_integers() -> None:
    """FORMAT.md 11.3: a later writer may add fields (ignored by every reader, in every
    record); an integer field written with a fraction or an exponent is refused."""
    m = make_manifest()
    d = json.loads(m.to_json())
    d["future_field"] = {"anything": [1, 2]}
    d["tensors"][0]["future_field"] = "x"
    d["tensors"][0]["delta"]["future_field"] = 1.5
    d["shards"][0]["future_field"] = None
    d["totals"]["future_field"] = 0
    assert Manifest.from_json(json.dumps(d)) == m
    a = json.loads(AckRecord("e1", 3, H, "run", 5.0, "host").to_json())
    assert AckRecord.from_json(json.dumps({**a, "future_field": 1})).version == 3
    for bad in ('"version": 5.0', '"version": 5e0'):
        with pytest.raises(ManifestError, match="'version'"):
            Manifest.from_json(m.to_json().replace('"version":5', bad))


@pytest.mark.parametrize("kind", ["delta", "full", "both", "none", "parts"])
def test_entry_to_dict_is_dataclasses_asdict(kind: str) -> None:
    """TensorEntry.to_dict writes its fields out by hand (it runs once per tensor of every
    version): it must stay what ``dataclasses.asdict`` makes of the record, field for field
    and in order (the manifest's bytes), with ``shape`` a list and no ``parts`` key when the
    tensor is not in parts. A field added to the record and not to to_dict fails here."""
    import dataclasses

    from asyncsync.format import TensorPart

    delta = DeltaRef(2, "sparse", "t7.pos", "t7.val") if kind in ("delta", "both") else None
    full = FullRef(1, "w") if kind in ("full", "both") else None
    parts = None
    if kind == "parts":
        parts = (TensorPart(0, 4, H, 1, DeltaRef(0, "dense", "a", "b")), TensorPart(4, 2, H, 0))
    entry = TensorEntry("w", "bfloat16", (2, 3), H, 1, delta, full, parts)
    want = dataclasses.asdict(entry)
    want["shape"] = [2, 3]
    if parts is None:
        del want["parts"]
    else:
        want["parts"] = [dataclasses.asdict(p) for p in parts]
    got = entry.to_dict()
    assert json.dumps(got) == json.dumps(want)
    assert TensorEntry.from_dict(got, "t") == entry
