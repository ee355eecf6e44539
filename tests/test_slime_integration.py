"""The slime integration: arguments, refusals, and the updater against real receivers."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from asyncsync import AckTimeout, ConfigError, Publisher, PublishError
from asyncsync.format.store import list_versions, read_manifest
from asyncsync.training import slime
from asyncsync.training.slime import (
    AsyncSyncWeightUpdater,
    create_weight_updater,
    sync_config_from_args,
)
from asyncsync.training.staleness import AckPolicy
from receiver import ReceiverAgent
from receiver.engines import TorchModule
from tests.conftest import same_bytes


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in list(os.environ):
        if key.startswith("ASYNCSYNC_"):
            monkeypatch.delenv(key)


def parse(*argv: str, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    parser = parser or argparse.ArgumentParser()
    slime.add_arguments(parser)
    return parser.parse_args(list(argv))


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).to(torch.bfloat16)


class FakeProvider:
    """The trainer's side of slime's ``weights_getter``: bf16 weights that change a little."""

    def __init__(self) -> None:
        self.model = make_model(0)
        self.gen = torch.Generator().manual_seed(1)
        self.calls = 0

    def step(self, density: float = 0.03) -> None:
        with torch.no_grad():
            for p in self.model.parameters():
                flat = p.view(-1).view(torch.int16)
                mask = torch.rand(flat.numel(), generator=self.gen) < density
                flat[mask] += 1  # an ulp, like an Adam step after the bf16 cast

    def state_dict(self) -> dict[str, torch.Tensor]:
        self.calls += 1
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def pairs(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.calls += 1
        for k, v in self.model.state_dict().items():
            yield k, v.detach().clone()


# ---------------------------------------------------------------------- arguments
def test_add_arguments_skips_options_a_slime_parser_has() -> None:
    slime_parser = argparse.ArgumentParser()
    slime_parser.add_argument("--update-weight-mode", default="full", choices=["full", "delta"])
    slime_parser.add_argument("--update-weight-transport", default="nccl")
    slime_parser.add_argument("--colocate", action="store_true")
    args = parse("--update-weight-disk-dir", "/w", parser=slime_parser)
    assert (args.update_weight_mode, args.update_weight_transport) == ("full", "nccl")
    assert args.update_weight_max_staleness is None and args.colocate is False
    with pytest.raises(ConfigError, match="'nccl' is not available with asyncsync"):
        sync_config_from_args(args, environ={})
    fresh = parse()
    assert fresh.update_weight_mode is None and fresh.update_weight_disk_keep_files is None


def test_arguments_map_to_the_config(tmp_path: Path) -> None:
    args = parse(
        *("--update-weight-mode", "delta", "--update-weight-transport", "disk"),
        *("--update-weight-disk-dir", str(tmp_path), "--update-weight-encoding", "deltas"),
        *("--update-weight-buffer-size", "1MiB", "--update-weight-start-version", "7"),
        *("--update-weight-checksum", "xxh3-64", "--update-weight-keyframe-interval", "5"),
        *("--update-weight-zstd-level", "1", "--update-weight-max-in-flight", "3"),
        *("--update-weight-ack-engines", "e0,e1", "--update-weight-ack-timeout", "none"),
        *("--update-weight-max-staleness", "1", "--update-weight-keep-bytes", "2G"),
    )
    cfg = sync_config_from_args(args, environ={})
    assert (cfg.root, cfg.mode, cfg.encoding, cfg.bucket_bytes) == (
        tmp_path,
        "delta",
        "deltas",
        1 << 20,
    )
    assert (cfg.start_version, cfg.checksum, cfg.keyframe_interval, cfg.zstd_level) == (
        7,
        "xxh3-64",
        5,
        1,
    )
    assert cfg.max_in_flight == 3 and cfg.ack_engines == ("e0", "e1") and cfg.ack_timeout is None
    assert (cfg.max_staleness, cfg.keep_bytes, cfg.keep_versions) == (1, 2 << 30, None)
    # what the command line does not give comes from the environment, then the defaults
    args = parse("--update-weight-disk-dir", str(tmp_path))
    cfg = sync_config_from_args(
        args, environ={"ASYNCSYNC_MODE": "full", "ASYNCSYNC_ZSTD_LEVEL": "9"}
    )
    assert (cfg.mode, cfg.zstd_level, cfg.encoding) == ("full", 9, "xef")
    args = parse("--update-weight-disk-dir", str(tmp_path), "--update-weight-mode", "delta")
    assert sync_config_from_args(args, environ={"ASYNCSYNC_MODE": "full"}).mode == "delta"


def test_deprecated_dir_alias(tmp_path: Path) -> None:
    args = parse("--update-weight-delta-dir", str(tmp_path))
    with pytest.warns(FutureWarning, match="--update-weight-delta-dir is deprecated"):
        cfg = sync_config_from_args(args, environ={})
    assert cfg.root == tmp_path
    assert args.update_weight_disk_dir == args.update_weight_delta_dir == str(tmp_path)
    sync_config_from_args(args, environ={})  # resolved once: no second warning
    same = parse(
        "--update-weight-disk-dir", f"{tmp_path}/", "--update-weight-delta-dir", str(tmp_path)
    )
    with pytest.warns(FutureWarning):
        assert sync_config_from_args(same, environ={}).root == tmp_path
    both = parse("--update-weight-disk-dir", "/a", "--update-weight-delta-dir", "/b")
    with pytest.warns(FutureWarning), pytest.raises(ConfigError, match="disagree"):
        sync_config_from_args(both, environ={})


def test_keep_files_and_retention(tmp_path: Path) -> None:
    d = ("--update-weight-disk-dir", str(tmp_path))
    assert sync_config_from_args(parse(*d), environ={}).keep_versions == slime.DEFAULT_KEEP_VERSIONS
    env = {"ASYNCSYNC_KEEP_VERSIONS": "9"}
    assert sync_config_from_args(parse(*d), environ=env).keep_versions == 9
    cfg = sync_config_from_args(parse(*d, "--update-weight-disk-keep-files"), environ=env)
    assert (cfg.keep_versions, cfg.keep_bytes) == (None, None)
    legacy = parse(*d, "--update-weight-delta-keep-files")
    with pytest.warns(FutureWarning, match="delta-keep-files is deprecated"):
        assert sync_config_from_args(legacy, environ={}).keep_versions is None
    assert legacy.update_weight_disk_keep_files is True
    both = parse(*d, "--update-weight-disk-keep-files", "--update-weight-keep-versions", "2")
    with pytest.raises(ConfigError, match=r"keeps every version.*--update-weight-keep-versions"):
        sync_config_from_args(both, environ={})


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--update-weight-transport", "nccl"], "pass --update-weight-transport disk"),
        (["--update-weight-mode", "delta", "--colocate"], "not supported with --colocate"),
        (["--update-weight-encoding", "xor"], "--update-weight-encoding: must be one of"),
        (["--custom-delta-pre-push-path", "not-a-path"], "--custom-delta-pre-push-path"),
        (["--update-weight-ack-quorum", "0"], "--update-weight-ack-quorum: must be >= 1"),
    ],
)
def test_refused(tmp_path: Path, argv: list[str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        sync_config_from_args(parse("--update-weight-disk-dir", str(tmp_path), *argv), environ={})


def test_needs_a_directory_and_full_colocate_is_fine(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--update-weight-disk-dir"):
        sync_config_from_args(parse("--update-weight-mode", "full"), environ={})
    args = parse("--update-weight-disk-dir", str(tmp_path), "--update-weight-mode", "full")
    args.colocate = True
    assert sync_config_from_args(args, environ={}).colocate


# ---------------------------------------------------------------------- the updater
@pytest.fixture
async def engines(tmp_path: Path) -> AsyncIterator[dict[str, nn.Module]]:
    """Two receiver agents with TorchModule engines, running on the test's loop."""
    models = {f"e{i}": make_model(10 + i) for i in range(2)}
    stop = asyncio.Event()
    agents = [
        ReceiverAgent(tmp_path / "root", TorchModule(m), e, poll_interval=0.02, use_inotify=False)
        for e, m in models.items()
    ]
    tasks = [asyncio.create_task(a.run(stop=stop)) for a in agents]
    try:
        yield models
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        for a in agents:
            await a.close()


