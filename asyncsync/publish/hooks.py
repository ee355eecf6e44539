"""Hooks given as callables or as import paths, resolved with errors that say what to fix.

Configuration files, environment variables and command lines can only carry strings, so a hook
such as the publisher's ``pre_commit_hook`` may be named by its import path::

    resolve_callable("my_pkg.fs_hooks:flush_cache")      # module:attribute (preferred)
    resolve_callable("my_pkg.fs_hooks.flush_cache")      # dotted, as slime's load_function takes
    resolve_callable(my_function)                        # a callable is returned as is

``module:attribute`` may name a nested attribute (``pkg.mod:Class.method``). The dotted form
splits at the last dot. Resolution imports the module, so it is done where the hook is needed
(:func:`asyncsync.training.factory.create_publisher`), not when a configuration is parsed;
:func:`check_import_path` validates only the syntax.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any

from asyncsync.errors import ConfigError

__all__ = ["check_import_path", "describe_callable", "resolve_callable"]

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_DOTTED = rf"{_IDENT}(?:\.{_IDENT})*"
_COLON_RE = re.compile(rf"^({_DOTTED}):({_DOTTED})$")
_DOTTED_RE = re.compile(rf"^({_DOTTED})\.({_IDENT})$")

Hook = Callable[..., Any]


def _split(spec: str, what: str) -> tuple[str, str]:
    spec = spec.strip()
    m = _COLON_RE.match(spec) or _DOTTED_RE.match(spec)
    if m is None:
        raise ConfigError(
            f"{what}: {spec!r} is not an import path; write 'package.module:function' "
            "(or 'package.module.function')"
        )
    return m.group(1), m.group(2)


def check_import_path(spec: str, *, what: str = "hook") -> str:
    """Check that ``spec`` is syntactically an import path (imports nothing); return it stripped."""
    _split(spec, what)
    return spec.strip()


def resolve_callable(spec: str | Hook, *, what: str = "hook") -> Hook:
    """The callable that ``spec`` names (see the module docstring); a callable passes through.

    Raises :class:`~asyncsync.errors.ConfigError` naming ``what`` when the module cannot be
    imported, the attribute does not exist, or it is not callable.
    """
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise ConfigError(
            f"{what}: expected a callable or an import path string, got {type(spec).__name__}"
        )
    module_name, attr_path = _split(spec, what)
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ConfigError(
            f"{what}: cannot import module {module_name!r} (from {spec!r}): {exc}. Is the "
            "package installed in this environment, or its directory on PYTHONPATH?"
        ) from exc
    except Exception as exc:  # the user's module failed while importing
        raise ConfigError(
            f"{what}: importing {module_name!r} (from {spec!r}) raised {exc!r}; fix that module"
        ) from exc
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            public = sorted(n for n in dir(obj) if not n.startswith("_"))[:20]
            raise ConfigError(
                f"{what}: {spec!r}: {part!r} not found in {module_name!r}; "
                f"it defines: {', '.join(public) or 'nothing public'}"
            ) from exc
    if not callable(obj):
        raise ConfigError(f"{what}: {spec!r} names a {type(obj).__name__}, not a callable")
    hook: Hook = obj
    return hook


def describe_callable(obj: str | Hook | None) -> str | None:
    """A printable ``module:qualname`` for a hook (the string itself for an import path)."""
    if obj is None or isinstance(obj, str):
        return obj
    module = getattr(obj, "__module__", None) or "?"
    name = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    return f"{module}:{name}"
