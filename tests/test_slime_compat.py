"""Compatibility with slime at 90c212b5c (gen1) and 624b824a8 (gen2): the same inputs and
outcomes as slime's own argument-validation tests and its actor's updater choice, slime's
parser defaults against the environment, gen2's options mapped or refused.

slime's rules are rewritten in tests/slime_stubs/rules.py (slime is not a dependency)."""

from __future__ import annotations

import argparse
import sys
import types
import warnings
from pathlib import Path
from typing import Any

import pytest

from asyncsync import ConfigError
from asyncsync.training import slime
from asyncsync.training.slime import (
    SLIME_OPTIONS,
    choose,
    create_weight_updater,
    install,
    record_given,
    slime_choice,
    slime_generation,
    sync_config_from_args,
    validate_args,
)
from tests.slime_stubs import rules


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in list(os.environ):
        if key.startswith("ASYNCSYNC_"):
            monkeypatch.delenv(key)


def ns(gen: str, **values: Any) -> argparse.Namespace:
    return argparse.Namespace(**vars(rules.namespace(gen, **values)))


@pytest.mark.parametrize("gen", ["gen1", "gen2"])
def test_option_definitions_match_slime(gen: str) -> None:
    ours = {o.flag: o.default for o in SLIME_OPTIONS if gen in o.generations}
    assert ours == {flag: d[0] for flag, d in rules.DEFINITIONS[gen].items()}
    parser = rules.parser(gen)
    slime.add_arguments(parser, generation=gen)  # type: ignore[arg-type]
    args = parser.parse_args([])
    assert slime_generation(args) == gen
    assert args.update_weight_mode == "full" and args.update_weight_transport == "nccl"


# slime's tests/test_megatron_argument_validation.py, the weight-update cases:
# (revision, args, expected ValueError pattern or None, warning pattern or None, attrs after)
CASES = [
    ("gen1", {"update_weight_transport": "disk"}, "update-weight-disk-dir", None, {}),
    (
        "gen1",
        {"update_weight_transport": "disk", "update_weight_delta_dir": "/shared/delta"},
        None,
        "will be removed in a future release",
        {"update_weight_disk_dir": "/shared/delta", "update_weight_delta_dir": "/shared/delta"},
    ),
    (
        "gen1",
        {"update_weight_transport": "disk", "update_weight_disk_dir": "/shared/updates"},
        None,
        None,
        {"update_weight_disk_dir": "/shared/updates", "update_weight_delta_dir": "/shared/updates"},
    ),
    (
        "gen1",
        {
            "update_weight_transport": "disk",
            "update_weight_disk_dir": "/shared/full",
            "update_weight_delta_dir": "/shared/delta",
        },
        "deprecated alias",
        None,
        {},
    ),
    (
        "gen1",
        {"update_weight_mode": "delta", "colocate": True},
        "not supported with --colocate",
        None,
        {},
    ),
    (
        "gen1",
        {"update_weight_mode": "delta", "update_weight_transport": "tensor"},
        "supports only --update-weight-transport=nccl or disk",
        None,
        {},
    ),
    ("gen2", {"update_weight_transport": "disk"}, "update-weight-disk-dir", None, {}),
    (
        "gen2",
        {"update_weight_mode": "delta", "update_weight_local_checkpoint_dir": "/local/ckpt"},
        "requires --update-weight-transport=disk",
        None,
        {},
    ),
    (
        "gen2",
        {
            "update_weight_mode": "delta",
            "update_weight_transport": "disk",
            "update_weight_disk_dir": "/shared/delta",
            "update_weight_local_checkpoint_dir": "/local/ckpt",
            "colocate": True,
        },
        "not supported with --colocate",
        None,
        {},
    ),
    (
        "gen2",
        {
            "update_weight_mode": "delta",
            "update_weight_transport": "disk",
            "update_weight_disk_dir": "/d",
        },
        "requires --update-weight-local-checkpoint-dir",
        None,
        {},
    ),
]


@pytest.mark.parametrize(("gen", "values", "error", "warning", "after"), CASES)
def test_argument_validation_as_slime(
    gen: str, values: dict[str, Any], error: str | None, warning: str | None, after: dict[str, Any]
) -> None:
    for validate in (lambda a: rules.validate(gen, a), validate_args):
        args = ns(gen, **values)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if error:
                with pytest.raises(ValueError, match=error):
                    validate(args)
            else:
                validate(args)
        got = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
        assert bool(got) == bool(warning) and all(warning in m for m in got if warning)
        for k, v in after.items():
            assert getattr(args, k) == v


