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
``file=``, ``--sync-config`` or ``ASYNCSYNC_CONFIG``, in that order. Strings are accepted for
every field (that is what CLI and environment give): sizes as ``33554432``, ``32MiB`` or ``1G``
(K/M/G/T and KiB/MiB/... are powers of 1024, KB/MB/... powers of 1000), ``none`` for an optional
value, ``true``/``false`` for booleans, comma-separated engine ids.

The table of fields, with their command-line and environment names, is in docs/INTEGRATION.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import logging
import math
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from asyncsync.checksum import ALGORITHMS, DEFAULT_ALGORITHM
from asyncsync.codec import DEFAULT_ENCODING, ENCODINGS
from asyncsync.errors import ConfigError, ManifestError
from asyncsync.format import check_engine_id
from asyncsync.hooks import check_import_path, describe_callable
from asyncsync.staleness import AckPolicy

__all__ = ["ENV_PREFIX", "FIELD_HELP", "SyncConfig", "parse_size"]

logger = logging.getLogger(__name__)

ENV_PREFIX = "ASYNCSYNC_"
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_NONE = frozenset({"", "none", "null"})
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 10**3,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 10**6,
    "g": 1 << 30,
    "gib": 1 << 30,
    "gb": 10**9,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 10**12,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str) -> int:
    """Bytes in ``text``: ``4096``, ``32MiB``, ``1.5G`` (K/M/G/T = 1024^n, KB/MB/... = 1000^n)."""
    m = _SIZE_RE.match(text.replace("_", ""))
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size; write e.g. 33554432, 32MiB or 1G")
    value = float(m.group(1)) * _UNITS[unit]
    if value != int(value):
        raise ValueError(f"{text!r} is not a whole number of bytes")
    return int(value)


@dataclass(frozen=True)
class _Spec:
    """How one field is parsed from a string and checked."""

    kind: Literal["path", "choice", "int", "size", "float", "bool", "hook", "engines"]
    help: str
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    maximum: float | None = None
    optional: bool = False
    fix: str = ""  # appended to a failed check: how to fix it


@dataclass(frozen=True)
class SyncConfig:
    """Trainer-side weight-sync settings (see the module docstring for loaders and order).

    ``root`` may be given as a ``str``; it is stored as a :class:`~pathlib.Path`. Every other
    field also accepts its string form. ``pre_commit_hook`` is a callable ``hook(version_dir)``
    or its import path ``"pkg.module:function"``, resolved by the factory. What each field
    means: :data:`FIELD_HELP` (and ``--help`` of a parser given :meth:`add_arguments`).
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
    zstd_level: int = 3
    keep_versions: int | None = None
    keep_bytes: int | None = None
    pre_commit_hook: str | Callable[..., Any] | None = None
    start_version: int = 0
    ack_engines: tuple[str, ...] = ()
    ack_quorum: int | None = None
    ack_timeout: float | None = 600.0
    max_staleness: int = 0

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
        """The ack policy these fields describe (see :mod:`asyncsync.staleness`)."""
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
        **overrides: Any,
    ) -> SyncConfig:
        """Resolve every field: ``overrides`` > ``args`` > ``environ`` > file > defaults.

        The file is ``file``, else ``--<arg_prefix>-config``, else ``<env_prefix>CONFIG``.
        ``environ`` defaults to no environment (pass ``os.environ`` to read it).
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
            layers[name] = (value, f"argument {name}=")
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
_SPECS: dict[str, _Spec] = {
    "root": _Spec("path", "shared directory the versions are written to (one publisher per root)"),
    "mode": _Spec(
        "choice",
        "delta: sparse deltas against the previous version (+ keyframes); full: a complete "
        "safetensors checkpoint per version",
        choices=("delta", "full"),
    ),
    "transport": _Spec(
        "choice",
        "how weights travel; asyncsync moves them through the shared directory only",
        choices=("disk",),
        fix="asyncsync writes versions to a shared directory that the receivers read; it has no "
        "NCCL/RDMA transport. Use 'disk' (and set root), or keep your framework's own updater "
        "for in-cluster broadcast",
    ),
    "colocate": _Spec("bool", "engines share the trainer's GPUs (refused with mode 'delta')"),
    "encoding": _Spec(
        "choice",
        "delta encoding (ignored in full mode)",
        choices=ENCODINGS,
        fix="xef is asyncsync's and the smallest; indices, deltas and deltas_zstd are slime's "
        "generation-1 encodings",
    ),
    "checksum": _Spec("choice", "checksum of shards and tensors", choices=ALGORITHMS),
    "bucket_bytes": _Spec("size", "tensors per shard, in bytes (e.g. 32MiB)", minimum=1),
    "max_in_flight": _Spec(
        "int", "encoded buckets waiting for the writer (bounds memory)", minimum=1
    ),
    "keyframe_interval": _Spec(
        "int",
        "every N-th version also carries full data, for engines that join late (0: never)",
        minimum=0,
    ),
    "zstd_level": _Spec("int", "zstd level of delta payloads (1-22)", minimum=1, maximum=22),
    "keep_versions": _Spec(
        "int", "retention: keep the newest N versions (none: keep all)", minimum=1, optional=True
    ),
    "keep_bytes": _Spec(
        "size", "retention: keep at most this many bytes (none: no limit)", minimum=1, optional=True
    ),
    "pre_commit_hook": _Spec(
        "hook",
        "hook(version_dir) run after the shards are durable, before the commit; an import path "
        "pkg.module:function",
        optional=True,
    ),
    "start_version": _Spec(
        "int",
        "the trainer's weight version of the first publish (slime's update_weight_start_version)",
        minimum=0,
    ),
    "ack_engines": _Spec("engines", "engine ids that must all acknowledge (comma-separated)"),
    "ack_quorum": _Spec(
        "int", "or: how many engines (any) must acknowledge", minimum=1, optional=True
    ),
    "ack_timeout": _Spec(
        "float", "seconds to wait for acks before failing (none: forever)", optional=True
    ),
    "max_staleness": _Spec(
        "int",
        "versions the trainer may run ahead of the engines it waits for (0: wait for each "
        "version; 1: publish N, wait for N-1)",
        minimum=0,
    ),
}
assert list(_SPECS) == [f.name for f in dataclasses.fields(SyncConfig)]

