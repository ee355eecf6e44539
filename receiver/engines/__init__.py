"""Engines a receiver can apply versions to: one module each."""

from receiver.engines.base import Engine, EngineState, TensorUpdate
from receiver.engines.checkpoint import LocalCheckpoint, verify_checkpoint
from receiver.engines.http_engine import EngineHTTPError, HttpClient, RetryPolicy, Timeouts
from receiver.engines.reloading import ReloadingEngine
from receiver.engines.sglang import SGLang
from receiver.engines.torch_module import TorchModule
from receiver.engines.vllm import VLLM

__all__ = [
    "VLLM",
    "Engine",
    "EngineHTTPError",
    "EngineState",
    "HttpClient",
    "LocalCheckpoint",
    "ReloadingEngine",
    "RetryPolicy",
    "SGLang",
    "Timeouts",
    "TensorUpdate",
    "TorchModule",
    "verify_checkpoint",
]
