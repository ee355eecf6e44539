"""receiver.state: the persisted engine state, its lock, and the two transition rules."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncsync.codec import Patch
from asyncsync.errors import ApplyFailed, EngineStateError, LockHeld, OutOfOrder
from receiver.rules import check_base, check_patch
from receiver.state import PersistedState, StateStore
from tests.test_engines import build_manifest

REPO = Path(__file__).resolve().parents[1]


def test_roundtrip_and_transitions(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "st")
    assert store.open() is None and store.locked
    ps = PersistedState(
        version=3,
        run_id="r",
        fingerprint="ab" * 8,
        checksum_algorithm="xxh3-128",
        checksums={"a.b": "00ff" * 4},
    )
    saved = store.save(ps.begin(4, "delta"))
    assert saved.updated_at > 0 and saved.applying
    loaded = store.load()
    assert loaded == saved and (loaded.target_version, loaded.mode) == (4, "delta")
    assert loaded.clean() == PersistedState(
        **{**saved.__dict__, "status": "clean", "target_version": None, "mode": None}
    )
    d = json.loads(store.path.read_text())
    assert d["format"] == "asyncsync-engine-state" and d["format_version"] == 1
    assert set(d) >= {
        "version",
        "run_id",
        "fingerprint",
        "status",
        "target_version",
        "mode",
        "checksums",
        "checksum_algorithm",
        "updated_at",
    }
    store.close()
    assert not store.locked
    with pytest.raises(EngineStateError, match="without holding the lock"):
        store.save(ps)


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "[]",
        '{"format": "other"}',
        '{"format": "asyncsync-engine-state", "format_version": 99}',
        '{"format": "asyncsync-engine-state", "format_version": 1, "status": "weird"}',
        '{"format": "asyncsync-engine-state", "format_version": 1, "status": "clean", '
        '"version": -1}',
        '{"format": "asyncsync-engine-state", "format_version": 1, "status": "applying"}',
        '{"format": "asyncsync-engine-state", "format_version": 1, "status": "clean", '
        '"checksums": {"a": 1}}',
    ],
)
def test_malformed_state_is_refused_with_remedy(tmp_path: Path, text: str) -> None:
    store = StateStore(tmp_path)
    store.path.parent.mkdir(parents=True, exist_ok=True)
    store.path.write_text(text)
    with pytest.raises(EngineStateError, match="keyframe"):
        store.open()
    assert not store.locked  # a failed open releases the lock


def test_lock_names_holder_across_processes(tmp_path: Path) -> None:
    code = (
        "import sys; from receiver.state import StateStore; s = StateStore(sys.argv[1]); "
        "s.open(); print('ready', flush=True); sys.stdin.read()"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        with pytest.raises(LockHeld, match=str(child.pid)):
            StateStore(tmp_path).open()
    finally:
        child.communicate("")
    store = StateStore(tmp_path)  # released when the holder exits
    assert store.open() is None
    store.close()


def test_a_state_directory_wiped_under_its_receiver_never_gets_two_writers(tmp_path: Path) -> None:
    """An ``flock`` holds the inode it opened: a state directory removed (or its lock file
    replaced) under an open receiver let a second receiver lock a new file at the same path,
    and both saved the engine's state beside each other. The lock file names its holder with
    a token of its own, read back before each save (as the publisher's is before a manifest)."""
    ps = PersistedState(version=3, run_id="r", fingerprint="ab" * 8,
                        checksum_algorithm="xxh3-128", checksums={})  # fmt: skip
    first = StateStore(tmp_path / "st")
    first.open()
    first.save(ps)
    shutil.rmtree(tmp_path / "st")
    second = StateStore(tmp_path / "st")
    try:
        assert second.open() is None
        with pytest.raises(LockHeld, match="no longer the lock file this receiver holds"):
            first.save(ps.begin(4, "delta"))
        assert second.save(ps).version == 3 and not second.load().applying  # type: ignore[union-attr]
    finally:
        first.close()
        second.close()


def test_leftover_temp_files_are_removed(tmp_path: Path) -> None:
    (tmp_path / ".tmp.state.json.abc").write_text("x")
    store = StateStore(tmp_path)
    store.open()
    assert not (tmp_path / ".tmp.state.json.abc").exists()
    (store.journal_dir / "sub").mkdir(parents=True)
    (store.journal_dir / "undo-000000.safetensors").write_bytes(b"x")
    store.clear_dir(store.journal_dir)
    assert list(store.journal_dir.iterdir()) == []
    store.close()


def test_check_base() -> None:
    sd = {"w": torch.zeros(3)}
    m = build_manifest(sd, 5, base=sd)
    check_base(4, "run-a", m, "e")
    check_base(4, None, m, "e")
    for version, run in [(None, None), (3, "run-a"), (5, "run-a"), (4, "run-b")]:
        with pytest.raises(OutOfOrder):
            check_base(version, run, m, "e")
    with pytest.raises(OutOfOrder):
        check_base(4, "run-a", build_manifest(sd, 5), "e")  # a keyframe is not a delta


def test_check_patch() -> None:
    flat = torch.zeros(10, dtype=torch.int16)
    ok = check_patch(
        Patch("set", torch.tensor([0, 9]), torch.tensor([1, 2], dtype=torch.int16)), flat, "w"
    )
    assert ok.positions is not None and ok.positions.tolist() == [0, 9]
    check_patch(Patch("xor", None, torch.ones(10, dtype=torch.int16)), flat, "w")
    bad = [
        Patch("set", torch.tensor([0]), torch.tensor([1], dtype=torch.int32)),  # wrong width
        Patch("set", torch.tensor([10]), torch.tensor([1], dtype=torch.int16)),  # out of range
        Patch("set", torch.tensor([-1]), torch.tensor([1], dtype=torch.int16)),  # negative
        Patch("set", torch.tensor([1, 2]), torch.tensor([1], dtype=torch.int16)),  # count
        Patch("set", torch.tensor([1], dtype=torch.int32), torch.tensor([1], dtype=torch.int16)),
        Patch("xor", None, torch.ones(9, dtype=torch.int16)),  # dense size
    ]
    for p in bad:
        with pytest.raises(ApplyFailed, match="'w'"):
            check_patch(p, flat, "w")


@pytest.mark.parametrize(
    "stat_error", [FileNotFoundError(2, "No such file or directory"), PermissionError(13, "no")]
)
def test_a_lock_refused_whose_owner_cannot_be_read_is_still_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stat_error: OSError
) -> None:
    """A state directory this uid may not lock is named with its owner's uid (a ``stat``); that
    ``stat`` raised its own OSError out of the error path when it failed too (the directory
    removed meanwhile, or no search right on its parent), a traceback without the advice. Both
    faults are made up here (root passes every mode bit; a removal between the two is a race)."""
    from asyncsync import fsio

    store = StateStore(tmp_path / ".asyncsync")

    def refused(self: fsio.FileLock) -> bool:
        raise PermissionError(13, "Permission denied", "lock")

    real_stat = Path.stat

    def stat(self: Path, **kwargs: object) -> os.stat_result:
        if self == store.directory:
            raise stat_error
        return real_stat(self, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(fsio.FileLock, "acquire", refused)
    monkeypatch.setattr(Path, "stat", stat)
    with pytest.raises(EngineStateError) as err:
        store.open()
    msg = str(err.value)
    assert f"cannot write {store.directory}/lock" in msg and "Permission denied" in msg
    assert f"uid {os.geteuid()}" in msg and "chown -R" in msg
    assert stat_error.strerror in msg  # why the owner is not named
