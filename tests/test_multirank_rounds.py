"""Multi-rank rounds (issue 23): late ranks, cancels during the plan, a rank that skips a step,
a restart while a message is in flight, two jobs on one root.

Two ranks as two Publishers in one event loop over FileRendezvous, each case both ways: calls
paired by count (no ``step``) and by the caller's step. Invariants: every committed version is
one step of every rank (``assert_steps``), and once both ranks call together again the group
commits at once.
"""

from __future__ import annotations

import asyncio
import errno
from pathlib import Path
from typing import Any

import pytest

from asyncsync import ConfigError, FileRendezvous, Publisher, PublishError
from asyncsync.errors import CoordinationError, StepBehind
from asyncsync.format.store import list_versions
from asyncsync.fsio import Throttle, set_throttle
from asyncsync.publish import distributed
from asyncsync.publish import rendezvous as rendezvous_mod
from asyncsync.publish.rendezvous import RENDEZVOUS_DIR
from tests.dist_worker import portion
from tests.test_multirank_faults import assert_finished, assert_steps

W = 2
MODES = ["count", "step"]


def _pair(root: Path, timeout: float, job: str = "j", **kw: Any) -> list[Publisher]:
    kw.setdefault("keyframe_interval", 0)
    return [
        Publisher(
            root,
            coordinator=FileRendezvous(root, r, W, timeout=timeout, poll_interval=0.002, job=job),
            **kw,
        )
        for r in range(W)
    ]


def _call(p: Publisher, rank: int, step: int, mode: str) -> Any:
    sd, sl = portion(step, rank, W)
    kw = {"step": step} if mode == "step" else {}
    return p.seed(sd, slices=sl, **kw) if step == 0 else p.publish(sd, slices=sl, **kw)


async def _rank(p: Publisher, rank: int, steps: list[int], mode: str, late: float = 0) -> list:
    """Publish ``steps`` one after the other (a free-running trainer): (step, version or
    the PublishError)."""
    await asyncio.sleep(late)
    out: list[tuple[int, Any]] = []
    for step in steps:
        try:
            out.append((step, (await _call(p, rank, step, mode)).version))
        except PublishError as exc:
            out.append((step, exc))
    return out


async def _together(pubs: list[Publisher], step: int, mode: str) -> int:
    """Both ranks call together: the version they commit (both must)."""
    r0, r1 = await asyncio.gather(*(_call(p, r, step, mode) for r, p in enumerate(pubs)))
    assert r0.version == r1.version, (r0, r1)
    return r0.version


def _failed(out: list[tuple[int, Any]], steps: list[int]) -> None:
    assert [s for s, v in out if isinstance(v, PublishError)] == steps, out


# --------------------------------------------------------------------------- 1. late, cancelled


@pytest.mark.parametrize("mode", MODES)
async def test_rank0_late_past_the_timeout_then_both_commit_again(
    tmp_path: Path, mode: str
) -> None:
    """Rank 0 comes 2.5 s late with timeout=1 (in lockstep): both fail that step, and the next
    steps commit on both (they used to fail for ever: rank 1 stayed a round behind)."""
    root = tmp_path / "root"
    pubs = _pair(root, timeout=1)
    async with pubs[0], pubs[1]:
        await _together(pubs, 0, mode)
        o0, o1 = await asyncio.gather(
            _rank(pubs[0], 0, [1], mode, late=2.5), _rank(pubs[1], 1, [1], mode)
        )
        _failed(o0, [1])
        _failed(o1, [1])
        assert [await _together(pubs, s, mode) for s in (2, 3)] == [1, 2]
    assert_steps(root, [0, 2, 3])
    assert_finished(root)