#: What each field means, by name.
FIELD_HELP: dict[str, str] = {name: spec.help for name, spec in _SPECS.items()}


def _where(name: str) -> str:
    return f"[{SyncConfig.names(name)}]"


def _show(v: Any) -> str:
    if v is None:
        return "none"
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
        return _parse(spec, value)
    except (ValueError, TypeError) as exc:
        fix = f". {spec.fix}" if spec.fix else ""
        where = "" if source else f" {_where(name)}"
        raise ConfigError(f"{label}: {exc}{fix}{where}") from None


def _parse(spec: _Spec, raw: Any) -> Any:
    if isinstance(raw, str) and spec.kind not in ("path", "hook", "choice"):
        raw = raw.strip()
    if spec.optional and (raw is None or (isinstance(raw, str) and raw.lower() in _NONE)):
        return None
    if raw is None:
        raise ValueError("is required")
    kind = spec.kind
    value: Any
    if kind == "path":
        if not isinstance(raw, str | os.PathLike) or not str(raw).strip():
            raise ValueError(f"expected a directory path, got {raw!r}")
        return Path(os.path.expanduser(str(raw).strip()))
    if kind == "choice":
        if not isinstance(raw, str) or raw.strip() not in spec.choices:
            raise ValueError(f"must be one of {', '.join(spec.choices)}; got {raw!r}")
        return raw.strip()
    if kind == "bool":
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.lower() in _TRUE | _FALSE:
            return raw.lower() in _TRUE
        raise ValueError(f"expected true or false, got {raw!r}")
    if kind == "hook":
        if callable(raw):
            return raw
        if not isinstance(raw, str):
            raise ValueError(f"expected a callable or 'pkg.module:function', got {raw!r}")
        try:
            return check_import_path(raw, what="pre_commit_hook")
        except ConfigError as exc:
            raise ValueError(str(exc).removeprefix("pre_commit_hook: ")) from None
    if kind == "engines":
        items = raw.split(",") if isinstance(raw, str) else raw
        if not isinstance(items, list | tuple):
            raise ValueError(f"expected engine ids (a list or 'a,b,c'), got {raw!r}")
        out = []
        for item in items:
            try:
                out.append(check_engine_id(item.strip() if isinstance(item, str) else item))
            except ManifestError as exc:
                raise ValueError(str(exc)) from None
        if len(set(out)) != len(out):
            raise ValueError(f"engine ids repeat: {out}")
        return tuple(out)
    if isinstance(raw, bool):
        raise ValueError(f"expected a number, got {raw!r}")
    if kind == "float":
        try:
            value = float(raw) if isinstance(raw, int | float | str) else math.nan
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise ValueError(f"expected a finite number of seconds, got {raw!r}")
    elif kind == "size":
        if isinstance(raw, str):
            value = parse_size(raw)
        elif isinstance(raw, int):
            value = raw
        else:
            raise ValueError(f"expected a size such as 33554432 or 32MiB, got {raw!r}")
    else:  # int
        if isinstance(raw, str):
            try:
                value = int(raw)
            except ValueError:
                raise ValueError(f"expected a whole number, got {raw!r}") from None
        elif isinstance(raw, int):
            value = raw
        else:
            raise ValueError(f"expected a whole number, got {raw!r}")
    if spec.minimum is not None and value < spec.minimum:
        raise ValueError(f"must be >= {spec.minimum:g}, got {value}")
    if spec.maximum is not None and value > spec.maximum:
        raise ValueError(f"must be <= {spec.maximum:g}, got {value}")
    return value


def _build(cls: type[SyncConfig], layers: dict[str, tuple[Any, str]]) -> SyncConfig:
    values = {name: _check(name, raw, source) for name, (raw, source) in layers.items()}
    if values.get("root") is None:
        raise ConfigError(
            f"no root directory: set {SyncConfig.names('root')}, 'root' in the config file, or "
            "root= (slime: --update-weight-disk-dir)"
        )
    return cls(**values)


def _file_layer(path: Path, section: str | None) -> dict[str, tuple[Any, str]]:
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from exc
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
