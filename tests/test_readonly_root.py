"""`status` and `gc --dry-run` on a root this host cannot write (a read-only mount, an operator
without write access): they read the file server's clock from a probe file made in the root,
which such a root refuses. They run on this host's clock instead and say so (asyncsync.ops.cli),
writing nothing. Mounts: tests/mounts.py."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from asyncsync.format.acks import AckRecord
from asyncsync.format.store import read_root_info
from asyncsync.ops.cli import main as cli_main
from tests.mounts import bindfs_mount
from tests.test_clock_and_log import _chain


def _tree(root: Path) -> dict[str, int]:
    """Every entry below ``root`` with its mtime (ns): what a write would change."""
    out = {".": os.lstat(root).st_mtime_ns}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(d) / name
            out[str(p.relative_to(root))] = os.lstat(p).st_mtime_ns
    return out


async def test_status_and_gc_dry_run_on_a_read_only_mount(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "src"
    await _chain(src, 9)  # keyframes 0, 4, 8
    rec = AckRecord("e1", 9, "ab" * 16, read_root_info(src).run_id, time.time(), "h")  # type: ignore[union-attr]
    (src / "acks").mkdir()
    (src / "acks" / "e1.json").write_text(rec.to_json())
    before = _tree(src)
    with bindfs_mount(src, tmp_path / "ro", read_only=True) as ro:
        with pytest.raises(OSError):  # the mount refuses every write
            (ro / "probe").write_bytes(b"")
        assert cli_main(["status", str(ro), "--json"]) == 0
        captured = capsys.readouterr()
        doc = json.loads(captured.out)
        assert [r["engine_id"] for r in doc["engines"]] == ["e1"]
        assert doc["clock"] == "this host", doc
        assert "read-only" in captured.err and "this host's clock" in captured.err, captured.err
        assert cli_main(["status", str(ro)]) == 0
        captured = capsys.readouterr()
        assert "this host's clock" in captured.out + captured.err, captured
        assert cli_main(["gc", str(ro), "--dry-run", "--keep-versions", "1"]) == 0
        captured = capsys.readouterr()
        assert captured.out.startswith("would delete 8 versions"), captured.out
        assert "this host's clock" in captured.err, captured.err
    assert _tree(src) == before  # nothing written, nothing removed
