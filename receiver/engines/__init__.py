"""Engines a receiver can apply versions to: one module each."""

from receiver.engines.base import Engine, EngineState, TensorUpdate

__all__ = ["Engine", "EngineState", "TensorUpdate"]

from receiver.engines.checkpoint import LocalCheckpoint, verify_checkpoint
from receiver.engines.torch_module import TorchModule

__all__ += ["LocalCheckpoint", "TorchModule", "verify_checkpoint"]
