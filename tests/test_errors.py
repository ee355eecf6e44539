"""The error tree (asyncsync/errors.py): every class survives pickling with its fields, also
across a real process boundary (a worker process raising, the parent catching the class)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import inspect
import multiprocessing
import pickle
from typing import Any

import pytest

from asyncsync import errors
from asyncsync.errors import AckTimeout, AsyncSyncError, ChecksumMismatch, PublishError

# the fields each class takes as keywords, with a value that is not their default
FIELDS: dict[type[AsyncSyncError], dict[str, Any]] = {
    ChecksumMismatch: {"path": "/root/v1/s.safetensors", "tensor": "w"},
    PublishError: {"ranks": (1, 3)},
    errors.OutcomeUnknown: {"ranks": (0,)},
    errors.CoordinationError: {"ranks": (2,)},
    errors.StepBehind: {"ranks": (0,), "step": 3, "group_step": 4},
    AckTimeout: {"version": 7, "behind": {"e0": 5, "e1": None}},
}

CLASSES = sorted(
    (
        c
        for _, c in inspect.getmembers(errors, inspect.isclass)
        if issubclass(c, BaseException) and c.__module__ == errors.__name__
    ),
    key=lambda c: c.__name__,
)


def _make(cls: type[AsyncSyncError]) -> AsyncSyncError:
    return cls(f"{cls.__name__}: what went wrong, and what to do next", **FIELDS.get(cls, {}))


def _same(a: BaseException, b: BaseException) -> None:
    assert type(a) is type(b)
    assert a.args == b.args and str(a) == str(b)
    assert vars(a) == vars(b)


def test_every_class_is_of_the_tree_and_in_all() -> None:
    assert len(CLASSES) >= 17
    for cls in CLASSES:
        assert issubclass(cls, AsyncSyncError), cls
        assert cls.__name__ in errors.__all__, cls
    # every keyword-only field of an __init__ is exercised above
    for cls in CLASSES:
        params = inspect.signature(cls.__init__).parameters.values()
        kw = {p.name for p in params if p.kind is p.KEYWORD_ONLY}
        assert kw <= set(FIELDS.get(cls, {})), (cls, kw)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_error_survives_pickling(cls: type[AsyncSyncError]) -> None:
    exc = _make(cls)
    exc.add_note("a note travels too")
    for proto in range(2, pickle.HIGHEST_PROTOCOL + 1):
        _same(exc, pickle.loads(pickle.dumps(exc, protocol=proto)))
    _same(exc, copy.copy(exc))
    _same(exc, copy.deepcopy(exc))


def test_ack_timeout_keeps_its_fields_through_cloudpickle() -> None:
    """Ray serialises an actor's error with cloudpickle: what issue 23 saw arrive as Ray's
    UnserializableException."""
    cloudpickle = pytest.importorskip("ray.cloudpickle")
    exc = _make(AckTimeout)
    got = cloudpickle.loads(cloudpickle.dumps(exc))
    _same(exc, got)
    assert isinstance(got, TimeoutError) and got.version == 7 and got.behind["e1"] is None


def _raise(name: str) -> None:
    raise _make(getattr(errors, name))


def test_errors_cross_a_process_boundary() -> None:
    """Raised in a worker process, caught in this one as the same class with its fields."""
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        for cls in CLASSES:
            with pytest.raises(cls) as ei:
                pool.submit(_raise, cls.__name__).result(timeout=120)
            _same(_make(cls), ei.value)


# a duration no wait can take: each was an OverflowError (or TypeError, or a silent wrong
# wait) from deep inside the wait, not a ConfigError at the call (helper-39, task 1)
BAD_SECONDS = [10**400, -(10**5000), 1e300, float("nan"), -1.0, True, "5"]


def _duration_calls(tmp_path: Any) -> dict[str, Any]:
    from asyncsync.publish.rendezvous import FileRendezvous
    from asyncsync.publish.retention import RetentionPolicy
    from asyncsync.training.config import SyncConfig
    from asyncsync.training.session import SyncSession
    from asyncsync.training.staleness import AckPolicy
    from receiver.agent import ReceiverAgent
    from receiver.engines.checkpoint import LocalCheckpoint
    from receiver.engines.http_engine import HttpClient, RetryPolicy, Timeouts

    def agent(**kw: Any) -> Any:
        return ReceiverAgent(tmp_path / "root", LocalCheckpoint(tmp_path / "c"), "e0", **kw)

    return {
        "AckPolicy.timeout": lambda v: AckPolicy(quorum=1, timeout=v),
        "SyncConfig.ack_timeout": lambda v: SyncConfig(root=tmp_path, ack_timeout=v),
        "FileRendezvous.timeout": lambda v: FileRendezvous(tmp_path, 0, 2, timeout=v),
        "FileRendezvous.max_wait": lambda v: FileRendezvous(tmp_path, 0, 2, max_wait=v),
        **{
            f"ReceiverAgent.{name}": (lambda v, name=name: agent(**{name: v}))
            for name in ("poll_interval", "verify_deadline", "lease_ttl", "stream_timeout")
        },
        "ReceiverAgent.lease_settle": lambda v: agent(lease_settle=v, lease_ttl=10**9),
        "RetentionPolicy.ack_ttl": lambda v: RetentionPolicy(ack_ttl=v),
        "Timeouts.update": lambda v: Timeouts(update=v),
        "HttpClient.connect_timeout": lambda v: HttpClient("http://127.0.0.1:1", connect_timeout=v),
        "RetryPolicy.maximum": lambda v: RetryPolicy(maximum=v),
        "SyncSession.cancel_grace": lambda v: SyncSession(
            SyncConfig(root=tmp_path / "s"), cancel_grace=v
        ),
    }


@pytest.mark.parametrize("value", BAD_SECONDS, ids=errors.shown)
def test_a_duration_no_wait_can_take_is_a_config_error_at_the_call(
    tmp_path: Any, value: Any
) -> None:
    calls = _duration_calls(tmp_path)
    for what, call in calls.items():
        if what.startswith("SyncConfig") and value == "5":
            continue  # the config's fields take text ("5" is 5 seconds)
        with pytest.raises(errors.ConfigError) as info:
            call(value)
        assert "OverflowError" not in repr(info.value.__context__), what
        # the message names the argument and prints (repr(10**5000) is a ValueError)
        assert "timeout" in str(info.value) or what.split(".")[1] in str(info.value), what


async def test_wait_acked_refuses_a_timeout_no_wait_can_take(tmp_path: Any) -> None:
    """``wait_acked(timeout=10**400)`` read the acks, then overflowed computing its deadline.
    ``inf`` and None wait without a limit; a number of seconds up to ~292 years is taken."""
    from asyncsync import Publisher

    async with Publisher(tmp_path / "root") as pub:
        for bad in BAD_SECONDS:
            with pytest.raises(errors.ConfigError, match="wait_acked: timeout"):
                await pub.wait_acked(0, quorum=1, timeout=bad)
        for slow in (float("inf"), None, errors.MAX_SECONDS):
            with pytest.raises(TimeoutError):  # waits (nothing was published), no error
                async with asyncio.timeout(0.1):
                    await pub.wait_acked(0, quorum=1, timeout=slow)


@pytest.mark.parametrize("text", ["1e300", "1e400", "nan", "-1", "inf", "soon"])
def test_every_cli_duration_refuses_what_no_wait_can_take(text: str) -> None:
    """``asyncsync demo --ack-timeout`` and ``asyncsync bench --timeout`` took any float (nan,
    -1, inf); the shared argparse type took 1e300 (an OverflowError in the first wait)."""
    import argparse

    from asyncsync.console.args import non_negative_float, positive_float
    from asyncsync.ops.cli import build_parser
    from asyncsync.ops.demo import build_parser as demo_parser

    for parse in (positive_float, non_negative_float):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)
    for parser, argv in (
        (demo_parser(), ["--ack-timeout", text]),
        (build_parser(), ["bench", "--timeout", text]),
    ):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
