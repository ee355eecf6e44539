"""slime compatibility: asyncsync as slime's disk weight updater (full and delta).

In slime's actor, where slime picks its updater class::

    from asyncsync.training.slime import create_weight_updater   # or: install()

    self.weight_updater = create_weight_updater(
        self.args, self.model, weights_getter=lambda: self.weights_backuper.get("actor"),
        model_name=model_name, quantization_config=quantization_config,
    )

It builds :class:`AsyncSyncWeightUpdater` for ``--update-weight-transport disk`` (full and
delta) and slime's own class for nccl and colocate (:mod:`.factory`). The updater converts
slime's Megatron shards to HF tensors (:mod:`.weights`), publishes them from every rank as one
version, and waits until the receivers beside the engines (:mod:`.engines`) report that the
engines serve it, or reloads them itself where slime's updater would (:mod:`.reload`). Three
designs of slime are known: gen1 (90c212b5c), gen2a (c74877886), gen2 (624b824a8).
Arguments, slime's checks and the config: :mod:`.args`. docs/INTEGRATION.md has the table of
what matches slime at each and what differs, and a launch example.
"""

from asyncsync.training.slime.args import (
    DEFAULT_KEEP_VERSIONS,
    GENERATIONS,
    REVISIONS,
    SLIME_OPTIONS,
    SlimeSettings,
    add_arguments,
    given,
    record_given,
    resolve_deprecated_args,
    slime_generation,
    slime_settings,
    sync_config_from_args,
    validate_args,
)
from asyncsync.training.slime.engines import EngineLink, NoEngines, RayReceivers, Sidecars
from asyncsync.training.slime.factory import choose, create_weight_updater, install, slime_choice
from asyncsync.training.slime.reload import HostReceivers, SlimeReload
from asyncsync.training.slime.updater import AsyncSyncWeightUpdater
from asyncsync.training.slime.weights import (
    Converter,
    identity_converter,
    looks_megatron,
    resolve_converter,
    slime_converter,
    write_hf_view,
)

__all__ = [
    "DEFAULT_KEEP_VERSIONS",
    "GENERATIONS",
    "REVISIONS",
    "SLIME_OPTIONS",
    "AsyncSyncWeightUpdater",
    "Converter",
    "EngineLink",
    "HostReceivers",
    "NoEngines",
    "RayReceivers",
    "Sidecars",
    "SlimeReload",
    "SlimeSettings",
    "add_arguments",
    "choose",
    "create_weight_updater",
    "given",
    "identity_converter",
    "install",
    "looks_megatron",
    "record_given",
    "resolve_converter",
    "resolve_deprecated_args",
    "slime_choice",
    "slime_converter",
    "slime_generation",
    "slime_settings",
    "sync_config_from_args",
    "validate_args",
    "write_hf_view",
]
