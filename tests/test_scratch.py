"""The scratch pool hands a buffer out again only once nothing refers to it."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from asyncsync.codec import Patch, native, scratch
from asyncsync.codec.scratch import MIN_BYTES, ScratchPool
from asyncsync.errors import ConfigError
from asyncsync.memory import scratch_env

N = MIN_BYTES // 8  # int64 elements of the smallest pooled buffer


def _shares(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.shares_memory(a, b))


def test_a_buffer_is_reused_only_after_its_last_view_is_gone() -> None:
    pool = ScratchPool(64 << 20)
    a = pool.empty(N, np.int64)
    b = pool.empty(N, np.int64)
    assert not _shares(a, b)
    views = [a[: N // 2], torch.from_numpy(a), memoryview(a)]
    views.append(np.frombuffer(memoryview(a), np.uint8))
    del a
    while views:  # each view alone keeps the buffer out of the pool
        c = pool.empty(N, np.int64)
        assert not any(_shares(c, np.asarray(v)) for v in views)
        del c
        views.pop()
    reused = pool.reused
    d = pool.empty(4 * N, np.int16)  # as many bytes, another dtype
    assert pool.reused == reused + 1
    assert d.dtype == np.int16 and d.shape == (4 * N,)


def test_a_reused_buffer_holds_what_its_user_writes() -> None:
    pool = ScratchPool(64 << 20)
    first = pool.empty(N, np.int64)
    first[:] = 7
    del first
    second = pool.empty(N // 2, np.int32)
    second[:] = np.arange(N // 2, dtype=np.int32)
    third = pool.empty(N, np.int64)  # second is in use: a different buffer
    third[:] = -1
    assert np.array_equal(second, np.arange(N // 2, dtype=np.int32))


def test_the_pool_keeps_no_more_than_its_limit() -> None:
    pool = ScratchPool(3 * MIN_BYTES)
    held = [pool.empty(N, np.int64) for _ in range(5)]
    assert pool.held <= 3 * MIN_BYTES
    assert all(h.shape == (N,) for h in held)
    del held
    big = pool.empty(3 * N, np.int64)  # the free small ones make room for it
    assert pool.held <= 3 * MIN_BYTES and big.shape == (3 * N,)


def test_requests_a_little_larger_than_a_free_buffer_reuse_it() -> None:
    """A version's temporaries differ from the last one's by a few elements (the changed
    count of each tensor moves), so a pool that sized each new buffer exactly kept growing:
    a request a few bytes larger than every free buffer took a fresh one. Measured at 1 GiB,
    14 versions: a new ~16 MB buffer in every other version, 50-95 ms of first-touch page
    faults each, until the pool held 5x the bytes it needed. New buffers are rounded up to
    a size class (1/16 of a power of two), so a request within it reuses the free one."""
    pool = ScratchPool(64 << 20)
    n = (15 << 20) // 8 + 5  # int64 positions, just above 15 MiB
    for step in range(40):
        a = pool.empty(n + 3 * step, np.int64)  # each version a few positions more
        assert a.shape == (n + 3 * step,)
        del a
    assert pool.held == 31 << 19  # one buffer: 15 MiB + 40 bytes up to 15.5 MiB (a class:
    # 1/16 of the power of two below, 512 KiB here)
    assert pool.reused == 39
    big = pool.empty(n, np.int64)  # (in use: the next request cannot have it)
    small = pool.empty(N + 1, np.int64)  # 8 bytes above the smallest pooled size: 16 KiB up
    assert pool.held == (31 << 19) + MIN_BYTES + (MIN_BYTES // 16)
    assert small.shape == (N + 1,) and not _shares(big, small)


def test_a_request_rounded_up_past_the_limit_makes_room_before_it_spills() -> None:
    pool = ScratchPool(MIN_BYTES + (490 << 10))
    first = pool.empty(N, np.int64)  # MIN_BYTES, held; then free
    del first
    n = (480 << 10) + 8  # fits beside it as asked, not once rounded up (496 KiB)
    a = pool.empty(n, np.uint8)
    assert a.base is not None and pool.spilled == 0  # pooled: the free one was dropped
    assert pool.held == 496 << 10


def test_small_requests_and_a_zero_limit_are_plain_arrays() -> None:
    pool = ScratchPool(0)
    a = pool.empty(N, np.int64)
    assert a.base is None and pool.held == 0
    assert ScratchPool(64 << 20).empty(10, np.int64).base is None
    with pytest.raises(ValueError, match="limit"):
        ScratchPool(-1)


def test_threads_never_get_the_same_buffer_at_once() -> None:
    pool = ScratchPool(16 * MIN_BYTES)
    errors: list[str] = []

    def work(tag: int) -> None:
        for _ in range(200):
            a = pool.empty(N, np.int64)
            a[:] = tag
            if not bool((a == tag).all()):
                errors.append(f"thread {tag} saw another thread's writes")
            del a

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert pool.reused > 0


def test_the_process_pool_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCSYNC_SCRATCH_MB", "0")
    assert scratch_env() == 0
    monkeypatch.setenv("ASYNCSYNC_SCRATCH_MB", "8")
    assert scratch_env() == 8 << 20
    for bad in ("lots", "-1", "nan", "inf", "1e30"):
        monkeypatch.setenv("ASYNCSYNC_SCRATCH_MB", bad)
        with pytest.raises(ConfigError, match="ASYNCSYNC_SCRATCH_MB"):
            scratch_env()


@pytest.mark.parametrize("bad", [-1, -(64 << 20), 1.5, True, "8", None])
def test_a_bad_limit_is_a_config_error(bad: object) -> None:
    """A negative limit was a plain ValueError (and a str or None a TypeError): the pool is
    public through asyncsync.codec.scratch, and a bad argument is the project's ConfigError."""
    with pytest.raises(ConfigError, match="limit"):
        ScratchPool(bad)  # type: ignore[arg-type]


