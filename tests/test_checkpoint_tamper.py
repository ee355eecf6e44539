"""A receiver's checkpoint touched behind its back, by real receiver processes
(``python -m receiver.cli``), each version a process of its own (``--once``) unless said.

* A data file hard-linked elsewhere (an operator's ``cp -al`` backup) or replaced by a symlink
  to a copy (a file linked from a model store): the receiver patched it in place through the
  link, so the file elsewhere changed with every version. It copies such a file into one of
  its own before the first in-place write now.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest
import torch

from asyncsync import Publisher
from asyncsync.format.acks import read_acks
from asyncsync.format.store import read_manifest
from receiver.engines.checkpoint import verify_checkpoint
from tests.test_full_disk import _receive_once


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"l.{i}.w": torch.randn(16 << 10, generator=g) for i in range(4)}


def _step(sd: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """About 1 % of each tensor's elements changed."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, t in sd.items():
        t = t.clone()
        t[torch.rand(t.numel(), generator=g) < 0.01] += 1.0
        out[k] = t
    return out


def _holds(root: Path, ck: Path, version: int) -> bool:
    """The receiver acknowledged ``version`` and its checkpoint holds it bit for bit."""
    ack = read_acks(root).get("e")
    return (
        ack is not None
        and ack.version == version
        and verify_checkpoint(ck, read_manifest(root, version)) == []
    )


@pytest.mark.parametrize("link", ["hard", "symbolic"])
async def test_a_linked_data_file_is_copied_before_it_is_patched(tmp_path: Path, link: str) -> None:
    root, ck, other = tmp_path / "root", tmp_path / "ck", tmp_path / "backup.safetensors"
    sd = _model()
    async with Publisher(root, keyframe_interval=0) as pub:
        await pub.seed(sd)
        proc = _receive_once(root, ck)
        assert proc.returncode == 0, proc.stderr
        (data,) = ck.glob("model-*.safetensors")
        if link == "hard":
            os.link(data, other)
        else:
            shutil.copyfile(data, other)
            data.unlink()
            data.symlink_to(other)
        kept = other.read_bytes()
        await pub.publish(_step(sd, 1))
        proc = _receive_once(root, ck)
    assert proc.returncode == 0, proc.stderr
    assert other.read_bytes() == kept  # the backup (or the store's file) is v0 still
    assert "had other links" in proc.stderr
    st = os.lstat(data)
    assert stat.S_ISREG(st.st_mode) and st.st_nlink == 1
    assert stat.S_IMODE(st.st_mode) == 0o644
    assert _holds(root, ck, 1)
    assert not [p for p in ck.iterdir() if p.name.startswith(".tmp.")]
