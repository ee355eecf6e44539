"""The error tree (asyncsync/errors.py): every class survives pickling with its fields, also
across a real process boundary (a worker process raising, the parent catching the class)."""

from __future__ import annotations

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