@pytest.mark.parametrize("mode", MODES)
async def test_a_late_rank0_never_takes_a_later_call(tmp_path: Path, mode: str) -> None:
    """Free-running: rank 1 gives step 1 up after its timeout and calls step 2 at once; rank 0
    comes to step 1 after that. Rank 0's step 1 fails (it never takes rank 1's step 2), and
    steps 2 and 3 commit on both."""
    root = tmp_path / "root"
    pubs = _pair(root, timeout=1)
    async with pubs[0], pubs[1]:
        await _together(pubs, 0, mode)
        o0, o1 = await asyncio.gather(
            _rank(pubs[0], 0, [1, 2, 3], mode, late=2.5), _rank(pubs[1], 1, [1, 2, 3], mode)
        )
    _failed(o0, [1])
    _failed(o1, [1])
    assert o0[1:] == o1[1:] == [(2, 1), (3, 2)], (o0, o1)
    assert_steps(root, [0, 2, 3])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cancelled", [0, 1])
async def test_a_cancel_during_the_plan_then_both_commit_again(
    tmp_path: Path, mode: str, cancelled: int
) -> None:
    """Rank ``cancelled`` is cancelled while it waits in step 1's plan, then goes on to step 2
    at once; the other rank comes to step 1 after the cancel. No version mixes steps, and
    steps 2 and 3 commit on both."""
    root = tmp_path / "root"
    pubs = _pair(root, timeout=1)
    other = 1 - cancelled
    async with pubs[0], pubs[1]:
        await _together(pubs, 0, mode)
        task = asyncio.ensure_future(_call(pubs[cancelled], cancelled, 1, mode))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        o_c, o_o = await asyncio.gather(
            _rank(pubs[cancelled], cancelled, [2, 3], mode),
            _rank(pubs[other], other, [1, 2, 3], mode),
        )
    _failed(o_o, [1])
    assert o_c == o_o[1:] == [(2, 1), (3, 2)], (o_c, o_o)
    assert_steps(root, [0, 2, 3])
    assert_finished(root)


async def test_a_rank_that_skips_a_step_rejoins_with_steps(tmp_path: Path) -> None:
    """With the caller's step, a rank that skips a call (an error before it could publish)
    costs the others that step only: rank 1 waiting in step 2 is told at once that rank 0 is
    at step 3, and step 3 commits on both."""
    root = tmp_path / "root"
    pubs = _pair(root, timeout=5)
    async with pubs[0], pubs[1]:
        await _together(pubs, 0, "step")
        await _together(pubs, 1, "step")
        o0, o1 = await asyncio.gather(
            _rank(pubs[0], 0, [3, 4], "step", late=0.3), _rank(pubs[1], 1, [2, 3, 4], "step")
        )
    _failed(o1, [2])
    assert isinstance(o1[0][1], StepBehind) and o1[0][1].ranks == (1,)
    assert "while the group is at step 3" in str(o1[0][1]), o1
    assert o0 == o1[1:] == [(3, 2), (4, 3)], (o0, o1)
    assert_steps(root, [0, 1, 3, 4])


async def test_a_rank0_a_step_behind_is_told_to_publish_the_groups_step(tmp_path: Path) -> None:
    """Rank 0 calls step 2 while rank 1 already waits in step 3: rank 0's call fails with
    StepBehind blaming rank 0 (it used to blame rank 1, "already at step 3 ... (rank 0 late)",
    and a trainer retrying step 2 looped), saying which step to publish; retrying step 2 fails
    the same way, and step 3 then commits on both."""
    root = tmp_path / "root"
    pubs = _pair(root, timeout=5)
    async with pubs[0], pubs[1]:
        await _together(pubs, 0, "step")
        await _together(pubs, 1, "step")
        r1 = asyncio.ensure_future(_call(pubs[1], 1, 3, "step"))
        await asyncio.sleep(0.3)  # rank 1's step-3 message is there first
        for _ in range(2):
            with pytest.raises(StepBehind) as err:
                await _call(pubs[0], 0, 2, "step")
            assert err.value.ranks == (0,) and err.value.group_step == 3, err.value
            assert "rank 0: this call is for step 2 while the group is at step 3" in str(err.value)
            assert "step=3" in str(err.value)
        r0 = await _call(pubs[0], 0, 3, "step")
        assert r0.version == (await r1).version == 2
    assert_steps(root, [0, 1, 3])