def slime_args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    return parse(
        *("--update-weight-mode", "delta", "--update-weight-transport", "disk"),
        *("--update-weight-disk-dir", str(tmp_path / "root"), "--update-weight-ack-timeout", "30"),
        *extra,
    )


async def test_updater_end_to_end(tmp_path: Path, engines: dict[str, nn.Module]) -> None:
    provider = FakeProvider()
    args = slime_args(tmp_path, "--update-weight-start-version", "7")
    model = [object()]
    updater = create_weight_updater(
        args, model, provider.pairs, model_name="tiny", quantization_config={"q": 1}
    )
    assert isinstance(updater, AsyncSyncWeightUpdater)
    assert updater.args is args and updater.model is model and updater.weights_getter is not None
    assert (updater.model_name, updater.quantization_config) == ("tiny", {"q": 1})
    assert updater.weight_version == 7
    with updater:
        updater.connect_rollout_engines(list(engines), object())
        await asyncio.to_thread(updater.update_weights)  # the seed; engines acked it
        assert updater.weight_version == 7
        seed = updater.pop_metrics()
        assert seed["perf/update_weights_version"] == 0 and seed["perf/update_weights_density"] == 1
        for expected in (8, 9):
            provider.step()
            await asyncio.to_thread(updater.update_weights)
            assert updater.weight_version == expected
            m = updater.pop_metrics()
            assert updater.pop_metrics() == {}
            assert 0.01 < m["perf/update_weights_density"] < 0.06
            assert m["perf/update_weights_staleness"] == 0  # max_staleness 0: engines are current
            assert m["perf/update_weights_compression_ratio"] > 1
            for name in (
                "wire_bytes",
                "disk_bytes_pre_compress",
                "disk_bytes_post_compress",
                "encode_ms",
                "finalize_ms",
                "total_ms",
                "ack_wait_ms",
                "flushes_per_rank",
            ):
                assert f"perf/update_weights_{name}" in m
            for e, engine_model in engines.items():
                got = engine_model.state_dict()
                assert all(same_bytes(got[k], t) for k, t in provider.model.state_dict().items()), e
    assert provider.calls == 3
    manifest = read_manifest(tmp_path / "root", 2)
    assert manifest.kind == "delta" and manifest.producer["model_name"] == "tiny"
    assert manifest.producer["start_version"] == 7
    async with Publisher(tmp_path / "root"):  # close() released the root's lock
        pass
    with pytest.raises(PublishError, match="closed"):
        updater.update_weights()