@pytest.mark.skipif(native.kernels is None, reason="the C kernels did not build")
@pytest.mark.parametrize("limit", [0, 64 << 20])
def test_the_diff_takes_its_outputs_from_the_pool_and_gives_them_back(
    monkeypatch: pytest.MonkeyPatch, limit: int
) -> None:
    pool = ScratchPool(limit)
    monkeypatch.setattr(scratch, "pool", pool)
    g = torch.Generator().manual_seed(3)
    old = torch.randint(-(2**15), 2**15, (1 << 22,), dtype=torch.int16, generator=g)
    new = old.clone()
    pos = torch.randperm(old.numel(), generator=g)[: old.numel() // 40].sort().values
    new[pos] += 1
    want = [pos.numpy(), new[pos].numpy(), (old[pos] ^ new[pos]).numpy()]
    for round_ in range(3):
        got = native.diff(old.numpy(), new.numpy(), True)
        assert [a.dtype for a in got] == [np.int64, np.int16, np.int16]
        assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True)), round_
        if limit == 0:  # plain arrays, trimmed to what they hold
            assert all(a.base is None and a.size == pos.numel() for a in got)
        del got
    assert pool.reused == (0 if limit == 0 else 6)  # three outputs, rounds two and three


def test_the_process_pool_is_sized_by_the_largest_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scratch, "_FIXED", False)
    monkeypatch.setattr(scratch, "pool", ScratchPool(scratch.FIT_FLOOR))
    scratch.fit(40 << 20)  # a small model: the floor
    assert scratch.pool.limit == scratch.FIT_FLOOR
    scratch.fit(512 << 20)
    assert scratch.pool.limit == 128 << 20  # a quarter
    scratch.fit(64 << 20)  # a smaller model later in the same process: kept
    assert scratch.pool.limit == 128 << 20
    scratch.fit(100 << 30)
    assert scratch.pool.limit == scratch.DEFAULT_LIMIT
    monkeypatch.setattr(scratch, "_FIXED", True)  # ASYNCSYNC_SCRATCH_MB set: as it says
    monkeypatch.setattr(scratch, "pool", ScratchPool(5 << 20))
    scratch.fit(1 << 30)
    assert scratch.pool.limit == 5 << 20


def test_the_journal_pads_with_zeros_whatever_the_pool_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its old values come from the pool: the bytes between two tensors' values are zeros, not
    what an earlier user of the buffer left there."""
    from receiver.engines.checkpoint import journal
    from receiver.engines.st_layout import TensorLocation

    pool = ScratchPool(64 << 20)
    monkeypatch.setattr(scratch, "pool", pool)
    dirty = pool.empty(1 << 20, np.uint8)
    dirty[:] = 0xA5
    del dirty  # free again, full of 0xA5
    work = []
    sizes = []
    for i, numel in enumerate((300_001, 150_003)):  # odd counts: padding after each
        flat = torch.arange(numel, dtype=torch.int16)
        pos = torch.arange(0, numel, 2, dtype=torch.int64)
        patch = Patch("set", pos, torch.zeros(pos.numel(), dtype=torch.int16))
        loc = TensorLocation(f"t{i}", "f", torch.int16, (numel,), 0, 2 * numel)
        work.append((f"t{i}", loc, flat, patch))
        sizes.append(2 * pos.numel())
    values = bytes(journal.encode_parts(work, 3)[2])
    assert pool.reused == 1  # the record's values took the dirty buffer
    a, b = sizes
    a8 = journal.align8(a)
    assert len(values) == a8 + journal.align8(b) and a % 8 and b % 8
    assert values[a:a8] == bytes(a8 - a)
    assert values[a8 + b :] == bytes(len(values) - a8 - b)