async def test_every_rank_behind_with_rank0_is_told_the_groups_step(tmp_path: Path) -> None:
    """Three ranks: ranks 2 and 0 call step 2 while rank 1 already waits in step 3. Rank 0
    gives its round up with StepBehind; rank 2, waiting in that round, was told only "rank 0's
    call ended before it decided (cancelled or failed)", blaming rank 0. It fails with
    StepBehind too now, blaming itself and naming step 3; then step 3 commits on all three."""
    root = tmp_path / "root"
    coords = [FileRendezvous(root, r, 3, timeout=5, poll_interval=0.002) for r in range(3)]
    pubs = [Publisher(root, keyframe_interval=0, coordinator=c) for c in coords]

    def call(r: int, step: int) -> Any:
        sd, sl = portion(step, r, 3)
        act = pubs[r].seed if step == 0 else pubs[r].publish
        return act(sd, slices=sl, step=step)

    async with pubs[0], pubs[1], pubs[2]:
        await asyncio.gather(*(call(r, 0) for r in range(3)))
        r1 = asyncio.ensure_future(call(1, 3))
        r2 = asyncio.ensure_future(call(2, 2))
        await asyncio.sleep(0.3)  # both messages are there before rank 0 comes
        with pytest.raises(StepBehind) as e0:
            await call(0, 2)
        with pytest.raises(StepBehind) as e2:
            await r2
        assert e0.value.ranks == (0,) and e2.value.ranks == (2,), (e0.value, e2.value)
        assert e2.value.group_step == 3 and "step=3" in str(e2.value), e2.value
        done = await asyncio.gather(call(0, 3), r1, call(2, 3))
        assert [d.version for d in done] == [1, 1, 1]


async def test_abstain_fails_the_round_on_every_rank(tmp_path: Path) -> None:
    """Rank 0 cannot publish step 1 (a check failed): abstain() fails the round on rank 1 too,
    naming rank 0 and why; step 2 commits."""
    root = tmp_path / "root"
    pubs = _pair(root, timeout=5)
    async with pubs[0], pubs[1]:
        await _together(pubs, 0, "step")
        why = RuntimeError("receiver e1 died (injected)")
        r0, r1 = await asyncio.gather(
            pubs[0].abstain(why, step=1), _call(pubs[1], 1, 1, "step"), return_exceptions=True
        )
        assert r0 is why
        assert isinstance(r1, PublishError) and r1.ranks == (0,) and "e1 died" in str(r1)
        assert await _together(pubs, 2, "step") == 1
    assert_steps(root, [0, 2])
    async with Publisher(tmp_path / "solo") as solo:
        with pytest.raises(RuntimeError, match="e1 died"):
            await solo.abstain(why)


async def test_mixed_modes_are_refused_with_what_to_do(tmp_path: Path) -> None:
    root = tmp_path / "root"
    pubs = _pair(root, timeout=1)
    async with pubs[0], pubs[1]:
        sd0, sl0 = portion(0, 0, W)
        sd1, sl1 = portion(0, 1, W)
        r0, r1 = await asyncio.gather(
            pubs[0].seed(sd0, slices=sl0, step=0), pubs[1].seed(sd1, slices=sl1),
            return_exceptions=True,
        )  # fmt: skip
    assert isinstance(r0, PublishError) and "pass the same on every rank" in str(r0), r0
    assert isinstance(r1, PublishError), r1
    assert list_versions(root) == []


# --------------------------------------------------------------------------- 3. restart


@pytest.mark.parametrize("mode", MODES)
async def test_rank0_restarting_while_a_message_is_in_flight(tmp_path: Path, mode: str) -> None:
    """Rank 1 is writing its plan message (a slow filesystem: 0.6 s per file operation) when
    rank 0 restarts and clears .rendezvous/: the temp file in flight stays, rank 1 joins the
    new run and both commit (the rename used to raise a raw FileNotFoundError out of publish)."""
    root = tmp_path / "root"
    pubs = _pair(root, timeout=5)
    async with pubs[0], pubs[1]:
        await _together(pubs, 0, mode)
    p0, p1 = _pair(root, timeout=5)
    rdv = root / RENDEZVOUS_DIR
    try:
        async with p1:
            set_throttle(Throttle(latency=0.6, root=str(rdv)))
            t1 = asyncio.ensure_future(_call(p1, 1, 1, mode))
            while not any(p.name.startswith(".tmp.plan-r0001") for p in rdv.iterdir()):
                await asyncio.sleep(0.01)  # rank 1 has joined the old run; its message is written
            async with p0:
                set_throttle(None)
                r0 = await _call(p0, 0, 1, mode)
                r1 = await t1
    finally:
        set_throttle(None)
    assert r0.version == r1.version == 1
    assert_steps(root, [0, 1])


