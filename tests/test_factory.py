"""create_publisher: every mode/transport/colocate combination, hooks, retention, real runs."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import logging
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from asyncsync import ConfigError, Publisher
from asyncsync.format.store import read_manifest
from asyncsync.training.config import SyncConfig
from asyncsync.training.factory import create_publisher
from receiver import ReceiverAgent
from receiver.engines import LocalCheckpoint
from tests.conftest import mixed_state, mutate, same_bytes


class _FakePublisher:
    """Stands in for asyncsync.publish.publisher.Publisher (imported lazily by the factory)."""

    def __init__(self, root: Path, **kwargs: Any) -> None:
        self.root = root
        self.kwargs = kwargs


class _FakeRetentionPublisher(_FakePublisher):
    def __init__(self, root: Path, *, retention: Any = None, **kwargs: Any) -> None:
        super().__init__(root, retention=retention, **kwargs)


@pytest.fixture
def fake_publisher(monkeypatch: pytest.MonkeyPatch) -> type[_FakePublisher]:
    module = types.ModuleType("asyncsync.publish.publisher")
    module.Publisher = _FakePublisher  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "asyncsync.publish.publisher", module)
    return _FakePublisher


@pytest.fixture
def no_retention(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "asyncsync.publish.retention", None)  # import raises


COMBINATIONS = list(itertools.product(("delta", "full"), ("disk", "nccl", "rdma"), (False, True)))


@pytest.mark.parametrize(("mode", "transport", "colocate"), COMBINATIONS)
def test_every_combination(
    tmp_path: Path, fake_publisher: type[_FakePublisher], mode: str, transport: str, colocate: bool
) -> None:
    values = {"root": tmp_path, "mode": mode, "transport": transport, "colocate": colocate}
    if transport != "disk":
        with pytest.raises(ConfigError, match="no NCCL/RDMA transport"):
            create_publisher(values)
        return
    if mode == "delta" and colocate:
        with pytest.raises(ConfigError, match="refused with colocated engines"):
            create_publisher(values)
        return
    pub = create_publisher(values, producer={"job": "t"})
    assert isinstance(pub, fake_publisher)
    assert pub.root == tmp_path
    assert pub.kwargs == {
        "mode": mode,
        "encoding": "xef",
        "checksum": "xxh3-128",
        "bucket_bytes": 32 << 20,
        "max_in_flight": 2,
        "keyframe_interval": 20,
        "zstd_level": 1,
        "pre_commit_hook": None,
        "producer": {"mode": mode, "start_version": 0, "job": "t"},
    }


def test_defaults_match_the_publisher() -> None:
    params = inspect.signature(Publisher).parameters
    defaults = {f.name: f.default for f in dataclasses.fields(SyncConfig)}
    shared = (set(params) & set(defaults)) - {"root"}
    assert shared >= {"mode", "encoding", "checksum", "bucket_bytes", "zstd_level", "max_in_flight"}
    for name in shared:
        assert defaults[name] == params[name].default, name


def test_passes_every_publisher_setting(
    tmp_path: Path, fake_publisher: type[_FakePublisher]
) -> None:
    cfg = SyncConfig(
        root=tmp_path,
        encoding="deltas_zstd",
        checksum="xxh3-64",
        bucket_bytes="1MiB",
        max_in_flight=4,
        keyframe_interval=0,
        zstd_level=7,
        start_version=12,
    )
    kw = create_publisher(cfg).kwargs
    assert (kw["encoding"], kw["checksum"], kw["bucket_bytes"]) == (
        "deltas_zstd",
        "xxh3-64",
        1 << 20,
    )
    assert (kw["max_in_flight"], kw["keyframe_interval"], kw["zstd_level"]) == (4, 0, 7)
    assert kw["producer"]["start_version"] == 12


def test_refuses_bad_input(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="SyncConfig or a mapping"):
        create_publisher("/shared/weights")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="did you mean 'bucket_bytes'"):
        create_publisher({"root": tmp_path, "bucket_byte": 3})
    with pytest.raises(ConfigError, match="no root directory"):
        create_publisher({"mode": "full"})
    with pytest.raises(ConfigError, match="cannot import module"):
        create_publisher(SyncConfig(root=tmp_path, pre_commit_hook="no_such_mod_y:hook"))


def test_hook_import_path_is_resolved_lazily(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_publisher: type[_FakePublisher]
) -> None:
    (tmp_path / "lazy_hook_mod.py").write_text("def hook(path):\n    return path\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "lazy_hook_mod", raising=False)
    cfg = SyncConfig(root=tmp_path, pre_commit_hook="lazy_hook_mod:hook")
    assert "lazy_hook_mod" not in sys.modules  # parsing the config imports nothing
    pub = create_publisher(cfg)
    assert pub.kwargs["pre_commit_hook"] is sys.modules["lazy_hook_mod"].hook
    assert pub.kwargs["producer"]["pre_commit_hook"] == "lazy_hook_mod:hook"

    def mine(path: Path) -> None:
        return None

    assert (
        create_publisher(SyncConfig(root=tmp_path, pre_commit_hook=mine)).kwargs["pre_commit_hook"]
        is mine
    )


# ---------------------------------------------------------------------- retention
def test_retention_not_available_keeps_everything(
    tmp_path: Path,
    fake_publisher: type[_FakePublisher],
    no_retention: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="asyncsync.training.factory"):
        pub = create_publisher(SyncConfig(root=tmp_path, keep_versions=3))
    assert "retention" not in pub.kwargs
    assert "every version is kept" in caplog.text
    caplog.clear()
    create_publisher(SyncConfig(root=tmp_path))  # nothing asked, nothing said
    assert not caplog.text


def _fake_retention_module(monkeypatch: pytest.MonkeyPatch) -> type:
    class RetentionPolicy:
        def __init__(self, keep_versions: int | None = None, keep_bytes: int | None = None):
            self.keep_versions, self.keep_bytes = keep_versions, keep_bytes

    module = types.ModuleType("asyncsync.publish.retention")
    module.RetentionPolicy = RetentionPolicy  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "asyncsync.publish.retention", module)
    return RetentionPolicy


def test_retention_passed_when_supported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    policy_cls = _fake_retention_module(monkeypatch)
    module = types.ModuleType("asyncsync.publish.publisher")
    module.Publisher = _FakeRetentionPublisher  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "asyncsync.publish.publisher", module)
    pub = create_publisher(SyncConfig(root=tmp_path, keep_versions=3, keep_bytes="1GiB"))
    policy = pub.kwargs["retention"]
    assert isinstance(policy, policy_cls)
    assert (policy.keep_versions, policy.keep_bytes) == (3, 1 << 30)
    assert create_publisher(SyncConfig(root=tmp_path)).kwargs["retention"] is None  # not asked


def test_retention_module_without_publisher_support(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fake_publisher: type[_FakePublisher],
    caplog: pytest.LogCaptureFixture,
) -> None:
    _fake_retention_module(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="asyncsync.training.factory"):
        pub = create_publisher(SyncConfig(root=tmp_path, keep_bytes=10))
    assert "retention" not in pub.kwargs and "every version is kept" in caplog.text


# ---------------------------------------------------------------------- the real publisher
@pytest.mark.parametrize("mode", ["delta", "full"])
async def test_real_publisher_round_trip(tmp_path: Path, mode: str) -> None:
    """Both modes end to end: manifest kinds, commit, a receiver's bytes and its ack."""
    calls: list[Path] = []
    cfg = SyncConfig(
        root=tmp_path / "root",
        mode=mode,
        bucket_bytes="4KiB",
        keyframe_interval=0,
        pre_commit_hook=calls.append,
        keep_versions=None,
    )
    pub = create_publisher(cfg, producer={"job": "factory-test"})
    assert isinstance(pub, Publisher) and pub.mode == mode
    sd0 = mixed_state(0)
    sd1 = mutate(sd0, 0.05, seed=1)
    async with pub:
        r0 = await pub.seed(sd0)
        r1 = await pub.publish(sd1)
    m1 = read_manifest(cfg.root, 1)
    assert (r0.kind, r1.kind) == ("full", "delta" if mode == "delta" else "full")
    assert m1.kind == ("delta" if mode == "delta" else "full")
    assert (m1.base_version is None) == (mode == "full")
    assert m1.producer["job"] == "factory-test" and m1.producer["mode"] == mode
    assert [p.name for p in calls] == ["v000000000000", "v000000000001"]
    ckpt = LocalCheckpoint(tmp_path / "engine")
    async with ReceiverAgent(cfg.root, ckpt, "e0", use_inotify=False) as agent:
        assert await agent.sync_once() == 1
        got = ckpt.load_state_dict()
    assert sorted(got) == sorted(sd1)
    assert all(same_bytes(got[k], t) for k, t in sd1.items())
    async with create_publisher(cfg) as again:  # the lock was released; acks are visible
        assert (await again.wait_acked(1, engines=["e0"], timeout=5))["e0"].version == 1
