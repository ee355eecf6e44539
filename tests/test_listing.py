"""How a receiver finds the newest committed version on each poll (store.newest_committed,
plan.latest_version): the listing's answer, from a look at the newest entries only."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from asyncsync.format import store
from asyncsync.format.names import MANIFEST_NAME, version_dir_name
from asyncsync.format.store import list_versions, newest_committed
from receiver.plan import latest_version


def _committed(root: Path, v: int) -> None:
    d = root / version_dir_name(v)
    d.mkdir()
    (d / MANIFEST_NAME).write_text("{}")


def _layout(root: Path, kind: str) -> None:
    """A root in one of the shapes a listing meets."""
    if kind == "none":
        return
    if kind == "uncommitted only":
        (root / version_dir_name(0)).mkdir()
        (root / version_dir_name(1)).mkdir()
    elif kind == "a publish under way":
        for v in range(5):
            _committed(root, v)
        (root / version_dir_name(5)).mkdir()
        (root / version_dir_name(7)).mkdir()  # (a failed publish left it)
    elif kind == "a symlink on top":  # a bad version: committed, never followed
        for v in range(3):
            _committed(root, v)
        os.symlink("/nonexistent", root / version_dir_name(9))
    elif kind == "a file and a FIFO on top":  # neither is a committed version
        for v in range(3):
            _committed(root, v)
        (root / version_dir_name(8)).write_text("x")
        os.mkfifo(root / version_dir_name(9))
    elif kind == "a manifest that is a directory":  # an entry of any type commits it
        _committed(root, 0)
        (root / version_dir_name(4)).mkdir()
        (root / version_dir_name(4) / MANIFEST_NAME).mkdir()
    elif kind == "names a version does not have":
        for v in range(3):
            _committed(root, v)
        for name in ("v1", "v0000000000099", "v00000000009x", "w000000000050", "v000000000050.tmp",
                     "v000000000050\n", "v" + "\u0660" * 10 + "\u0665\u0660"):  # fmt: skip
            (root / name).mkdir()
            (root / name / MANIFEST_NAME).write_text("{}")
    else:
        raise AssertionError(kind)


KINDS = [
    "none",
    "uncommitted only",
    "a publish under way",
    "a symlink on top",
    "a file and a FIFO on top",
    "a manifest that is a directory",
    "names a version does not have",
]


@pytest.mark.parametrize("kind", KINDS)
def test_newest_committed_is_the_newest_the_listing_names(tmp_path: Path, kind: str) -> None:
    _layout(tmp_path, kind)
    listed = list_versions(tmp_path)
    assert newest_committed(tmp_path) == (listed[-1] if listed else None)
    if kind == "names a version does not have":  # (a final newline, Arabic-Indic digits)
        assert listed == [0, 1, 2]


def test_no_root_has_no_version(tmp_path: Path) -> None:
    assert newest_committed(tmp_path / "missing") is None
    (tmp_path / "file").write_text("x")
    assert newest_committed(tmp_path / "file") is None


def test_a_poll_looks_at_the_newest_entries_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A root without retention keeps every version: a poll that looked at each (two lstats
    per version, the manifest's through the no-symlink walk) cost ~50 ms of CPU at 1,000 of
    them. Now the newest entries only, down to the first committed one."""
    for v in range(300):
        _committed(tmp_path, v)
    (tmp_path / version_dir_name(300)).mkdir()  # being published
    looked: list[str] = []
    real = store._committed

    def counted(root: Path, name: str, st: os.stat_result) -> bool:
        looked.append(name)
        return real(root, name, st)

    monkeypatch.setattr(store, "_committed", counted)
    newest = {version_dir_name(300), version_dir_name(299)}
    for held in (290, None):
        looked.clear()
        assert latest_version(tmp_path, held) == 299
        # the scan's two, then the exact-path probe of v300 past the newest committed
        assert len(looked) == 3 and set(looked) == newest
