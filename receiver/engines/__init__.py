"""Engines a receiver can apply versions to: one module each."""

from receiver.engines.base import Engine, EngineState, TensorUpdate

__all__ = ["Engine", "EngineState", "TensorUpdate"]
