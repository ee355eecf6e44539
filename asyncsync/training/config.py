"""The trainer side's one configuration object, :class:`SyncConfig`, and its loaders.

One frozen dataclass holds everything a trainer decides about weight sync: the mode (``delta``
sparse deltas, or ``full`` complete checkpoints), the shared directory, encoding, checksum,
bucket size, keyframes, retention, the pre-commit hook, the start version and the ack policy.
It is validated in one place (``__post_init__``), and every error says how to fix the input::

    cfg = SyncConfig(root="/shared/weights", mode="delta", max_staleness=1, ack_quorum=2)
    cfg = SyncConfig.from_file("sync.toml")                  # file > defaults
    cfg = SyncConfig.from_env()                              # ASYNCSYNC_* > file > defaults
    parser = argparse.ArgumentParser()
    SyncConfig.add_arguments(parser)                         # --sync-root, --sync-mode, ...
    cfg = SyncConfig.from_args(parser.parse_args())          # CLI > ASYNCSYNC_* > file > defaults

Resolution order, highest first: keyword arguments to the loader, command-line arguments,
environment variables (``ASYNCSYNC_<FIELD>``), the configuration file, the defaults. The file is
TOML (``.toml``) or JSON (``.json``) with the field names as keys; the loaders find it through
``file=``, ``--sync-config`` or ``ASYNCSYNC_CONFIG``, in that order. Every field also accepts
its string form (that is what CLI and environment give), see :mod:`asyncsync.training.settings`.

The table of fields, with their command-line and environment names, is in docs/INTEGRATION.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import logging
import os
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from asyncsync import fsio
from asyncsync.codec import DEFAULT_ENCODING
from asyncsync.errors import ConfigError
from asyncsync.format.checksum import DEFAULT_ALGORITHM
from asyncsync.publish.hooks import describe_callable
from asyncsync.training.settings import FIELD_SPECS as _SPECS
from asyncsync.training.settings import parse_size, parse_value
from asyncsync.training.staleness import AckPolicy

__all__ = ["ENV_PREFIX", "FIELD_HELP", "SyncConfig", "parse_size"]

logger = logging.getLogger(__name__)

ENV_PREFIX = "ASYNCSYNC_"
MAX_CONFIG_BYTES = 1 << 20  # a settings file larger than this is not one


@dataclass(frozen=True)
class SyncConfig:
    """Trainer-side weight-sync settings (see the module docstring for loaders and order).

    ``root`` may be given as a ``str``; it is stored as a :class:`~pathlib.Path`. Every other
    field also accepts its string form (``bucket_bytes="64MiB"``, ``ack_engines="a,b"``).
    ``pre_commit_hook`` is a callable ``hook(version_dir)`` or its import path
    ``"pkg.module:function"``, resolved by the factory. What each field means:
    :data:`FIELD_HELP` (and ``--help`` of a parser given :meth:`add_arguments`).

    Example::

        cfg = SyncConfig(root="/shared/weights", ack_quorum=2, max_staleness=1)
        cfg.ack_policy      # AckPolicy(engines=(), quorum=2, timeout=600.0, max_staleness=1)
    """

    root: Path = None  # type: ignore[assignment]  # required; None gives a clear error
    mode: Literal["delta", "full"] = "delta"
    transport: Literal["disk"] = "disk"
    colocate: bool = False
    encoding: str = DEFAULT_ENCODING
    checksum: str = DEFAULT_ALGORITHM
    bucket_bytes: int = 32 << 20
    max_in_flight: int = 2
    keyframe_interval: int = 20
    zstd_level: int = 1
    keep_versions: int | None = None
    keep_bytes: int | None = None
    pre_commit_hook: str | Callable[..., Any] | None = None
    start_version: int = 0
    ack_engines: tuple[str, ...] = ()
    ack_quorum: int | None = None
    ack_timeout: float | None = 600.0
    max_staleness: int = 0

    if TYPE_CHECKING:  # what the constructor accepts: string forms too (the attributes are typed)

        def __init__(
            self,
            root: str | os.PathLike[str],
            mode: str = ...,
            transport: str = ...,
            colocate: bool | str = ...,
            encoding: str = ...,
            checksum: str = ...,
            bucket_bytes: int | str = ...,
            max_in_flight: int | str = ...,
            keyframe_interval: int | str = ...,
            zstd_level: int | str = ...,
            keep_versions: int | str | None = ...,
            keep_bytes: int | str | None = ...,
            pre_commit_hook: str | Callable[..., Any] | None = ...,
            start_version: int | str = ...,
            ack_engines: Sequence[str] | str = ...,
            ack_quorum: int | str | None = ...,
            ack_timeout: float | str | None = ...,
            max_staleness: int | str = ...,
        ) -> None: ...

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = _check(f.name, getattr(self, f.name))
            object.__setattr__(self, f.name, value)
        if self.mode == "delta" and self.colocate:
            raise ConfigError(
                "mode 'delta' is refused with colocated engines: colocated engines take the "
                "weights in memory from the trainer's GPUs and keep no copy that a delta could "
                f"patch. Use mode 'full' {_where('mode')}, or run the engines on their own "
                f"GPUs (colocate false {_where('colocate')})"
            )
        if self.ack_engines and self.ack_quorum is not None:
            raise ConfigError(
                f"give ack_engines {_where('ack_engines')} (wait for each named engine) or "
                f"ack_quorum {_where('ack_quorum')} (wait for any N engines), not both"
            )
        if self.ack_timeout is not None and not self.ack_timeout > 0:
            raise ConfigError(
                f"ack_timeout must be > 0 seconds, or none to wait forever, got "
                f"{self.ack_timeout} {_where('ack_timeout')}"
            )

    # ------------------------------------------------------------------ derived views
    @property
    def ack_policy(self) -> AckPolicy:
        """The ack policy these fields describe (see :mod:`asyncsync.training.staleness`)."""
        return AckPolicy(
            engines=self.ack_engines,
            quorum=self.ack_quorum,
            timeout=self.ack_timeout,
            max_staleness=self.max_staleness,
        )

    @property
    def retention_requested(self) -> bool:
        return self.keep_versions is not None or self.keep_bytes is not None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able values (hooks as their import path or ``module:qualname``)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "root":
                v = str(v)
            elif f.name == "pre_commit_hook":
                v = describe_callable(v)
            elif f.name == "ack_engines":
                v = list(v)
            out[f.name] = v
        return out

    def replace(self, **changes: Any) -> SyncConfig:
        """A copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ loaders
    @classmethod
    def load(
        cls,
        *,
        args: argparse.Namespace | None = None,
        environ: Mapping[str, str] | None = None,
        file: str | os.PathLike[str] | None = None,
        section: str | None = None,
        env_prefix: str = ENV_PREFIX,
        arg_prefix: str = "sync",
        labels: Mapping[str, str] | None = None,
        **overrides: Any,
    ) -> SyncConfig:
        """Resolve every field: ``overrides`` > ``args`` > ``environ`` > file > defaults.

        The file is ``file``, else ``--<arg_prefix>-config``, else ``<env_prefix>CONFIG``.
        ``environ`` defaults to no environment (pass ``os.environ`` to read it). ``labels``
        names where each override came from, for error messages (e.g. a caller's own flag).
        """
        environ = environ if environ is not None else {}
        layers: dict[str, tuple[Any, str]] = {}
        path: str | os.PathLike[str] | None = file
        if path is None and args is not None:
            path = getattr(args, f"{arg_prefix}_config", None)
        if path is None:
            path = environ.get(f"{env_prefix}CONFIG") or None
        if path is not None:
            layers.update(_file_layer(Path(path), section))
        layers.update(_env_layer(environ, env_prefix))
        if args is not None:
            layers.update(_args_layer(args, arg_prefix))
        for name, value in overrides.items():
            if name not in _SPECS:
                raise ConfigError(_unknown(name, "SyncConfig has no field"))
            layers[name] = (value, (labels or {}).get(name, f"argument {name}="))
        return _build(cls, layers)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SyncConfig:
        """From a mapping of field names to values (strings accepted); unknown keys are refused."""
        layers = {}
        for name, value in data.items():
            if name not in _SPECS:
                raise ConfigError(_unknown(name, "SyncConfig has no field"))
            layers[name] = (value, f"{name}=")
        return _build(cls, layers)

    @classmethod
    def from_file(
        cls, path: str | os.PathLike[str], *, section: str | None = None, **overrides: Any
    ) -> SyncConfig:
        """From a TOML or JSON file (``section``: a dotted table such as ``tool.asyncsync``).

        Example file::

            root = "/shared/weights"
            mode = "delta"
            bucket_bytes = "64MiB"
            ack_quorum = 2
            max_staleness = 1
        """
        return cls.load(file=path, section=section, **overrides)

    @classmethod
    def from_env(
        cls,
        prefix: str = ENV_PREFIX,
        *,
        environ: Mapping[str, str] | None = None,
        **overrides: Any,
    ) -> SyncConfig:
        """From ``<prefix><FIELD>`` variables (and the file ``<prefix>CONFIG`` names).

        Example: ``ASYNCSYNC_ROOT=/shared/weights ASYNCSYNC_MODE=full python train.py``.
        """
        env = os.environ if environ is None else environ
        return cls.load(environ=env, env_prefix=prefix, **overrides)

    @classmethod
    def from_args(
        cls,
        args: argparse.Namespace,
        *,
        environ: Mapping[str, str] | None = None,
        prefix: str = "sync",
        env_prefix: str = ENV_PREFIX,
        **overrides: Any,
    ) -> SyncConfig:
        """From a namespace parsed with :meth:`add_arguments` (then environment, file)."""
        env = os.environ if environ is None else environ
        return cls.load(
            args=args, environ=env, arg_prefix=prefix, env_prefix=env_prefix, **overrides
        )

    @staticmethod
    def add_arguments(
        parser: argparse.ArgumentParser, *, prefix: str = "sync", env_prefix: str = ENV_PREFIX
    ) -> argparse._ArgumentGroup:
        """Add ``--<prefix>-<field>`` options (and ``--<prefix>-config``) to ``parser``.

        Options default to None (not given), so the environment and the file still apply.
        """
        group = parser.add_argument_group(
            "weight sync (asyncsync)",
            f"Resolution: command line > {env_prefix}<FIELD> > config file > default.",
        )
        group.add_argument(
            f"--{prefix}-config",
            dest=f"{prefix}_config",
            metavar="FILE",
            help=f"TOML or JSON file with these settings (env {env_prefix}CONFIG)",
        )
        for f in dataclasses.fields(SyncConfig):
            spec = _SPECS[f.name]
            flag = f"--{prefix}-{f.name.replace('_', '-')}"
            dest = f"{prefix}_{f.name}"
            shown = "required" if f.name == "root" else f"default: {_show(f.default)}"
            help_ = f"{spec.help} ({shown}; env {env_prefix}{f.name.upper()})"
            if spec.kind == "bool":
                group.add_argument(
                    flag, dest=dest, action=argparse.BooleanOptionalAction, default=None, help=help_
                )
            else:
                metavar = "{" + ",".join(spec.choices) + "}" if spec.choices else spec.kind.upper()
                group.add_argument(flag, dest=dest, metavar=metavar, default=None, help=help_)
        return group

    @staticmethod
    def names(field_name: str, *, prefix: str = "sync", env_prefix: str = ENV_PREFIX) -> str:
        """``--sync-x / ASYNCSYNC_X``: where a field can be set (for messages and docs)."""
        return f"--{prefix}-{field_name.replace('_', '-')} / {env_prefix}{field_name.upper()}"


