"""Patches made up by hand (not decoded from a shard) against both checkpoint modes.

Found by attacking the engines (helper-18, this session): a ``Patch`` is public, and its
``positions_xef`` blob was trusted as the record of its positions by the undo journal, while the
old values were saved at ``positions``. A blob of other positions (or positions altered after
decoding) made the abort write old values at the wrong places: the engine then said v0 and
held other bytes. The blob is honoured now only for the positions it was decoded with
(:meth:`asyncsync.codec.Patch.decoded_xef`). The invariant checked here, for every kind of
made-up patch, with the progressive and the durable journal, in the process and after a
SIGKILL: after the apply and its commit or abort the engine holds the version it says, bit for
bit, and the next good delta applies. Errors are typed. The C kernels' own defences (positions
that alias the tensor, offsets that overflow) are at the end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from asyncsync.codec import ef, native
from asyncsync.errors import AsyncSyncError
from receiver.engines import TensorUpdate
from receiver.engines.checkpoint import LocalCheckpoint
from tests.test_engines import REPO, apply_version, assert_same, build_manifest, xef_batches

N = 2_000_000  # bf16: sixteen 256 KiB journal chunks
FAULTS = [
    "other-positions",  # valid and increasing, but not the blob's (nor the values')
    "other-blob",  # a blob of another delta with as many positions
    "undecodable-blob",  # positions and values right, the blob junk
    "repeated",
    "negative",
    "outside",
    "empty",  # no position at all, for a tensor the manifest says changed
    "noncontiguous-repeated",  # values a strided view: the journal's fallback path
    "noncontiguous-outside",
]


def _states(seed: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    sd0 = {"w": torch.randn(N, generator=g).to(torch.bfloat16)}
    sd1 = {"w": sd0["w"].clone()}
    idx = torch.randint(0, N, (N // 10,), generator=g)
    sd1["w"][idx] = (sd1["w"][idx].float() + 1).to(torch.bfloat16)
    return sd0, sd1


def _made_up(fault: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], Any, Any]:
    """(v0, v1, v1's manifest, the made-up update for v1)."""
    sd0, sd1 = _states(11)
    m1 = build_manifest(sd1, 1, base=sd0)
    (u,) = xef_batches(m1, sd0, sd1, n=1)[0]
    p = u.patch
    pos, vals, blob = p.positions.clone(), p.values, p.positions_xef
    j = int(torch.searchsorted(pos, 3 * N // 4))  # the fourth chunk
    if fault == "other-positions":
        pos[0] += 1 if int(pos[1]) > int(pos[0]) + 1 else -1
    elif fault == "other-blob":
        other = pos.numpy().copy()  # as many positions, valid, one of them elsewhere
        other[0] += 1 if other[1] > other[0] + 1 else -1
        blob = ef.encode(other, N)[0]
    elif fault == "undecodable-blob":
        blob = b"\x01\x02\x03"
    elif fault == "empty":
        pos, vals, blob = pos[:0], vals[:0], None
    elif fault.endswith("repeated"):
        pos[j] = pos[j - 1]
    elif fault == "negative":
        pos[j] = -7
    else:
        pos[j] = 10**12
    if fault.startswith("noncontiguous"):
        vals = torch.stack([vals, vals], 1)[:, 0]
        assert not vals.is_contiguous()
    made = replace(p, positions=pos, values=vals, positions_xef=blob)
    return sd0, sd1, m1, TensorUpdate(u.entry, patch=made)


def _holds_what_it_says(ck: LocalCheckpoint, sds: list[dict[str, torch.Tensor]]) -> None:
    v = ck.state.version
    assert v in (0, 1), v
    assert_same(ck.load_state_dict(), sds[v])


@pytest.mark.parametrize("durable", [False, True], ids=["progressive", "durable"])
@pytest.mark.parametrize("fault", FAULTS)
async def test_a_made_up_patch_never_leaves_other_bytes(
    tmp_path: Path, fault: str, durable: bool
) -> None:
    sd0, sd1, m1, made = _made_up(fault)
    ck = LocalCheckpoint(tmp_path / "c", sync_before_ack=durable)
    await ck.open()
    m0 = build_manifest(sd0, 0)
    from tests.test_engines import full_batches

    await apply_version(ck, m0, full_batches(m0, sd0), "full")
    await ck.begin(m1, "delta")
    try:
        await ck.apply([made])
        await ck.commit()
    except AsyncSyncError:  # typed: ApplyFailed, ChecksumMismatch (never a bare IndexError)
        await ck.abort()
    _holds_what_it_says(ck, [sd0, sd1])
    if ck.state.version == 0:
        await apply_version(ck, m1, xef_batches(m1, sd0, sd1), "delta")
        assert_same(ck.load_state_dict(), sd1)
    await ck.close()
    ck = LocalCheckpoint(tmp_path / "c")
    assert (await ck.open()).version == 1
    assert_same(ck.load_state_dict(), sd1)
    await ck.close()


_CHILD = r"""
import asyncio, os, signal, sys, torch
from receiver.engines.checkpoint import LocalCheckpoint
data = torch.load(sys.argv[2], weights_only=False)
async def main():
    e = LocalCheckpoint(sys.argv[1], sync_before_ack=sys.argv[3] == "durable")
    await e.open()
    await e.begin(data["m"], "delta")
    try:
        await e.apply(data["ups"])
        await e.commit()
    except Exception:
        pass
    os.kill(os.getpid(), signal.SIGKILL)  # before any abort: open() must undo
asyncio.run(main())
"""


@pytest.mark.parametrize("mode", ["progressive", "durable"])
@pytest.mark.parametrize("fault", ["other-positions", "repeated", "undecodable-blob"])
async def test_a_made_up_patch_then_sigkill_reopens_whole(
    tmp_path: Path, fault: str, mode: str
) -> None:
    from tests.test_engines import init_checkpoint

    sd0, sd1, m1, made = _made_up(fault)
    ck = await init_checkpoint(tmp_path / "c", sd0)
    await ck.close()
    torch.save({"m": m1, "ups": [made]}, tmp_path / "p.pt")
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path / "c"), str(tmp_path / "p.pt"), mode],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    ck = LocalCheckpoint(tmp_path / "c")
    st = await ck.open()
    if st.version is not None:  # None: re-initialised from a keyframe, and said so
        _holds_what_it_says(ck, [sd0, sd1])
    await ck.close()


# ------------------------------------------------------------------------- the C kernels

K: Any = native.kernels
needs_kernel = pytest.mark.skipif(K is None, reason="the C kernels are not built")
_ALIASED = r"""
import numpy as np, os, sys
from asyncsync.codec import ef, native
K = native.kernels
f = np.zeros(16, np.int64); f[0] = 1; f[1] = 2
pos = f[0:2]  # the positions are the tensor's own first two elements
v = np.array([1 << 40, 5], np.int64)
fd = os.open(sys.argv[2], os.O_RDWR | os.O_CREAT, 0o600)
calls = {
    "journal_patch_hash":
        lambda: K.journal_patch_hash(f, 8, pos, v, False, 0, 16, None, fd, 64, 8, 0),
    "patch_hash": lambda: K.patch_hash(f, 8, pos, v, False, 0, 16, None),
    "set_patch": lambda: K.set_patch(f, 8, pos, v, None),
    "gather": lambda: K.gather(f, 8, pos, f[0:2]),
}
try:
    calls[sys.argv[1]]()
    print("ok", f[:3].tolist())
except ValueError as e:
    print("ValueError", e)
"""


@needs_kernel
@pytest.mark.parametrize("kernel", ["journal_patch_hash", "patch_hash", "set_patch", "gather"])
def test_positions_that_alias_the_tensor_never_write_outside_it(
    tmp_path: Path, kernel: str
) -> None:
    """The first write changes the second position to 2**40: each position is checked again
    as it is used, so the kernel stops with a ValueError instead of writing 8 TiB away (it
    segfaulted). The same holds for positions another thread writes while the GIL is out."""
    proc = subprocess.run(
        [sys.executable, "-c", _ALIASED, kernel, str(tmp_path / "j")],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, f"rc {proc.returncode}: {proc.stderr[-500:]}"
    if kernel != "gather":
        assert proc.stdout.startswith("ValueError") and "changed while the patch ran" in proc.stdout


@needs_kernel
@pytest.mark.parametrize(
    ("done", "values_at", "progress_at"),
    [(2**63 - 1, 0, 8), (2**61, 0, 8), (0, 2**63 - 8, 8), (0, 0, 2**63 - 4)],
)
def test_journal_offsets_that_would_overflow_are_refused(
    tmp_path: Path, done: int, values_at: int, progress_at: int
) -> None:
    flat = np.zeros(64, np.int64)
    pos = np.array([1, 5], np.int64)
    fd = os.open(tmp_path / "j", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with pytest.raises(ValueError, match="too large"):
            K.journal_patch_hash(
                flat, 8, pos, np.ones(2, np.int64), True, 0, 64, None, fd, values_at,
                progress_at, done,
            )  # fmt: skip
    finally:
        os.close(fd)
    assert not flat.any() and (tmp_path / "j").stat().st_size == 0


def test_records_with_other_digits_in_their_names_do_not_break_the_order(tmp_path: Path) -> None:
    from receiver.engines.checkpoint.inplace import _record_order

    names = ["undo-000002.safetensors", "undo-².safetensors", "undo-x.progressive",
             "undo-1000000.progressive", "undo-999999.safetensors"]  # fmt: skip
    got = [p.name for p in sorted((tmp_path / n for n in names), key=_record_order)]
    assert got[-3:] == ["undo-000002.safetensors", "undo-999999.safetensors",
                        "undo-1000000.progressive"]  # fmt: skip