async def test_staleness_one_waits_for_the_previous_version(
    tmp_path: Path, engines: dict[str, nn.Module]
) -> None:
    provider = FakeProvider()
    args = slime_args(tmp_path, "--update-weight-max-staleness", "1")
    with create_weight_updater(
        args, None, provider.state_dict, model_name="m", quantization_config=None
    ) as updater:
        updater.connect_rollout_engines([object(), object()], None)  # Ray handles: no ids
        session = updater.session
        assert session is not None and session.ack_policy.quorum == 2
        for _ in range(3):
            await asyncio.to_thread(updater.update_weights)
            provider.step()
            step = session.last_step
            assert step is not None
            if step.result.version:
                assert step.ack.target == step.result.version - 1
                assert step.ack.staleness is not None and step.ack.staleness <= 1
        assert (await asyncio.to_thread(session.wait_acked)).target == 2


def test_connect_engines_policy(tmp_path: Path) -> None:
    class Handle:
        def __init__(self, engine_id: str) -> None:
            self.engine_id = engine_id

    with AsyncSyncWeightUpdater(
        slime_args(tmp_path), None, dict, model_name="m", quantization_config=None
    ) as updater:
        session = updater.session
        assert session is not None and not session.ack_policy.waits
        updater.connect_rollout_engines([Handle("a"), "b"], None, [1, 1], [0, 1])
        assert session.ack_policy.engines == ("a", "b")
        updater.connect_rollout_engines([object()], None, engine_ids=["x"])
        assert session.ack_policy.engines == ("x",)
        updater.disconnect_rollout_engines()
        assert not session.ack_policy.waits
    args = slime_args(tmp_path, "--update-weight-ack-quorum", "3")
    with AsyncSyncWeightUpdater(args, None, dict, model_name="m", quantization_config=None) as u:
        u.connect_rollout_engines(["a"], None)
        assert u.session is not None and u.session.ack_policy.quorum == 3  # the config decides