# ---------------------------------------------------------------------- parsing and checks
assert list(_SPECS) == [f.name for f in dataclasses.fields(SyncConfig)]

#: What each field means, by name.
FIELD_HELP: dict[str, str] = {name: spec.help for name, spec in _SPECS.items()}


def _where(name: str) -> str:
    return f"[{SyncConfig.names(name)}]"


def _show(v: Any) -> str:
    if v is None:
        return "none"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, tuple):
        return ",".join(v) or "none"
    return str(v)


def _unknown(name: str, what: str) -> str:
    close = difflib.get_close_matches(name, list(_SPECS), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; fields: {', '.join(_SPECS)}"
    return f"{what} {name!r}{hint}"


def _check(name: str, value: Any, source: str | None = None) -> Any:
    """Parse (from a string when needed) and range-check one field; ConfigError says the fix."""
    spec = _SPECS[name]
    label = source or f"SyncConfig.{name}"
    try:
        return parse_value(spec, value)
    except (ValueError, TypeError) as exc:
        fix = f". {spec.fix}" if spec.fix else ""
        where = "" if source else f" {_where(name)}"
        raise ConfigError(f"{label}: {exc}{fix}{where}") from None


def _build(cls: type[SyncConfig], layers: dict[str, tuple[Any, str]]) -> SyncConfig:
    values = {name: _check(name, raw, source) for name, (raw, source) in layers.items()}
    if values.get("root") is None:
        raise ConfigError(
            f"no root directory: set {SyncConfig.names('root')}, 'root' in the config file, or "
            "root= (slime: --update-weight-disk-dir)"
        )
    return cls(**values)


def _file_layer(path: Path, section: str | None) -> dict[str, tuple[Any, str]]:
    # (a regular file, a symlink to one: a FIFO is refused, not waited on; /dev/zero not read
    # without end)
    try:
        text = fsio.read_bytes(path, limit=MAX_CONFIG_BYTES, follow_symlinks=True)
    except fsio.UnsafePath:
        raise ConfigError(
            f"config file {path} is not a regular file (a FIFO, a device or a directory?): "
            "point it at a .toml or .json file"
        ) from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from exc
    except ValueError:  # larger than the limit
        raise ConfigError(
            f"config file {path} is larger than {MAX_CONFIG_BYTES >> 20} MiB: it is not a "
            "settings file"
        ) from None
    try:
        if path.suffix == ".toml":
            data: Any = tomllib.loads(text.decode())
        elif path.suffix == ".json":
            data = json.loads(text)
        else:
            raise ConfigError(f"config file {path}: use a .toml or .json file")
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid {path.suffix[1:]}: {exc}") from exc
    for part in section.split(".") if section else ():
        if not isinstance(data, dict) or part not in data:
            raise ConfigError(f"config file {path} has no [{section}] table")
        data = data[part]
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a table of settings")
    out = {}
    for key, value in data.items():
        if key not in _SPECS:
            raise ConfigError(f"config file {path}: " + _unknown(key, "unknown setting"))
        out[key] = (value, f"{path}: {key}")
    return out


def _env_layer(environ: Mapping[str, str], prefix: str) -> dict[str, tuple[Any, str]]:
    out = {}
    for key, value in environ.items():
        if not key.startswith(prefix):
            continue
        name = key[len(prefix) :].lower()
        if name in _SPECS:
            out[name] = (value, f"{key}={value!r}")
        elif name != "config":
            close = difflib.get_close_matches(name, list(_SPECS), n=1, cutoff=0.8)
            if close:
                logger.warning(
                    "ignoring %s: not a setting; did you mean %s%s?", key, prefix, close[0].upper()
                )
    return out


def _args_layer(args: argparse.Namespace, prefix: str) -> dict[str, tuple[Any, str]]:
    out = {}
    for name in _SPECS:
        value = getattr(args, f"{prefix}_{name}", None)
        if value is not None:
            out[name] = (value, f"--{prefix}-{name.replace('_', '-')}")
    return out