COMBOS = [
    (mode, transport, colocate)
    for mode in ("full", "delta")
    for transport in ("nccl", "disk")
    for colocate in (False, True)
]


@pytest.mark.parametrize("gen", ["gen1", "gen2"])
@pytest.mark.parametrize(("mode", "transport", "colocate"), COMBOS)
def test_factory_choice_as_slime_and_only_disk_is_ours(
    gen: str, mode: str, transport: str, colocate: bool
) -> None:
    args = ns(gen, update_weight_mode=mode, update_weight_transport=transport, colocate=colocate)
    try:
        want = rules.actor_choice(gen, args)
    except AssertionError as exc:
        with pytest.raises(AssertionError, match=str(exc) or None):
            slime_choice(args)
        return
    assert slime_choice(args) == want
    ours = choose(args)
    disk = transport == "disk" and want in (
        "UpdateWeightFromDisk",
        "UpdateWeightFromDiskDelta",
        "UpdateWeightFromDistributedDelta",
    )
    assert ours == ("asyncsync" if disk else want)


@pytest.fixture
def fake_slime(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """slime's updater modules, each with a stub class recording its construction."""
    mods: dict[str, Any] = {}
    for name, module in slime.factory.SLIME_CLASSES.items():
        mod = types.ModuleType(module)

        class Stub:
            weight_version = 0

            def __init__(self, args: Any, model: Any, **kw: Any) -> None:
                self.args, self.kw = args, kw

        Stub.__name__ = name
        setattr(mod, name, Stub)
        monkeypatch.setitem(sys.modules, module, mod)
        mods[module] = mod
    actor = types.ModuleType("slime.backends.megatron_utils.actor")
    actor.UpdateWeightFromDisk = mods[
        slime.factory.SLIME_CLASSES["UpdateWeightFromDisk"]
    ].UpdateWeightFromDisk  # type: ignore[attr-defined]
    mods[actor.__name__] = actor
    return mods


@pytest.mark.parametrize(
    ("gen", "values", "cls"),
    [
        ("gen1", {}, "UpdateWeightFromDistributed"),
        ("gen2", {}, "UpdateWeightFromDistributed"),
        ("gen1", {"colocate": True}, "UpdateWeightFromTensor"),
        ("gen1", {"update_weight_mode": "delta"}, "UpdateWeightFromDistributedDelta"),
        ("gen2", {"colocate": True}, "UpdateWeightFromTensor"),
    ],
)
def test_create_weight_updater_leaves_nccl_and_colocate_to_slime(
    fake_slime: dict[str, Any], gen: str, values: dict[str, Any], cls: str
) -> None:
    args = ns(gen, **values)
    args.update_weight_start_version = 3
    u = create_weight_updater(args, None, dict, model_name="m", quantization_config=None)
    assert type(u).__name__ == cls and u.kw["model_name"] == "m" and u.weight_version == 3


def test_install_dispatches_disk_to_asyncsync(fake_slime: dict[str, Any], tmp_path: Path) -> None:
    replaced = install(fake_slime)
    assert "slime.backends.megatron_utils.actor.UpdateWeightFromDisk" in replaced
    dispatch = fake_slime["slime.backends.megatron_utils.actor"].UpdateWeightFromDisk
    with pytest.raises(ConfigError, match="no slime updater class"):
        install(fake_slime)  # already installed: nothing left to replace
    kw = {"weights_getter": dict, "model_name": "m", "quantization_config": None}
    nccl = dispatch(ns("gen2"), None, **kw)
    assert type(nccl).__name__ == "UpdateWeightFromDisk"  # slime's own for nccl (its default)
    disk = ns(
        "gen2",
        update_weight_transport="disk",
        update_weight_disk_dir=str(tmp_path),
        asyncsync_receivers="none",
    )
    with dispatch(disk, None, **kw) as ours:
        assert isinstance(ours, slime.AsyncSyncWeightUpdater)


# ------------------------------------------------------------------ defaults, environment, gen2


def disk_args(gen: str, tmp_path: Path, **values: Any) -> argparse.Namespace:
    return ns(gen, update_weight_transport="disk", update_weight_disk_dir=str(tmp_path), **values)


def test_slime_defaults_do_not_override_the_environment(tmp_path: Path) -> None:
    env = {"ASYNCSYNC_BUCKET_BYTES": "8MiB", "ASYNCSYNC_ENCODING": "deltas"}
    cfg = sync_config_from_args(disk_args("gen1", tmp_path), environ=env)
    assert (cfg.bucket_bytes, cfg.encoding) == (8 << 20, "deltas")  # slime's defaults: not given
    given = disk_args(
        "gen1", tmp_path, update_weight_buffer_size=1 << 20, update_weight_encoding="indices"
    )
    record_given(
        given, ["--update-weight-buffer-size", "1048576", "--update-weight-encoding=indices"]
    )
    cfg = sync_config_from_args(given, environ=env)
    assert (cfg.bucket_bytes, cfg.encoding) == (
        1 << 20,
        "indices",
    )  # given, even at slime's default
    with pytest.raises(ConfigError, match="ASYNCSYNC_MODE=delta disagrees"):
        sync_config_from_args(disk_args("gen1", tmp_path), environ={"ASYNCSYNC_MODE": "delta"})
    assert sync_config_from_args(disk_args("gen1", tmp_path), environ={}).mode == "full"


def test_gen2_options_are_mapped_or_refused(tmp_path: Path) -> None:
    base = {"update_weight_mode": "delta", "update_weight_local_checkpoint_dir": "/l"}
    cfg = sync_config_from_args(disk_args("gen2", tmp_path, **base), environ={})
    assert cfg.encoding == "xef" and cfg.checksum == "xxh3-128"  # xor at slime's default
    over = disk_args("gen2", tmp_path, update_weight_delta_encoding="overwrite", **base)
    assert sync_config_from_args(over, environ={}).mode == "delta"
    xor = disk_args("gen2", tmp_path, **base)
    record_given(xor, ["--update-weight-delta-encoding", "xor"])
    with pytest.raises(ConfigError, match="no xor encoding"):
        sync_config_from_args(xor, environ={})
    blake = disk_args("gen2", tmp_path, update_weight_delta_checksum="blake3", **base)
    with pytest.raises(ConfigError, match="--update-weight-delta-checksum blake3"):
        sync_config_from_args(blake, environ={})


def test_keep_files_and_retention(tmp_path: Path) -> None:
    cfg = sync_config_from_args(disk_args("gen1", tmp_path), environ={})
    assert cfg.keep_versions == slime.DEFAULT_KEEP_VERSIONS == 1  # slime deletes after apply
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # --update-weight-delta-keep-files is not deprecated
        keep = sync_config_from_args(
            disk_args("gen1", tmp_path, update_weight_delta_keep_files=True), environ={}
        )
    assert (keep.keep_versions, keep.keep_bytes) == (None, None)
    both = disk_args(
        "gen2", tmp_path, update_weight_disk_keep_files=True, update_weight_keep_versions=2
    )
    with pytest.raises(ConfigError, match="keeps every version"):
        sync_config_from_args(both, environ={})


def test_transport_other_than_disk_is_slimes(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="asyncsync replaces slime's disk updaters only"):
        sync_config_from_args(ns("gen2"), environ={})


def test_receiver_switch(tmp_path: Path) -> None:
    s = slime.slime_settings(disk_args("gen2", tmp_path), environ={})
    assert s.receivers == "none" and s.hf_view  # gen2 full: slime's RayTrainGroup reloads
    delta = disk_args("gen2", tmp_path, update_weight_mode="delta")
    with pytest.raises(ConfigError, match="--update-weight-local-checkpoint-dir"):
        slime.slime_settings(delta, environ={})
    s = slime.slime_settings(
        delta,
        environ={"ASYNCSYNC_SLIME_RECEIVERS": "sidecar", "ASYNCSYNC_SLIME_ENGINE_IDS": "a, b"},
    )
    assert (s.receivers, s.engine_ids) == ("sidecar", ("a", "b"))
    with pytest.raises(ConfigError, match="must be one of"):
        slime.slime_settings(delta, environ={"ASYNCSYNC_SLIME_RECEIVERS": "k8s"})
