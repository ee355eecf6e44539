"""The engine side of asyncsync: a receiver agent that keeps an engine at the newest version.

::

    from receiver import ReceiverAgent
    from receiver.engines import LocalCheckpoint

    async with ReceiverAgent("/shared/weights", LocalCheckpoint("/local/ckpt"), "gpu0") as agent:
        await agent.run()
"""

import importlib
from typing import TYPE_CHECKING, Any

# The names below are imported on first use (PEP 562): importing a submodule alone (the
# console script's ``receiver.entry``, an engine's plugin) does not import torch and the agent.
_LAZY = {
    "AgentStatus": "receiver.agent",
    "ReceiverAgent": "receiver.agent",
    "Engine": "receiver.engines",
    "EngineState": "receiver.engines",
    "TensorUpdate": "receiver.engines",
}

if TYPE_CHECKING:
    from receiver.agent import AgentStatus, ReceiverAgent
    from receiver.engines import Engine, EngineState, TensorUpdate


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = ["AgentStatus", "Engine", "EngineState", "ReceiverAgent", "TensorUpdate"]