async def test_a_message_that_cannot_be_written_is_a_publish_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "root"
    pubs = _pair(root, timeout=1)
    real = rendezvous_mod.atomic_write

    def full(path: Path, *a: Any, **k: Any) -> int:
        if path.name == "plan-r0001.json":
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return real(path, *a, **k)

    monkeypatch.setattr(rendezvous_mod, "atomic_write", full)
    async with pubs[0], pubs[1]:
        r0, r1 = await asyncio.gather(
            *(_call(p, r, 0, "count") for r, p in enumerate(pubs)), return_exceptions=True
        )
    assert isinstance(r1, PublishError) and "No space left" in str(r1), r1
    assert isinstance(r0, PublishError) and r0.ranks == (1,), r0


# --------------------------------------------------------------------------- 6. two jobs


def _foreign(rank: int) -> tuple[dict[str, Any], Any]:
    """Job B's weights: the same names and shapes as job A's, other values."""
    sd, sl = portion(7, rank, W)
    return {k: v.flip(0) if v.dim() else v for k, v in sd.items()}, sl


@pytest.mark.parametrize("mode", MODES)
async def test_two_jobs_on_one_root_never_mix(tmp_path: Path, mode: str) -> None:
    """Job A's rank 1 is down; job B's rank 1 (another job token) starts on the same root and
    publishes while A's rank 0 does: B's rank never joins A's group (it waits for its own rank
    0 and names A's job), A's step fails without its rank 1, and once A's rank 1 is back the
    group commits. No version ever holds B's weights."""
    root = tmp_path / "root"
    a = _pair(root, timeout=1, job="job-a")
    async with a[0]:
        async with a[1]:
            await _together(a, 0, mode)
        (b1,) = [_pair(root, timeout=1, job="job-b")[1]]
        async with b1:
            sd, sl = _foreign(1)
            kw = {"step": 1} if mode == "step" else {}
            rb, ra = await asyncio.gather(
                b1.publish(sd, slices=sl, **kw), _call(a[0], 0, 1, mode), return_exceptions=True
            )
        assert isinstance(rb, PublishError) and "'job-a'" in str(rb) and "two jobs" in str(rb), rb
        assert isinstance(rb.__cause__, CoordinationError)
        assert isinstance(ra, PublishError) and ra.ranks == (1,), ra
        a1 = _pair(root, timeout=1, job="job-a")[1]
        async with a1:
            assert await _together([a[0], a1], 2, mode) == 1
    assert_steps(root, [0, 2])


