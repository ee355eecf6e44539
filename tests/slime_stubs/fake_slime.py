"""Stand-ins for the parts of slime the updater calls (written from slime's signatures, no code).

* :func:`iterator_module`: slime's ``hf_weight_iterator_direct`` module as one revision defines
  it (``HfWeightIteratorDirect.__init__(*args, **kwargs)`` passing everything to
  ``HfWeightIteratorBase.__init__``, whose parameters and those of ``get_hf_weight_chunks``
  are :data:`.rules.ITERATOR_INIT` / :data:`.rules.ITERATOR_CHUNKS`). Chunks hold two tensors
  each, renamed ``hf.<name>``; a chunk ``should_convert_chunk`` declines comes out empty, as
  in slime. Every call is recorded in ``module.calls``.
* :class:`EngineCore`: the part of slime's ``SGLangEngine`` actor the updater calls
  (``get_url``, ``pause_generation``, ``flush_cache``, ``update_weights_from_disk``,
  ``continue_generation``), recording the calls; ``update_weights_from_disk`` loads the
  safetensors under ``model_path`` as an engine would. :class:`LocalHandle` calls one in
  process (``handle.method.remote(...)`` returns the result; ``__ray_call__`` as Ray's);
  ``ray.remote(EngineCore)`` makes the real Ray actor.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

MODULE = "slime.backends.megatron_utils.update_weight.hf_weight_iterator_direct"


def iterator_module(rev: str) -> types.ModuleType:
    """slime's iterator module at ``rev`` (a key of :data:`.rules.ITERATOR_INIT`)."""
    mod = types.ModuleType(MODULE)
    calls: list[tuple[str, dict[str, Any]]] = []
    mod.calls = calls  # type: ignore[attr-defined]

    def _chunks(
        self: Any, weights: dict[str, torch.Tensor], convert: Callable[[int], bool] | None
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        names = sorted(weights)
        for idx, start in enumerate(range(0, len(names), 2)):
            if convert is None or convert(idx):
                yield [(f"hf.{n}", weights[n]) for n in names[start : start + 2]]
            else:
                yield []

    if rev == "gen2":

        class Base:
            def __init__(
                self, args: Any, model: Any, model_name: Any, quantization_config: Any,
                transform_ue8m0: bool = True,
            ) -> None:  # fmt: skip
                calls.append(("init", {"model_name": model_name, "ue8m0": transform_ue8m0}))
    else:

        class Base:  # type: ignore[no-redef]
            def __init__(
                self, args: Any, model: Any, model_name: Any, quantization_config: Any
            ) -> None:
                calls.append(("init", {"model_name": model_name}))

    if rev in ("gen1", "gen2a"):

        class Direct(Base):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)

            def get_hf_weight_chunks(
                self, megatron_local_weights: Any, progress_desc: str = "Update weights"
            ) -> Iterator[list[tuple[str, torch.Tensor]]]:
                calls.append(("chunks", {}))
                return _chunks(self, megatron_local_weights, None)
    else:

        class Direct(Base):  # type: ignore[no-redef]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)

            def get_hf_weight_chunks(
                self,
                megatron_local_weights: Any,
                progress_desc: str = "Update weights",
                should_convert_chunk: Callable[[int], bool] | None = None,
                param_info_buckets: Any = None,
            ) -> Iterator[list[tuple[str, torch.Tensor]]]:
                calls.append(("chunks", {"should_convert_chunk": should_convert_chunk}))
                return _chunks(self, megatron_local_weights, should_convert_chunk)

    Direct.__name__ = "HfWeightIteratorDirect"
    mod.HfWeightIteratorDirect = Direct  # type: ignore[attr-defined]
    return mod


def install_iterator(monkeypatch: Any, rev: str) -> types.ModuleType:
    """Make ``rev``'s iterator module importable under slime's name (and its parents)."""
    mod = iterator_module(rev)
    parts = MODULE.split(".")
    for i in range(1, len(parts)):
        name = ".".join(parts[:i])
        if name not in sys.modules:
            pkg = types.ModuleType(name)
            pkg.__path__ = []  # type: ignore[attr-defined]
            monkeypatch.setitem(sys.modules, name, pkg)
    monkeypatch.setitem(sys.modules, MODULE, mod)
    return mod


class EngineCore:
    """slime's engine actor, the calls the updater makes (module docstring)."""

    def __init__(self, url: str = "http://127.0.0.1:1", host: int = 0) -> None:
        self.url, self.host = url, host
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.weights: dict[str, torch.Tensor] = {}

    def get_url(self) -> str | None:
        return self.url if self.host == 0 else None  # slime: only node 0 has a URL

    def pause_generation(self) -> None:
        self.calls.append(("pause_generation", {}))

    def flush_cache(self) -> None:
        self.calls.append(("flush_cache", {}))

    def continue_generation(self) -> None:
        self.calls.append(("continue_generation", {}))

    def update_weights_from_disk(
        self, model_path: str, load_format: str | None = None, weight_version: str | None = None
    ) -> dict[str, Any]:
        self.calls.append(
            (
                "update_weights_from_disk",
                {"model_path": model_path, "weight_version": weight_version},
            )
        )
        loaded: dict[str, torch.Tensor] = {}
        for f in sorted(Path(model_path).glob("*.safetensors")):
            loaded.update(safetensors.torch.load_file(f))
        self.weights = loaded
        return {"success": True}

    def recorded(self) -> list[tuple[str, dict[str, Any]]]:
        return list(self.calls)

    def loaded(self) -> dict[str, torch.Tensor]:
        return dict(self.weights)


class _Method:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def remote(self, *a: Any, **kw: Any) -> Any:
        return self.fn(*a, **kw)


class LocalHandle:
    """An :class:`EngineCore` called in process the way a Ray actor handle is called."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.__ray_call__ = _Method(lambda fn, *a, **kw: fn(core, *a, **kw))

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self.core, name))
