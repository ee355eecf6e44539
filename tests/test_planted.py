"""A hostile shared directory (issue 22): a symlink and a FIFO at every name the protocol uses.

Every host that runs a receiver can write the root, so any name in it may be a symlink leading
out of it or a FIFO. For each name of the protocol (root files, version directories, shards,
manifests, acks, leases, the log, ``.rendezvous``) and each kind, a copy of a published root
gets the planted entry, then each component runs as its own process with a deadline: ``asyncsync
status``, ``asyncsync-receiver --once``, rank 0 of a two-rank publisher (``.rendezvous/``), a
restarted publisher with retention, ``asyncsync gc``. The properties:

* nothing outside the root changes (the symlinks lead to copies of what was there, with mode
  0600: a component that followed one would write, truncate, chmod or delete them);
* every process ends by itself within its deadline (a FIFO opened for reading without
  O_NONBLOCK blocks forever; the test kills what hangs and fails);
* a component that fails says why in one line (AsyncSyncError or OSError, never a traceback).

The processes fork from a forkserver that imported torch and asyncsync once
(tests/planted_child.py), so each costs tens of milliseconds, not an interpreter start.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import multiprocessing
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any

import pytest

from asyncsync import Publisher
from asyncsync.format.lease import EngineLease
from receiver import ReceiverAgent
from receiver.engines.checkpoint import LocalCheckpoint
from tests import planted_child

DEADLINE = 60.0  # seconds per process; what the components do here takes well under 2 s

# Every name of the protocol (FORMAT.md section 1) in the template root below: v0 keyframe,
# v1 and v2 deltas, v3 keyframe (delta and full shards); the receiver's checkpoint holds v1;
# v4 is the next version a publisher writes.
NAMES = [
    "asyncsync.json",
    ".publisher.lock",
    "log.jsonl",
    "v000000000000",  # an old version: retention deletes it
    "v000000000002",  # the receiver's next version
    "v000000000004",  # the next version a publisher writes
    "v000000000002/delta-00000.safetensors",
    "v000000000003/full-00000.safetensors",
    "v000000000002/manifest.json",
    "v000000000003/manifest.json",
    "acks",
    "acks/e1.json",
    "leases",
    "leases/e1.json",  # the receiver's own lease
    "leases/e2.json",  # another engine's lease (status and retention read it)
    ".rendezvous",
    ".rendezvous/group-v2.json",
    ".rendezvous/plan-r0001.json",
]


async def _template(root: Path, ckpt: Path) -> None:
    st = planted_child.state
    async with Publisher(root, bucket_bytes=1 << 20, keyframe_interval=0) as pub:
        await pub.seed(st(0))
        await pub.publish(st(1))
        agent = ReceiverAgent(root, LocalCheckpoint(ckpt), "e1", use_inotify=False, prefetch=False)
        async with agent:
            assert await agent.sync_once() == 1
        await pub.publish(st(2))
        await pub.publish(st(3), keyframe=True)
    EngineLease(root, "e2", ttl=3600).acquire()  # left held: leases/e2.json stays
    rdv = root / ".rendezvous"
    rdv.mkdir()
    (rdv / "group-v2.json").write_text(json.dumps({"group": "0" * 16, "host": "h", "pid": 1}))
    (rdv / "plan-r0001.json").write_text(json.dumps({"group": "0" * 16, "key": "x"}))


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("planted-template")
    asyncio.run(_template(base / "root", base / "ckpt"))
    absent = ("v000000000004", "leases/e1.json")  # the next version; a released lease
    for name in NAMES:
        assert (base / "root" / name).exists() == (name not in absent), name
    return base


@pytest.fixture(scope="module")
def forkserver() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    # pytest too: a forkserver child re-runs the parent's main script (pytest's) before the
    # target; preloaded, that costs nothing instead of ~1 s per process
    ctx.set_forkserver_preload(["tests.planted_child", "pytest"])
    return ctx


def snapshot(top: Path) -> dict[str, tuple[Any, ...]]:
    """Every entry under ``top`` (never following a link): type, mode, size, mtime, content."""
    out: dict[str, tuple[Any, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            digest = None
            if stat.S_ISREG(st.st_mode):
                digest = hashlib.sha256(Path(p).read_bytes()).hexdigest()
            out[os.path.relpath(p, top)] = (st.st_mode, st.st_size, st.st_mtime_ns, digest)
    st = os.lstat(top)
    out["."] = (st.st_mode, st.st_mtime_ns)
    return out


def plant(case: Path, name: str, kind: str) -> Path:
    """Replace ``root/name`` with a symlink to a 0600 copy of it outside the root (a fresh file
    or directory when the name does not exist yet), or with a FIFO. Returns the outside dir."""
    root, outside = case / "root", case / "outside"
    outside.mkdir()
    path = root / name
    if kind == "symlink":
        target = outside / name.replace("/", "_")
        if path.is_dir():
            shutil.copytree(path, target)
            (target / "precious.txt").write_text("not asyncsync's to delete\n")
        elif path.exists():
            shutil.copy2(path, target)
        else:
            target.mkdir()
            (target / "precious.txt").write_text("not asyncsync's to delete\n")
        for p in [target, *target.rglob("*")]:
            os.chmod(p, 0o700 if p.is_dir() else 0o600)
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
    if kind == "symlink":
        path.symlink_to(target, target_is_directory=target.is_dir())
    else:
        os.mkfifo(path)
    return outside


def run(ctx: Any, component: str, case: Path) -> dict[str, Any]:
    """Run one component on ``case`` as its own process."""
    out = case / f"{component.replace(' ', '_')}.json"
    args: list[str] = [str(case / "root"), str(out)]
    if component == "receiver":
        args.append(str(case / "ckpt"))
    return run_process(ctx, planted_child.COMPONENTS[component], *args)


def run_process(ctx: Any, fn: Any, where: str, out: str, *args: str) -> dict[str, Any]:
    """Run ``fn(where, out, *args)`` as its own process; kill it past the deadline."""
    proc = ctx.Process(target=fn, args=(where, out, *args))
    proc.start()
    proc.join(DEADLINE)
    if proc.is_alive():
        proc.kill()
        proc.join()
        return {"ok": False, "error": f"HUNG: still running after {DEADLINE:g}s (killed)"}
    if proc.exitcode != 0 or not Path(out).exists():
        return {"ok": False, "error": f"UNEXPECTED: died with exit code {proc.exitcode}"}
    result: dict[str, Any] = json.loads(Path(out).read_text())
    return result


@pytest.mark.slow  # 36 cases x 5 processes: ~2 min on 2 shared cores
@pytest.mark.parametrize("kind", ["symlink", "fifo"])
@pytest.mark.parametrize(
    "name",
    [
        # the receiver waits out its own lease's ttl (30 s) before it takes it over: heavy
        pytest.param(n, marks=pytest.mark.heavy) if n == "leases/e1.json" else n
        for n in NAMES
    ],
)
def test_a_planted_entry_never_reaches_outside_the_root_nor_hangs_a_process(
    template: Path, forkserver: Any, tmp_path: Path, name: str, kind: str
) -> None:
    case = tmp_path
    shutil.copytree(template / "root", case / "root", symlinks=True)
    shutil.copytree(template / "ckpt", case / "ckpt", symlinks=True)
    outside = plant(case, name, kind)
    before = snapshot(outside)
    problems = []
    for component in planted_child.COMPONENTS:
        res = run(forkserver, component, case)
        after = snapshot(outside)
        if after != before:
            changed = sorted(
                k for k in before.keys() | after.keys() if before.get(k) != after.get(k)
            )
            problems.append(f"{component} changed files outside the root: {changed}")
            before = after
        error = res.get("error") or ""
        output = res.get("output") or ""
        if error.startswith(("HUNG", "UNEXPECTED")) or "Traceback" in output:
            problems.append(f"{component}: {error} {output[-1500:]}")
    assert problems == [], "\n".join(problems)


# --------------------------------------------------------------------------- single findings
# Each reproduces one finding of issue 22 in its own process (a hang or an unbounded read in
# the test process itself would take the test run down with it).


def assert_refused(res: dict[str, Any], error: str, words: str) -> None:
    """The process ended with the clear error ``error`` saying ``words`` (no hang, no crash)."""
    assert not res["ok"] and res["error"].startswith(error) and words in res["error"], res


def _copy_template(template: Path, case: Path) -> Path:
    shutil.copytree(template / "root", case / "root", symlinks=True)
    shutil.copytree(template / "ckpt", case / "ckpt", symlinks=True)
    return case / "root"


def test_a_fifo_lease_never_hangs_a_publish_under_wait_for(
    template: Path, forkserver: Any, tmp_path: Path
) -> None:
    """Finding 2: retention reads the lease of each engine with an ack (its age); a FIFO at
    ``leases/<id>.json`` blocked that read in a worker thread, so ``asyncio.wait_for`` could
    not end the publish and the process could not exit. Now: the publish commits at once."""
    root = _copy_template(template, tmp_path)
    os.mkfifo(root / "leases" / "e1.json")  # e1 has an ack: its lease is read
    res = run_process(forkserver, planted_child.publish_bounded, str(root), str(tmp_path / "o"))
    assert res["ok"], res
    assert (root / "v000000000004" / "manifest.json").is_file()


def test_an_ack_symlinked_to_dev_zero_is_refused_unread(
    template: Path, forkserver: Any, tmp_path: Path
) -> None:
    """Finding 4: the size was checked on the link, the read followed it (2.2 GiB from
    /dev/zero, then a bare MemoryError). Now: refused as a symlink before a byte is read."""
    root = _copy_template(template, tmp_path)
    (root / "acks" / "e1.json").unlink()
    (root / "acks" / "e1.json").symlink_to("/dev/zero")
    res = run_process(forkserver, planted_child.read_ack_capped, str(root), str(tmp_path / "o"))
    assert_refused(res, "UnsafePath", "symlink")


def test_a_manifest_of_empty_objects_is_refused_before_it_is_parsed(
    forkserver: Any, tmp_path: Path
) -> None:
    """Finding 7: 3 bytes of ``{},`` cost ~80 bytes of memory to parse (a 125 MiB manifest of
    them needed 2.6 GiB). A manifest denser than any valid one is refused unparsed."""
    path = tmp_path / "manifest.json"
    with open(path, "wb") as f:
        f.write(b'{"format": "asyncsync", "tensors": [')
        f.write(b"{}," * (16 << 20))  # 48 MiB: > 1 GiB to parse
        f.write(b"{}]}")
    res = run_process(forkserver, planted_child.parse_capped, str(path), str(tmp_path / "o"))
    assert_refused(res, "ManifestError", "denser than any valid record")


def test_a_manifest_another_uid_may_not_read_is_a_bad_version(
    template: Path, forkserver: Any
) -> None:
    """Finding 3 (EACCES): a receiver running as another uid than the publisher (the Docker
    image's receiver is uid 10001) that may not read a manifest got a bare PermissionError at
    every sync and stayed behind it for good, though a keyframe followed. Now: re-read within
    the window, then bad; the receiver goes on from the keyframe past it."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a receiver as another uid")
    base = Path(tempfile.mkdtemp(prefix="asyncsync-uid-"))  # not under pytest's 0700 tmp
    try:
        os.chmod(base, 0o755)
        root = _copy_template(template, base)
        asyncio.run(_seed(root, 4))  # v4: a keyframe past the unreadable v2
        os.chmod(root / "v000000000002" / "manifest.json", 0)
        for d in (root / "acks", root / "leases"):
            os.chmod(d, 0o777)  # the receiver writes its ack and lease there
        for p in [base / "ckpt", *(base / "ckpt").rglob("*")]:
            os.chown(p, 65534, 65534, follow_symlinks=False)
        (base / "out").mkdir(mode=0o777)
        os.chmod(base / "out", 0o777)  # where the receiver of uid 65534 reports
        out = base / "out" / "o.json"
        res = run_process(
            forkserver, planted_child.receive_as_nobody, str(root), str(out), str(base / "ckpt")
        )
        assert res["ok"], res
        assert "holds 4; bad [2]" in res["output"], res
    finally:
        shutil.rmtree(base, ignore_errors=True)


async def _seed(root: Path, step: int) -> None:
    async with Publisher(root, keyframe_interval=0) as pub:
        await pub.seed(planted_child.state(step))