def test_job_tokens(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for k in distributed.JOB_SOURCES:
        monkeypatch.delenv(k, raising=False)
    assert FileRendezvous(tmp_path, 0, 2).job == ""
    monkeypatch.setenv("SLURM_JOB_ID", "4711")
    assert FileRendezvous(tmp_path, 0, 2).job == "4711"
    monkeypatch.setenv("ASYNCSYNC_JOB", "rl-run-7")
    assert FileRendezvous(tmp_path, 0, 2).job == "rl-run-7"
    assert FileRendezvous(tmp_path, 0, 2, job="x").job == "x"
    with pytest.raises(ValueError, match="job must be"):
        FileRendezvous(tmp_path, 0, 2, job="a/b")


def test_torchruns_placeholder_run_id_is_no_job_token(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """torchrun without --rdzv-id (a multi-node static rendezvous: --master-addr/--master-port)
    gives every job TORCHELASTIC_RUN_ID=none: taken as the token, it named two Slurm jobs the
    same and hid their SLURM_JOB_IDs (one job's rank joined the other's group and its weights
    were committed into that job's version; helper-43)."""
    for k in distributed.JOB_SOURCES:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert FileRendezvous(tmp_path, 0, 2).job == ""
    monkeypatch.setenv("SLURM_JOB_ID", "4711")
    assert FileRendezvous(tmp_path, 0, 2).job == "4711"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "b7f0c1d2")  # --rdzv-id, or --standalone's uuid
    assert FileRendezvous(tmp_path, 0, 2).job == "b7f0c1d2"


async def test_rank0_clears_a_directory_left_in_the_rendezvous(tmp_path: Path) -> None:
    """A directory at one of the rendezvous' names (any host that writes the root can make one)
    was never removed when rank 0 started the group (it removed files only), and no result can
    be renamed over it: every plan failed, restarts included (helper-43)."""
    root = tmp_path / "root"
    for name in ("plan.json", "commit.json", "beat-r0001.json", rendezvous_mod.GROUP_FILE):
        (root / RENDEZVOUS_DIR / name / "x").mkdir(parents=True)
    pubs = _pair(root, timeout=2)
    async with pubs[0], pubs[1]:
        assert await _together(pubs, 0, "step") == 0
        assert await _together(pubs, 1, "step") == 1
    assert_steps(root, [0, 1])
    assert_finished(root)


@pytest.mark.parametrize("mode", ["delta", "full"])
async def test_a_rank_whose_tensors_vanish_fails_the_round(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, mode: str
) -> None:
    """A rank that published tensors and then passes an empty state dict (a filter that matched
    nothing, weights not gathered) was taken as a rank that holds none: the group committed a
    full version without that rank's tensors, and receivers re-initialised from it, without a
    word on any rank (helper-43). As for a publisher alone, an empty state dict is refused; a
    rank whose tensors change (without vanishing) says so."""
    root = tmp_path / "root"
    pubs = _pair(root, timeout=2, mode=mode)

    def own(step: int, rank: int) -> dict[str, Any]:
        return {k: v for k, v in portion(step, rank, W)[0].items() if k.startswith(f"rank{rank}.")}

    async with pubs[0], pubs[1]:
        await asyncio.gather(*(p.seed(own(0, r), step=0) for r, p in enumerate(pubs)))
        r0, r1 = await asyncio.gather(
            pubs[0].publish(own(1, 0), step=1), pubs[1].publish({}, step=1),
            return_exceptions=True,
        )  # fmt: skip
        assert isinstance(r1, ConfigError) and "empty" in str(r1), r1
        assert isinstance(r0, PublishError) and r0.ranks == (1,), r0
        assert list_versions(root) == [0]
        sd = own(2, 1)
        sd.pop(next(iter(sd)))  # one tensor less: published (full), and said
        with caplog.at_level("WARNING"):
            calls = [pubs[0].publish(own(2, 0), step=2), pubs[1].publish(sd, step=2)]
            r = await asyncio.gather(*calls)
        assert [x.version for x in r] == [1, 1]
        if mode == "delta":  # (a full-mode publisher keeps no snapshot to compare with)
            assert "rank 1: the tensor set changed" in caplog.text


async def test_a_rank_whose_lock_file_is_gone_takes_no_part(tmp_path: Path) -> None:
    """The root wiped while a rank of the old run lived on (an orphan): its lock file gone, the
    relaunched rank 1 locked a new one, and both rank-1 processes sent messages to the same
    group: rank 0 took whichever it read, and versions were made with the orphan's weights
    (helper-43). A rank whose lock file is no longer the one it holds sends nothing."""
    root = tmp_path / "root"
    pubs = _pair(root, timeout=2)
    async with pubs[0], pubs[1]:
        assert await _together(pubs, 0, "step") == 0
        (root / ".publisher.r0001.lock").unlink()  # the root wiped under the running rank 1
        new = _pair(root, timeout=2)[1]
        async with new:
            orphan = asyncio.ensure_future(_call(pubs[1], 1, 1, "step"))
            await asyncio.sleep(0.3)  # the orphan's message first: the others overwrite it
            r0, r1 = await _together_with(pubs[0], new, 1)
            with pytest.raises(PublishError, match="lock file"):
                await orphan
            assert r0.version == r1.version == 1
            orphan2 = asyncio.ensure_future(_call(pubs[1], 1, 2, "step"))  # and at every call
            await asyncio.sleep(0.3)
            assert (await _together_with(pubs[0], new, 2))[0].version == 2
            with pytest.raises(PublishError, match="lock file"):
                await orphan2
    assert_steps(root, [0, 1, 2])


async def _together_with(p0: Publisher, p1: Publisher, step: int) -> list[Any]:
    return await asyncio.gather(_call(p0, 0, step, "step"), _call(p1, 1, step, "step"))


async def test_ranks_with_different_timeouts_are_refused(tmp_path: Path) -> None:
    """A rank beats every quarter of its own timeout and rank 0 judges it silent after its own:
    with rank 1's timeout 8 s and rank 0's 1 s, every commit whose writes took rank 1 more than
    a second failed as "ranks [1] went silent (died or hung?)" while it beat as told (helper-43).
    Ranks are refused at the plan when their timeouts differ, naming both."""
    root = tmp_path / "root"
    pubs = [
        Publisher(root, coordinator=FileRendezvous(root, r, W, timeout=t, job="j"))
        for r, t in ((0, 1.0), (1, 8.0))
    ]
    async with pubs[0], pubs[1]:
        r0, r1 = await asyncio.gather(
            *(_call(p, r, 0, "step") for r, p in enumerate(pubs)), return_exceptions=True
        )
        for r in (r0, r1):
            assert isinstance(r, PublishError) and "timeout" in str(r), r
        assert r0.ranks == (1,), r0  # type: ignore[union-attr]
    assert list_versions(root) == []


def test_rendezvous_files_are_read_within_what_they_can_hold(tmp_path: Path) -> None:
    """Every rendezvous file was read up to 1 GiB, at every poll: a large (sparse) file at a
    message's or a heartbeat's name made each rank allocate that much again and again (any host
    that writes the root can plant one; helper-43). Only a commit result carries a manifest;
    the others are small."""
    d = tmp_path / RENDEZVOUS_DIR
    d.mkdir()
    big = b'{"pad": "' + b"x" * (rendezvous_mod.MESSAGE_LIMIT + 1) + b'"}'
    for name in ("plan-r0001.json", "beat-r0000.json", "plan.json", rendezvous_mod.GROUP_FILE):
        (d / name).write_bytes(big)
        assert rendezvous_mod._read_json(d / name) is None, name
    (d / "commit.json").write_bytes(big)
    assert rendezvous_mod._read_json(d / "commit.json") == {"pad": "x" * (len(big) - 11)}


def test_an_absurd_world_size_is_refused(tmp_path: Path) -> None:
    """A world of 10**12 ranks (a typo) was taken: rank 0's first round raised a bare
    MemoryError; one of 10**7 polled a file per rank, each poll, well past its timeout."""
    with pytest.raises(ConfigError, match="world_size must be at most 65536"):
        FileRendezvous(tmp_path, 0, 10**12, job="j")
    assert FileRendezvous(tmp_path, 65535, 1 << 16, job="j").world_size == 65536


async def test_rank0_puts_back_its_group_file(tmp_path: Path) -> None:
    """A group-v2.json of this job naming another run (written by hand, or by any host that
    writes the root) made every other rank wait for that run's rank 0: every round failed until
    rank 0 restarted, since rank 0 wrote the file only when it opened (helper-43). Rank 0 holds
    the root's lock, so no other run of its job is live: it writes its own back at each plan."""
    root = tmp_path / "root"
    pubs = _pair(root, timeout=1)
    async with pubs[0], pubs[1]:
        assert await _together(pubs, 0, "step") == 0
        group = root / RENDEZVOUS_DIR / rendezvous_mod.GROUP_FILE
        group.write_text('{"group": "0123456789abcdef", "job": "j", "host": "x", "pid": 1}')
        out = await asyncio.gather(*(_rank(p, r, [1, 2], "step") for r, p in enumerate(pubs)))
        assert isinstance(out[0][-1][1], int), out  # the group commits again
    assert_steps(root, [0] + [s for s, v in out[0] if isinstance(v, int)])
