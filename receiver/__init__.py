"""The engine side of asyncsync: a receiver agent that keeps an engine at the newest version.

::

    from receiver import ReceiverAgent
    from receiver.engines import LocalCheckpoint

    async with ReceiverAgent("/shared/weights", LocalCheckpoint("/local/ckpt"), "gpu0") as agent:
        await agent.run()
"""

from receiver.agent import AgentStatus, ReceiverAgent
from receiver.engines import Engine, EngineState, TensorUpdate

__all__ = ["AgentStatus", "Engine", "EngineState", "ReceiverAgent", "TensorUpdate"]