def test_ack_timeout_still_advances_the_version(tmp_path: Path) -> None:
    provider = FakeProvider()
    args = slime_args(tmp_path, "--update-weight-ack-engines", "ghost")
    args.update_weight_ack_timeout = "0.2"
    with create_weight_updater(
        args, None, provider.state_dict, model_name="m", quantization_config=None
    ) as updater:
        with pytest.raises(AckTimeout, match="ghost at no ack"):
            updater.update_weights()
        assert updater.weight_version == 0 and updater.session is not None
        assert updater.session.version == 0
        with pytest.raises(AckTimeout):
            updater.update_weights()  # a zero-diff version: committed all the same
        assert updater.weight_version == 1
    assert read_manifest(tmp_path / "root", 1).totals.changed == 0


def test_pre_push_hook_runs_before_the_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "slime_push_hooks.py").write_text(
        "import os\nCALLS = []\n"
        "def push(args, version_dir, rollout_engines):\n"
        "    CALLS.append((args, version_dir, list(rollout_engines),\n"
        "                  os.path.exists(os.path.join(version_dir, 'manifest.json'))))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "slime_push_hooks", raising=False)
    provider = FakeProvider()
    args = slime_args(tmp_path, "--custom-delta-pre-push-path", "slime_push_hooks.push")
    with create_weight_updater(
        args, None, provider.state_dict, model_name="m", quantization_config=None
    ) as updater:
        updater.connect_rollout_engines(["e0"], None)
        assert updater.session is not None
        updater.session.ack_policy = AckPolicy()  # nobody to wait for in this test
        updater.update_weights()
        provider.step()
        updater.update_weights()
    calls = sys.modules["slime_push_hooks"].CALLS
    assert [(a is args, Path(d).name, e, committed) for a, d, e, committed in calls] == [
        (True, "v000000000000", ["e0"], False),
        (True, "v000000000001", ["e0"], False),
    ]
    env = {"ASYNCSYNC_PRE_COMMIT_HOOK": "os.path:join"}
    with pytest.raises(ConfigError, match="both set; keep one"):
        AsyncSyncWeightUpdater(
            args,
            None,
            dict,
            model_name="m",
            quantization_config=None,
            config=sync_config_from_args(args, environ=env),
        )


def test_other_ranks_only_count(tmp_path: Path) -> None:
    provider = FakeProvider()
    updater = AsyncSyncWeightUpdater(
        slime_args(tmp_path), None, provider.pairs, model_name="m", quantization_config=None, rank=1
    )
    updater.weight_version = 3
    assert updater.session is None
    for expected in (3, 4, 5):
        updater.update_weights()
        assert updater.weight_version == expected and updater.pop_metrics() == {}
    assert provider.calls == 3  # the getter (and any gather in it) ran on this rank too
    assert not (tmp_path / "root").exists()
    updater.close()


def test_full_mode_publishes_a_checkpoint_per_version(tmp_path: Path) -> None:
    provider = FakeProvider()
    args = slime_args(tmp_path, "--update-weight-mode", "full", "--update-weight-disk-keep-files")
    with create_weight_updater(
        args, None, provider.state_dict, model_name="m", quantization_config=None
    ) as updater:
        for _ in range(3):
            updater.update_weights()
            provider.step()
        metrics = updater.pop_metrics()
    root = tmp_path / "root"
    assert list_versions(root) == [0, 1, 2] and updater.weight_version == 2
    for v in range(3):
        m = read_manifest(root, v)
        assert (
            m.kind == "full" and m.base_version is None and {s.role for s in m.shards} == {"full"}
        )
    assert metrics["perf/update_weights_density"] == 1.0
    assert json.loads((root / "v000000000002" / "manifest.json").read_text())["kind"] == "full"


def test_weights_getter_shapes(tmp_path: Path) -> None:
    def bad() -> Any:
        return [("a", torch.zeros(1)), ("a", torch.ones(1))]

    with AsyncSyncWeightUpdater(
        slime_args(tmp_path), None, bad, model_name="m", quantization_config=None
    ) as updater:
        with pytest.raises(ConfigError, match="'a' twice"):
            updater.update_weights()
        updater.weights_getter = lambda: [torch.zeros(1)]
        with pytest.raises(ConfigError, match="pairs"):
            updater.update_weights()
