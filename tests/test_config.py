"""SyncConfig: coercion, validation messages, loaders, resolution order; hooks; staleness."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from asyncsync import ConfigError
from asyncsync.format import AckRecord
from asyncsync.publish.hooks import check_import_path, describe_callable, resolve_callable
from asyncsync.training.config import FIELD_HELP, SyncConfig, parse_size
from asyncsync.training.staleness import AckPolicy, AckWait, StalenessGate


def _ack(engine: str, version: int) -> AckRecord:
    return AckRecord(engine, version, "f" * 32, "run", 0.0, "host")


# ---------------------------------------------------------------------- the dataclass
def test_defaults_and_string_forms(tmp_path: Path) -> None:
    cfg = SyncConfig(root=str(tmp_path))
    assert cfg.root == tmp_path and isinstance(cfg.root, Path)
    assert (cfg.mode, cfg.transport, cfg.encoding, cfg.checksum) == (
        "delta",
        "disk",
        "xef",
        "xxh3-128",
    )
    assert cfg.ack_policy == AckPolicy(timeout=600.0)
    assert not cfg.ack_policy.waits and not cfg.retention_requested
    cfg = SyncConfig(
        root=tmp_path,
        mode="full",
        colocate="yes",
        bucket_bytes="64MiB",
        keep_versions="3",
        keep_bytes="1G",
        ack_engines="a, b",
        ack_timeout="none",
        max_staleness="1",
        zstd_level=" 5 ",
    )
    assert cfg.colocate is True and cfg.bucket_bytes == 64 << 20 and cfg.keep_bytes == 1 << 30
    assert cfg.keep_versions == 3 and cfg.retention_requested and cfg.zstd_level == 5
    assert cfg.ack_engines == ("a", "b") and cfg.ack_timeout is None
    assert cfg.ack_policy == AckPolicy(engines=("a", "b"), timeout=None, max_staleness=1)
    assert set(FIELD_HELP) == set(cfg.to_dict())


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        ("32MiB", 32 << 20),
        ("32M", 32 << 20),
        ("32MB", 32_000_000),
        ("1.5G", 3 << 29),
        ("2 KiB", 2048),
        ("1_000", 1000),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "MiB", "12 parsecs", "-1", "0.5B"])
def test_parse_size_refuses(text: str) -> None:
    with pytest.raises(ValueError, match=r"size|whole"):
        parse_size(text)


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("root", None, "is required"),
        ("root", "", "directory path"),
        ("mode", "sparse", "one of delta, full"),
        ("transport", "nccl", "no NCCL/RDMA transport"),
        ("encoding", "xor", "xef is asyncsync's"),
        ("checksum", "md5", "one of xxh3-128"),
        ("bucket_bytes", 0, ">= 1"),
        ("bucket_bytes", "lots", "33554432, 32MiB"),
        ("bucket_bytes", 1.5, "size such as"),
        ("max_in_flight", 0, ">= 1"),
        ("keyframe_interval", -1, ">= 0"),
        ("zstd_level", 23, "<= 22"),
        ("keep_versions", 0, ">= 1"),
        ("keep_bytes", "0", ">= 1"),
        ("pre_commit_hook", "not a path", "package.module:function"),
        ("pre_commit_hook", 3, "callable"),
        ("start_version", -1, ">= 0"),
        ("start_version", True, "number"),
        ("ack_engines", "ok,../bad", "invalid engine id"),
        ("ack_engines", "a,a", "repeat"),
        ("ack_quorum", 0, ">= 1"),
        ("ack_timeout", "soon", "finite number"),
        ("ack_timeout", 0, "> 0 seconds"),
        ("max_staleness", "-2", ">= 0"),
        ("colocate", "maybe", "true or false"),
    ],
)
def test_field_errors_say_how_to_fix(tmp_path: Path, field: str, value: Any, needle: str) -> None:
    kwargs: dict[str, Any] = {"root": tmp_path, field: value}
    with pytest.raises(ConfigError, match=needle) as info:
        SyncConfig(**kwargs)
    flag = "--sync-" + field.replace("_", "-")
    assert flag in str(info.value) and f"ASYNCSYNC_{field.upper()}" in str(info.value)


def test_typed_constructor_signature_lists_every_field() -> None:
    """The TYPE_CHECKING-only __init__ (wide input types for mypy) must mirror the fields."""
    import ast
    import inspect

    import asyncsync.training.config as config_module

    tree = ast.parse(inspect.getsource(config_module))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SyncConfig")
    guard = next(n for n in cls.body if isinstance(n, ast.If))
    init = next(n for n in guard.body if isinstance(n, ast.FunctionDef))
    names = [a.arg for a in init.args.args[1:]]
    assert names == [f.name for f in dataclasses.fields(SyncConfig)]


def test_refused_combinations(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"refused with colocated engines.*Use mode 'full'"):
        SyncConfig(root=tmp_path, mode="delta", colocate=True)
    assert SyncConfig(root=tmp_path, mode="full", colocate=True).colocate
    with pytest.raises(ConfigError, match="not both"):
        SyncConfig(root=tmp_path, ack_engines=("a",), ack_quorum=1)


def test_replace_validates_and_to_dict_round_trips(tmp_path: Path) -> None:
    cfg = SyncConfig(root=tmp_path, ack_engines=("e0",), pre_commit_hook="os.path:join")
    again = SyncConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg
    with pytest.raises(ConfigError):
        cfg.replace(mode="delta", colocate=True)
    with pytest.raises(ConfigError, match="did you mean 'keep_versions'"):
        SyncConfig.from_dict({"root": str(tmp_path), "keep_version": 3})


# ---------------------------------------------------------------------- loaders
def _write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


def test_from_file_toml_json_and_section(tmp_path: Path) -> None:
    toml = _write(
        tmp_path / "sync.toml",
        f"""
        root = "{tmp_path / "w"}"
        mode = "full"
        bucket_bytes = "8MiB"
        ack_engines = ["e0", "e1"]
        ack_timeout = 30
        """,
    )
    cfg = SyncConfig.from_file(toml)
    assert (cfg.root, cfg.mode, cfg.bucket_bytes) == (tmp_path / "w", "full", 8 << 20)
    assert cfg.ack_engines == ("e0", "e1") and cfg.ack_timeout == 30.0
    js = tmp_path / "sync.json"
    js.write_text(json.dumps({"tool": {"asyncsync": {"root": "/x", "keep_versions": None}}}))
    cfg = SyncConfig.from_file(js, section="tool.asyncsync", max_staleness=2)
    assert cfg.root == Path("/x") and cfg.keep_versions is None and cfg.max_staleness == 2


@pytest.mark.parametrize(
    ("name", "text", "needle"),
    [
        ("a.toml", 'root = "/x"\nmode = "sparse"\n', r"a.toml: mode: must be one of"),
        ("b.toml", 'root = "/x"\nbucket = 3\n', "unknown setting 'bucket'; did you mean"),
        ("c.toml", "root = [\n", "not valid toml"),
        ("d.json", "[1, 2]", "expected a table"),
        ("e.yaml", "root: /x", "use a .toml or .json"),
        ("f.toml", "mode = 'full'\n", "no root directory"),
    ],
)
def test_from_file_errors(tmp_path: Path, name: str, text: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        SyncConfig.from_file(_write(tmp_path / name, text))


def test_from_file_missing_and_missing_section(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        SyncConfig.from_file(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match=r"no \[tool.asyncsync\] table"):
        SyncConfig.from_file(_write(tmp_path / "s.toml", 'root = "/x"\n'), section="tool.asyncsync")


def test_from_file_fifo_device_directory_refused_not_waited_on(tmp_path: Path) -> None:
    """A config path that is a FIFO (read_bytes blocked for ever), a symlink to /dev/zero (read
    without end, memory) or a directory is refused at once; a symlink to a file is followed."""
    import os

    os.mkfifo(tmp_path / "fifo.toml")
    (tmp_path / "zero.toml").symlink_to("/dev/zero")
    (tmp_path / "dir.toml").mkdir()
    for name in ("fifo.toml", "zero.toml", "dir.toml"):
        with pytest.raises(ConfigError, match="is not a regular file"):
            SyncConfig.from_file(tmp_path / name)
    with pytest.raises(ConfigError, match="not a regular file"):
        SyncConfig.load(environ={"ASYNCSYNC_CONFIG": str(tmp_path / "fifo.toml")})
    (tmp_path / "big.toml").write_bytes(b"#" * (2 << 20))
    with pytest.raises(ConfigError, match="larger than 1 MiB"):
        SyncConfig.from_file(tmp_path / "big.toml")
    (tmp_path / "link.toml").symlink_to(_write(tmp_path / "real.toml", f'root = "{tmp_path}"\n'))
    assert SyncConfig.from_file(tmp_path / "link.toml").root == tmp_path


def test_from_env_and_its_errors(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    env = {
        "ASYNCSYNC_ROOT": str(tmp_path),
        "ASYNCSYNC_MODE": "full",
        "ASYNCSYNC_ACK_QUORUM": "2",
        "ASYNCSYNC_FORCE_POLLING": "1",  # the receiver's variable: not ours, silently ignored
        "ASYNCSYNC_KEEP_VERSION": "3",  # a typo: ignored with a warning
        "OTHER": "x",
    }
    with caplog.at_level(logging.WARNING, logger="asyncsync.training.config"):
        cfg = SyncConfig.from_env(environ=env)
    assert (cfg.root, cfg.mode, cfg.ack_quorum) == (tmp_path, "full", 2)
    assert "did you mean ASYNCSYNC_KEEP_VERSIONS" in caplog.text
    assert "FORCE_POLLING" not in caplog.text
    with pytest.raises(ConfigError, match="ASYNCSYNC_BUCKET_BYTES='abc'"):
        SyncConfig.from_env(environ={"ASYNCSYNC_ROOT": "/x", "ASYNCSYNC_BUCKET_BYTES": "abc"})
    cfg = SyncConfig.from_env("TRAINER_SYNC_", environ={"TRAINER_SYNC_ROOT": "/y"})
    assert cfg.root == Path("/y")
    with pytest.raises(ConfigError, match=r"no root directory.*ASYNCSYNC_ROOT"):
        SyncConfig.from_env(environ={})


def test_resolution_order_argument_env_file_default(tmp_path: Path) -> None:
    """Each field set by a different number of layers shows which layer wins."""
    cfg_file = _write(
        tmp_path / "s.toml",
        """
        root = "/from-file"
        mode = "full"
        encoding = "indices"
        keyframe_interval = 5
        zstd_level = 9
        """,
    )
    env = {
        "ASYNCSYNC_CONFIG": str(cfg_file),
        "ASYNCSYNC_ROOT": "/from-env",
        "ASYNCSYNC_MODE": "delta",
        "ASYNCSYNC_ENCODING": "deltas",
    }
    parser = argparse.ArgumentParser()
    SyncConfig.add_arguments(parser)
    args = parser.parse_args(["--sync-root", "/from-cli", "--sync-mode", "full"])
    cfg = SyncConfig.from_args(args, environ=env, keyframe_interval=7)
    assert cfg.root == Path("/from-cli")  # cli > env > file
    assert cfg.mode == "full"  # cli > env
    assert cfg.encoding == "deltas"  # env > file
    assert cfg.zstd_level == 9  # file > default
    assert cfg.keyframe_interval == 7  # keyword argument > file
    assert cfg.max_in_flight == 2  # default
    # --sync-config beats ASYNCSYNC_CONFIG; file= beats both
    other = _write(tmp_path / "o.toml", 'root = "/other"\nzstd_level = 4\n')
    args = parser.parse_args(["--sync-config", str(other)])
    assert SyncConfig.from_args(args, environ=env).zstd_level == 4
    assert SyncConfig.load(args=args, environ=env, file=cfg_file).zstd_level == 9


def test_add_arguments_and_from_args(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    SyncConfig.add_arguments(parser)
    help_text = parser.format_help()
    assert "--sync-max-staleness" in help_text and "ASYNCSYNC_MAX_STALENESS" in help_text
    args = parser.parse_args(
        [
            "--sync-root",
            str(tmp_path),
            "--sync-mode",
            "full",
            "--sync-colocate",
            "--sync-bucket-bytes",
            "1MiB",
            "--sync-ack-engines",
            "a,b",
            "--sync-pre-commit-hook",
            "os.path:join",
        ]
    )
    cfg = SyncConfig.from_args(args, environ={})
    assert cfg.colocate and cfg.bucket_bytes == 1 << 20 and cfg.pre_commit_hook == "os.path:join"
    args = parser.parse_args(["--sync-root", "/r", "--no-sync-colocate", "--sync-colocate"])
    assert SyncConfig.from_args(args, environ={"ASYNCSYNC_MODE": "full"}).colocate
    args = parser.parse_args(["--sync-root", "/r", "--sync-zstd-level", "99"])
    with pytest.raises(ConfigError, match="--sync-zstd-level: must be <= 22"):
        SyncConfig.from_args(args, environ={})
    custom = argparse.ArgumentParser()
    SyncConfig.add_arguments(custom, prefix="ws")
    args = custom.parse_args(["--ws-root", "/r", "--ws-max-staleness", "2"])
    assert SyncConfig.from_args(args, environ={}, prefix="ws").max_staleness == 2
    with pytest.raises(ConfigError, match="SyncConfig has no field 'rooot'"):
        SyncConfig.load(rooot="/r")


# ---------------------------------------------------------------------- hooks
def _module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, body: str) -> None:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)


def test_resolve_callable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _module(
        tmp_path,
        monkeypatch,
        "user_hooks_ok",
        """
        def flush(path):
            return ("flushed", path)

        class Ns:
            @staticmethod
            def nested(path):
                return path

        VALUE = 3
        """,
    )
    assert resolve_callable("user_hooks_ok:flush")("p") == ("flushed", "p")
    assert resolve_callable("user_hooks_ok.flush")("p") == ("flushed", "p")
    assert resolve_callable("user_hooks_ok:Ns.nested")("q") == "q"
    assert resolve_callable(len) is len
    assert describe_callable(resolve_callable("user_hooks_ok:flush")) == "user_hooks_ok:flush"
    with pytest.raises(ConfigError, match=r"'nope' not found in 'user_hooks_ok'.*flush"):
        resolve_callable("user_hooks_ok:nope")
    with pytest.raises(ConfigError, match="names a int, not a callable"):
        resolve_callable("user_hooks_ok:VALUE")
    with pytest.raises(ConfigError, match=r"cannot import module 'no_such_pkg_x.mod'.*PYTHONPATH"):
        resolve_callable("no_such_pkg_x.mod:fn", what="pre_commit_hook")
    with pytest.raises(ConfigError, match="not an import path"):
        check_import_path("a:b:c")


def test_resolve_callable_module_that_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _module(tmp_path, monkeypatch, "user_hooks_broken", "raise RuntimeError('boom')\n")
    with pytest.raises(ConfigError, match=r"importing 'user_hooks_broken'.*boom.*fix that module"):
        resolve_callable("user_hooks_broken:fn")


# ---------------------------------------------------------------------- staleness
class _FakeWaiter:
    def __init__(self, acks: dict[str, AckRecord]) -> None:
        self.acks = acks
        self.calls: list[tuple[int, Any, Any, Any]] = []

    async def wait_acked(
        self,
        version: int,
        *,
        engines: list[str] | None = None,
        quorum: int | None = None,
        timeout: float | None = None,
    ) -> dict[str, AckRecord]:
        self.calls.append((version, engines, quorum, timeout))
        return self.acks


def test_ack_policy_validation() -> None:
    for bad in (
        {"engines": ("a",), "quorum": 1},
        {"quorum": 0},
        {"timeout": 0},
        {"max_staleness": -1},
        # (these were taken, or failed as a TypeError: 'e0' was waited for as engines 'e', '0')
        {"quorum": 2.5},
        {"quorum": True},
        {"max_staleness": 1.5},
        {"max_staleness": None},
        {"engines": None},
        {"engines": (1,)},
        {"engines": ("a b",)},
    ):
        with pytest.raises(ConfigError):
            AckPolicy(**bad)
    assert AckPolicy(engines="e0").engines == ("e0",)
    assert AckPolicy(engines="a,b", max_staleness="1").engines == ("a", "b")
    assert AckPolicy(quorum="2").quorum == 2
    assert "any 2 engine(s)" in AckPolicy(quorum=2).describe()
    assert AckPolicy().describe() == "no ack wait"


async def test_staleness_gate_targets() -> None:
    waiter = _FakeWaiter({"a": _ack("a", 4), "b": _ack("b", 5)})
    gate = StalenessGate(waiter, AckPolicy(engines=("a", "b"), max_staleness=1, timeout=9), floor=3)
    assert [gate.target(v) for v in (3, 4, 5)] == [None, 3, 4]
    w = await gate.wait(5)
    assert waiter.calls == [(4, ["a", "b"], None, 9)]
    assert (w.target, w.slowest, w.staleness) == (4, 4, 1)
    gate.policy = AckPolicy(quorum=1)
    await gate.wait(5)
    assert waiter.calls[-1] == (5, None, 1, 600.0)
    gate.policy = AckPolicy()
    assert await gate.wait(6) == AckWait(published=6, target=None, seconds=0.0)
    assert AckWait(6, None, 0.0).staleness is None
