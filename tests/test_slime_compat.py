"""Compatibility with slime at 90c212b5c (gen1), c74877886 (gen2a) and 624b824a8 (gen2): the
same inputs and outcomes as slime's own argument-validation tests and its actor's updater
choice, slime's parser defaults against the environment, gen2a's and gen2's options mapped or
refused; per revision, the actor's calls (construction, start version, connect), the hook's
contract, the converter's parameters and who reloads the engines (tests/test_slime_actor.py
runs them across processes and Ray).

slime's facts are written down in tests/slime_stubs/rules.py (slime is not a dependency)."""

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


GENS = rules.GENS


@pytest.mark.parametrize("gen", GENS)
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


CASES += [("gen2a", *case[1:]) for case in CASES if case[0] == "gen2"]
CASES += [
    (  # slime compares the two strings: a trailing "/" makes them differ
        "gen1",
        {
            "update_weight_transport": "disk",
            "update_weight_disk_dir": "/shared/d",
            "update_weight_delta_dir": "/shared/d/",
        },
        "deprecated alias",
        None,
        {},
    ),
    (
        "gen2",
        {"release_train": True},
        "--release-train requires --update-weight-mode=full and --update-weight-transport=disk",
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


@pytest.mark.parametrize("gen", GENS)
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

        class Stub:  # slime's signature (the same for every updater class, all revisions)
            weight_version = 0

            def __init__(
                self, args: Any, model: Any, weights_getter: Any, *, model_name: str,
                quantization_config: Any,
            ) -> None:  # fmt: skip
                self.args = args
                self.kw = {"weights_getter": weights_getter, "model_name": model_name}

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
        ("gen2a", {"colocate": True}, "UpdateWeightFromTensor"),
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


# ------------------------------------------------------------------ the parser (issue 25: 5)


@pytest.mark.parametrize("gen", GENS)
def test_add_arguments_keeps_the_generation_of_slimes_parser(gen: str) -> None:
    parser = rules.parser(gen)
    slime.add_arguments(parser)  # no generation= : the parser's own
    args = parser.parse_args(
        ["--update-weight-transport", "disk", "--update-weight-disk-dir", "/d", "--colocate"]
    )
    assert slime_generation(args) == gen
    assert set(vars(args)) >= {o.dest for o in SLIME_OPTIONS if gen in o.generations}
    foreign = {o.dest for o in SLIME_OPTIONS if gen not in o.generations}
    assert not (set(vars(args)) & foreign - {"update_weight_local_checkpoint_dir"})
    # slime's choice for disk + colocate: gen1 builds UpdateWeightFromTensor, later ones disk
    assert choose(args) == ("UpdateWeightFromTensor" if gen == "gen1" else "asyncsync")
    other = next(g for g in GENS if g != gen)
    with pytest.raises(ConfigError, match="already defines slime's"):
        slime.add_arguments(rules.parser(gen), generation=other)  # type: ignore[arg-type]
    bare = argparse.ArgumentParser()
    slime.add_arguments(bare)
    assert slime_generation(bare.parse_args([])) == "gen2"  # the newest


def test_receivers_none_in_delta_mode_is_refused(tmp_path: Path) -> None:
    for gen in GENS:
        extra = {} if gen == "gen1" else {"update_weight_local_checkpoint_dir": "/l"}
        args = disk_args(gen, tmp_path, update_weight_mode="delta", **extra)
        args.asyncsync_receivers = "none"
        with pytest.raises(ConfigError, match="nothing would ever update them"):
            slime.slime_settings(args, environ={})
    with pytest.raises(ConfigError, match="its full disk updater does"):
        slime.slime_settings(
            disk_args("gen1", tmp_path), environ={"ASYNCSYNC_SLIME_RECEIVERS": "none"}
        )
    with pytest.raises(ConfigError, match="already does"):
        slime.slime_settings(
            disk_args("gen2", tmp_path), environ={"ASYNCSYNC_SLIME_RECEIVERS": "slime"}
        )


def test_delta_dir_alias_differing_by_a_trailing_slash_is_refused_as_slime(tmp_path: Path) -> None:
    args = ns(
        "gen1",
        update_weight_transport="disk",
        update_weight_disk_dir=str(tmp_path),
        update_weight_delta_dir=str(tmp_path) + "/",
    )
    with pytest.raises(ValueError, match="deprecated alias"):
        rules.validate("gen1", ns("gen1", **{k: getattr(args, k) for k in vars(args)}))
    with pytest.raises(ConfigError, match="deprecated alias"):
        sync_config_from_args(args, environ={})


# ------------------------------------------------------------- slime's own flags (issue 25: 4)


def test_gen1_with_slimes_own_flags_only(tmp_path: Path) -> None:
    full = disk_args("gen1", tmp_path)
    assert not hasattr(full, "asyncsync_receivers")  # slime 90c212b5c's parser, nothing more
    s = slime.slime_settings(full, environ={})
    assert s.receivers == "slime"  # the updater reloads the engines, as slime's does
    delta = disk_args("gen1", tmp_path, update_weight_mode="delta")
    with pytest.raises(ConfigError) as err:
        slime.slime_settings(delta, environ={})
    assert "ASYNCSYNC_SLIME_LOCAL_CHECKPOINT_DIR" in str(err.value)
    assert "give --update-weight-local-checkpoint-dir" not in str(err.value)
    env = {"ASYNCSYNC_SLIME_LOCAL_CHECKPOINT_DIR": "/l"}
    assert slime.slime_settings(delta, environ=env).receivers == "ray"


def test_gen2a_pre_read_hook_is_known(tmp_path: Path) -> None:
    args = disk_args(
        "gen2a",
        tmp_path,
        update_weight_mode="delta",
        update_weight_local_checkpoint_dir="/l",
        custom_delta_pre_read_path="tests.slime_stubs.hooks.pre_read",
        custom_delta_pre_push_path="tests.slime_stubs.hooks.record",
    )
    s = slime.slime_settings(args, environ={})
    assert s.pre_read_hook == "tests.slime_stubs.hooks.pre_read"
    assert (s.hook, s.hook_flag) == (
        "tests.slime_stubs.hooks.record",
        "--custom-delta-pre-push-path",
    )
    s = slime.slime_settings(
        disk_args("gen2a", tmp_path, custom_delta_pre_push_path="x.y"), environ={}
    )
    assert s.hook is None  # full mode: slime c74877886 does not call it either


# ------------------------------------------------------------------ install() (issue 25: 3)


def test_installed_classes_take_any_call(fake_slime: dict[str, Any], tmp_path: Path) -> None:
    module = slime.factory.SLIME_CLASSES["UpdateWeightFromDiskDelta"]
    original = fake_slime[module].UpdateWeightFromDiskDelta
    install(fake_slime)
    cls = fake_slime[module].UpdateWeightFromDiskDelta
    disk = ns(
        "gen2",
        update_weight_mode="delta",
        update_weight_transport="disk",
        update_weight_disk_dir=str(tmp_path),
        update_weight_local_checkpoint_dir="/l",
        asyncsync_receivers="sidecar",
    )
    # weights_getter positionally, as a subclass's super().__init__ passes it
    with cls(disk, None, dict, model_name="m", quantization_config=None) as ours:
        assert isinstance(ours, slime.AsyncSyncWeightUpdater) and ours.weights_getter is dict
    nccl = cls(ns("gen2"), None, dict, model_name="m", quantization_config=None)
    assert type(nccl) is original  # slime's own, built once

    class Sub(cls):  # type: ignore[misc, valid-type]
        pass

    sub = Sub(ns("gen2"), None, weights_getter=dict, model_name="m", quantization_config=None)
    assert type(sub) is Sub and sub.kw["weights_getter"] is dict
    assert isinstance(cls, type) and issubclass(cls, original) and cls.__name__ == original.__name__
    assert vars(cls)[slime.factory.ASYNCSYNC_ORIGINAL] is original
    actor = fake_slime["slime.backends.megatron_utils.actor"]
    disk_module = fake_slime[slime.factory.SLIME_CLASSES["UpdateWeightFromDisk"]]
    assert actor.UpdateWeightFromDisk is disk_module.UpdateWeightFromDisk  # one dispatcher


# ------------------------------------------------------------- the converter (issue 25: 2)


@pytest.mark.parametrize("rev", ["gen1", "gen2a", "6d485c423", "gen2"])
def test_default_converter_passes_only_what_the_installed_slime_accepts(
    monkeypatch: pytest.MonkeyPatch, rev: str
) -> None:
    import torch

    from tests.slime_stubs import fake_slime as fakes

    mod = fakes.install_iterator(monkeypatch, rev)
    weights = {f"w{i}": torch.full((2,), float(i)) for i in range(7)}  # 4 chunks of <= 2
    got: dict[int, list[str]] = {}
    for rank in range(2):
        mod.calls.clear()
        out = slime.slime_converter(
            argparse.Namespace(), None, weights, model_name="m", quantization_config=None,
            rank=rank, world_size=2,
        )  # fmt: skip
        got[rank] = [name for name, _ in out]
        init = dict(mod.calls)["init"]
        assert init.get("ue8m0", False) is False  # slime's disk saver: transform_ue8m0=False
        assert ("ue8m0" in init) == ("transform_ue8m0" in rules.ITERATOR_INIT[rev])
        chunks = dict(mod.calls)["chunks"]
        assert ("should_convert_chunk" in chunks) == (
            "should_convert_chunk" in rules.ITERATOR_CHUNKS[rev]
        )
    # chunk i on rank i % 2, together every tensor once
    assert got[0] == ["hf.w0", "hf.w1", "hf.w4", "hf.w5"] and got[1] == [
        "hf.w2", "hf.w3", "hf.w6",
    ]  # fmt: skip
    assert slime.weights.accepts(mod.HfWeightIteratorDirect, "transform_ue8m0") == (rev == "gen2")
