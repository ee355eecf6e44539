"""Tests that kill the small mutations of core code no other test noticed (issue 13).

Each test names the mutation it catches. (The fsync/ordering ones are in test_durability.py,
the ack rewrite in test_lease.py, ``bumped`` in test_tensor_set.py.)
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from asyncsync import ChecksumMismatch, ManifestError, Publisher
from asyncsync.format.manifest import Manifest
from asyncsync.format.store import list_versions, read_manifest
from asyncsync.publish.retention import RetentionPolicy, _dir_bytes, collect
from receiver import plan
from receiver.plan import latest_version
from receiver.watch import _version_events
from tests.conftest import mixed_state, mutate
from tests.test_engines import build_manifest, delta_batches, init_checkpoint


async def _chain(root: Path, n: int, keyframe_interval: int = 0) -> None:
    sd = mixed_state(0)
    async with Publisher(root, bucket_bytes=8192, keyframe_interval=keyframe_interval) as pub:
        await pub.seed(sd)
        for i in range(1, n + 1):
            sd = mutate(sd, 0.03, seed=i)
            await pub.publish(sd)


async def test_validate_refuses_two_tensors_sharing_one_shard_key(tmp_path: Path) -> None:
    """Mutation: Manifest.validate accepting two tensors on one (shard, key). The oracle here is
    the raw JSON, edited by hand, not validate itself."""
    await _chain(tmp_path, 1)
    path = tmp_path / "v000000000001" / "manifest.json"
    d = json.loads(path.read_text())
    with_delta = [t for t in d["tensors"] if t.get("delta")]
    a, b = with_delta[0], with_delta[1]
    b["delta"]["positions"] = a["delta"]["positions"]
    with pytest.raises(ManifestError, match=r"shard key .* used twice"):
        Manifest.from_json(json.dumps(d))


async def test_localcheckpoint_verifies_every_changed_tensor_not_only_touched(
    tmp_path: Path,
) -> None:
    """Mutation: first_mismatch hashing only the tensors an update touched. A delta whose
    changed tensor never arrives must fail at commit, even with no recorded checksums to
    compare (the held version was recorded with another algorithm)."""
    sd0 = mixed_state(0)
    ck = await init_checkpoint(tmp_path / "ck", sd0)
    ck._ps = dataclasses.replace(ck._ps, checksum_algorithm="xxh3-64")  # no shortcut by checksum
    sd1 = mutate(sd0, 0.05, seed=1, names=["model.layers.0.weight", "model.layers.1.weight"])
    m = build_manifest(sd1, 1, base=sd0)
    batches = delta_batches(m, sd0, sd1)
    only_first = [[u for u in b if u.entry.name == "model.layers.0.weight"] for b in batches]
    await ck.begin(m, "delta")
    for b in only_first:
        await ck.apply(b)
    with pytest.raises(ChecksumMismatch) as ei:
        await ck.commit()
    assert ei.value.tensor == "model.layers.1.weight" and ck.state.version == 0
    await ck.close()


async def test_latest_version_probes_past_a_stale_listing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mutation: latest_version not probing v{N+1}/manifest.json. The scan is made stale (as a
    network filesystem's cached listing is): only the exact-path probe finds v2 and v3."""
    await _chain(tmp_path, 3)
    monkeypatch.setattr(plan, "newest_committed", lambda root: 1)
    assert latest_version(tmp_path, None) == 3
    assert latest_version(tmp_path, 1) == 3


async def test_keep_bytes_stops_at_its_budget(tmp_path: Path) -> None:
    """Mutation: keep_bytes going on past its budget (or keeping the version that crosses it)."""
    await _chain(tmp_path, 7, keyframe_interval=6)  # keyframes 0, 6: 6 and 7 always kept
    sizes = {v: _dir_bytes(tmp_path, tmp_path / f"v{v:012d}") for v in list_versions(tmp_path)}
    budget = sizes[7] + sizes[6] + sizes[5] + sizes[4]  # exactly the newest four
    report = collect(tmp_path, RetentionPolicy(keep_versions=None, keep_bytes=budget, ack_ttl=None))
    assert list_versions(tmp_path) == [4, 5, 6, 7]
    assert report.reasons[4].startswith("within") and 3 in report.deleted


def test_the_watch_filter_ignores_acks_leases_and_temp_files(tmp_path: Path) -> None:
    """Mutation: the watch filter letting acks and temp files wake the receiver."""
    keep = _version_events(tmp_path)
    v = tmp_path / "v000000000003"
    assert keep(None, str(v / "manifest.json"))
    assert keep(None, str(v))
    assert not keep(None, str(tmp_path / "acks" / "e1.json"))
    assert not keep(None, str(tmp_path / "acks"))
    assert not keep(None, str(tmp_path / "leases" / "e1.json"))
    assert not keep(None, str(v / ".tmp.manifest.json.abc123"))
    assert not keep(None, str(tmp_path / "acks" / ".tmp.e1.json.abc"))
    assert keep(None, str(tmp_path / "acksfoo" / "x"))  # only the acks dir itself is ignored


async def test_a_zero_diff_of_the_held_version_is_taken(tmp_path: Path) -> None:
    """The counterpart of the refusals: a real zero diff (same tensors, same checksums) bumps."""
    await _chain(tmp_path, 1)
    m1 = read_manifest(tmp_path, 1)
    ck = await init_checkpoint(tmp_path / "ck", mixed_state(0))
    m0 = build_manifest(mixed_state(0), 0)
    zero = dataclasses.replace(m0, version=1, base_version=0, kind="delta", shards=())
    zero = dataclasses.replace(
        zero, tensors=tuple(dataclasses.replace(e, full=None) for e in zero.tensors)
    )
    await ck.bump(zero)
    assert ck.state.version == 1 and m1.version == 1
    await ck.close()
