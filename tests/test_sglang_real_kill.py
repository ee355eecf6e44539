"""Killed and stopped processes around an in-engine apply, against the real SGLang 0.5.23 server.

One server (tiny float32 Llama, CPU, the asyncsync plugin) and the real ``asyncsync-receiver``
CLI (``--pause-mode abort``: the pause does not reach SGLang's scheduler, so a stopped
scheduler catches the receiver inside ``POST /update_weights_from_disk``) fed by a real
Publisher. SGLang's scheduler is stopped (SIGSTOP) while the receiver's update of a staged
version waits in SGLang's TokenizerManager; then:

* the receiver is SIGKILLed and restarted, and the scheduler continued: SGLang keeps one result
  slot for weight updates and takes no lock while paused, so a second update sent while the
  dead receiver's still runs is answered with the first one's result, and the second result
  kills the server ("TokenizerManager hit an exception: InvalidStateError"). The restarted
  receiver waits for the server to finish the update in flight (a ``/server_info`` round trip
  through the scheduler) and keeps its stage until then: the dead receiver's stage is applied
  in place, and the new receiver acks after finding the server at that version;
* a receiver with a short ``--engine-update-timeout`` gives up on its update and removes its
  stage: its next attempt waits for the update still in SGLang (no second one), and the
  plugin refuses the gone stage with nothing loaded;
* the whole server is SIGKILLed and restarted with the weights it loads from disk: nothing is
  acked meanwhile, ``/readyz`` is 503, and the receiver reloads the checkpoint into the new
  process (a full reload: it knows no base), then goes in place again.

After each, every served tensor equals the trainer's bytes and the server is not left paused.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from tests.sglang_env.chain import Trainer, base_state
from tests.sglang_env.fixtures import serving
from tests.sglang_env.server import Receiver, SGLangServer, http, wait_for

pytestmark = [
    pytest.mark.sglang_real,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(600),
]

EID = "sglang-kill-0"
PROMPT = [24, 978, 642, 484, 20]
ONE = "model.layers.0.mlp.gate_proj.weight"
TWO = ["model.layers.1.mlp.up_proj.weight", "model.layers.0.self_attn.q_proj.weight"]
CRASH = "TokenizerManager hit an exception"


@dataclass
class Stack:
    dir: Path
    server: SGLangServer
    trainer: Trainer
    receiver: Receiver

    def updates_started(self) -> int:
        return self.server.this_start().count("Start update_weights")

    def scheduler(self) -> int:
        """The pid of SGLang's scheduler (a child of the server's process group)."""
        assert self.server.proc is not None
        for p in Path("/proc").iterdir():
            if not p.name.isdigit():
                continue
            try:
                stat = (p / "stat").read_text()
                cmd = (p / "cmdline").read_bytes()
            except OSError:
                continue
            pgid = int(stat.rsplit(")", 1)[1].split()[2])
            if pgid == self.server.proc.pid and b"sglang::scheduler" in cmd:
                return int(p.name)
        raise AssertionError("no SGLang scheduler process found")

    def stop_scheduler_in_update(self) -> int:
        """SIGSTOP the scheduler; returns its pid (SIGCONT it, also when the test fails)."""
        pid = self.scheduler()
        os.kill(pid, signal.SIGSTOP)
        return pid

    async def wait_acked_or_broken(self, version: int) -> None:
        """Until ``version`` is acked, the receiver exits or the server crashes."""
        wait_for(
            f"v{version} acked (or the receiver or the server gone)",
            lambda: (
                self.trainer.ack_of(EID) == version
                or not self.receiver.alive
                or CRASH in self.server.this_start()
            ),
            timeout=300,
        )
        assert CRASH not in self.server.this_start(), self.server.diagnosis()
        assert self.receiver.alive, self.receiver.tail()
        assert self.trainer.ack_of(EID) == version

    def check_served(self, version: int) -> None:
        """Both version labels name ``version``, every served tensor is the trainer's, and
        the server serves (not left paused: SGLang's /ready is 503 while paused)."""
        srv = self.server
        assert srv.model_info_version() == str(version)
        assert http(srv.url + "/ready")[0] == 200
        assert srv.generate(PROMPT, 2)["meta_info"]["weight_version"] == str(version)
        for name, want in self.trainer.sd.items():
            got = torch.tensor(srv.weights(name), dtype=want.dtype)
            assert torch.equal(got, want), f"v{version}: served {name} differs"

    def plugin_lines_since(self, mark: int) -> list[str]:
        return self.server.plugin_lines()[mark:]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangServer]:
    with serving(tmp_path_factory.mktemp("sglang-kill")) as srv:
        yield srv


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(
    server: SGLangServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Stack]:
    d = tmp_path_factory.mktemp("kill-chain")
    trainer = Trainer(d / "root", base_state(server.model))
    args = [
        "--root", str(d / "root"), "--engine-id", EID, "--checkpoint", str(d / "ckpt"),
        "--sglang-url", server.url, "--pause-mode", "abort",
        "--engine-startup-timeout", "600",
    ]  # fmt: skip
    receiver = Receiver(d / "receiver.log", args)
    s = Stack(d, server, trainer, receiver)
    v = await trainer.open()
    receiver.start()
    try:
        await s.wait_acked_or_broken(v)
        v = await trainer.step([ONE])
        await s.wait_acked_or_broken(v)
        assert server.plugin_lines()[-1].startswith(f"asyncsync: in-engine apply: v{v - 1} -> v{v}")
        yield s
    finally:
        receiver.stop()
        await trainer.close()


async def test_receiver_killed_while_sglang_applies_its_stage(stack: Stack) -> None:
    s = stack
    held = s.trainer.ack_of(EID)
    assert held is not None
    lines = len(s.server.plugin_lines())
    started = s.updates_started()
    sched = s.stop_scheduler_in_update()
    try:
        v = await s.trainer.step(TWO)
        wait_for("the receiver's update inside SGLang", lambda: s.updates_started() > started)
        s.receiver.stop(sig=signal.SIGKILL)
        mark = len(s.server.this_start())
        s.receiver.start()
        # the new receiver reached the server (its resume is answered without the scheduler)
        wait_for(
            "the new receiver at the server",
            lambda: "POST /continue_generation" in s.server.this_start()[mark:],
        )
        # give a receiver that does not wait the time to send its own update (not a check:
        # with the fix it never comes, and the wait just ends)
        with contextlib.suppress(AssertionError):
            wait_for("a second update", lambda: s.updates_started() > started + 1, timeout=10)
    finally:
        os.kill(sched, signal.SIGCONT)
    await s.wait_acked_or_broken(v)
    s.check_served(v)
    after = s.plugin_lines_since(lines)
    # the dead receiver's stage was still there when SGLang came to it: applied in place
    assert after[0].startswith(f"asyncsync: in-engine apply: v{held} -> v{v}: 2 of"), after
    assert s.receiver.status()["version"] == v
    v = await s.trainer.step([ONE])  # and in place from there
    await s.wait_acked_or_broken(v)
    s.check_served(v)
    assert s.server.plugin_lines()[-1].startswith(f"asyncsync: in-engine apply: v{v - 1} -> v{v}")


async def test_server_killed_while_it_applies_a_stage(stack: Stack) -> None:
    s = stack
    held = s.trainer.ack_of(EID)
    assert held is not None
    started = s.updates_started()
    s.stop_scheduler_in_update()  # killed with its group below
    v = await s.trainer.step(TWO)
    wait_for("the receiver's update inside SGLang", lambda: s.updates_started() > started)
    s.server.stop(sig=signal.SIGKILL)
    wait_for("/readyz 503 with the server down", lambda: s.receiver.get("/readyz")[0] == 503)
    # refused connections: the process is gone, the next one serves its launch weights
    wait_for("the ack withdrawn", lambda: s.trainer.ack_of(EID) is None, timeout=60)
    s.server.start()
    await s.wait_acked_or_broken(v)
    s.check_served(v)
    lines = re.findall(r"asyncsync: (?:in-engine apply|partial reload|full reload)[^\n\]]*",
                       s.server.this_start())  # fmt: skip
    # the new process knows no base: the checkpoint is loaded in full
    assert lines and lines[0].startswith("asyncsync: full reload (first reload"), lines
    wait_for("/readyz 200", lambda: s.receiver.get("/readyz")[0] == 200)
    v = await s.trainer.step([ONE])
    await s.wait_acked_or_broken(v)
    s.check_served(v)
    assert s.server.plugin_lines()[-1].startswith(f"asyncsync: in-engine apply: v{v - 1} -> v{v}")


async def test_an_update_that_timed_out_is_waited_for_before_the_next(stack: Stack) -> None:
    """A receiver with ``--engine-update-timeout 5`` gives up on its update while SGLang's
    scheduler is stopped, and removes its stage. Its next attempt waits for the update still
    in SGLang instead of sending a second one (which would crash the server, as above); SGLang
    then comes to the first update's stage, gone, and the plugin refuses it with nothing
    loaded; the next attempt loads the checkpoint."""
    s = stack
    s.receiver.stop()
    impatient = Receiver(
        s.dir / "impatient.log", [*s.receiver.cmd[1:-4], "--engine-update-timeout", "5"]
    )
    impatient.start()
    try:
        wait_for("the receiver up", lambda: impatient.get("/readyz")[0] == 200)
        v = await s.trainer.step([ONE])  # its first answer tells it the server takes stages
        wait_for(f"v{v} acked", lambda: s.trainer.ack_of(EID) == v)
        lines = len(s.server.plugin_lines())
        started = s.updates_started()
        sched = s.stop_scheduler_in_update()
        try:
            v = await s.trainer.step(TWO)
            wait_for("the receiver to give up", lambda: "no answer within 5s" in impatient.text())
            with contextlib.suppress(AssertionError):  # as above: not a check
                wait_for("a second update", lambda: s.updates_started() > started + 1, timeout=10)
        finally:
            os.kill(sched, signal.SIGCONT)
        wait_for(
            f"v{v} acked (or the receiver or the server gone)",
            lambda: s.trainer.ack_of(EID) == v or not impatient.alive
            or CRASH in s.server.this_start(),
            timeout=300,
        )  # fmt: skip
        assert CRASH not in s.server.this_start(), s.server.diagnosis()
        assert s.trainer.ack_of(EID) == v, impatient.tail()
        s.check_served(v)
        after = s.plugin_lines_since(lines)
        assert after[0].startswith("asyncsync: refused to load: the stage "), after
        assert " is gone " in after[0], after
    finally:
        impatient.stop()
        s.receiver.start()


async def test_a_start_while_the_server_is_busy_is_retried(stack: Stack) -> None:
    """A receiver started while an update still runs in SGLang (its scheduler stopped here)
    gets no answer from ``/server_info`` within ``--engine-update-timeout``: it exited with
    status 1, for a supervisor to restart. It retries with backoff now, acks nothing
    meanwhile, and serves once the server answers."""
    s = stack
    s.receiver.stop()
    held = s.trainer.ack_of(EID)
    patient = Receiver(
        s.dir / "patient.log", [*s.receiver.cmd[1:-4], "--engine-update-timeout", "2"]
    )
    sched = s.stop_scheduler_in_update()
    try:
        patient.start()
        wait_for("two failed starts", lambda: patient.text().count("could not start") >= 2)
        assert patient.alive, patient.tail()
        assert "no answer within 2s" in patient.text(), patient.tail()
        assert s.trainer.ack_of(EID) == held
    finally:
        os.kill(sched, signal.SIGCONT)
    try:
        wait_for("the receiver up", lambda: patient.get("/readyz")[0] == 200)
        v = await s.trainer.step([ONE])
        wait_for(f"v{v} acked", lambda: s.trainer.ack_of(EID) == v)
        s.check_served(v)
    finally:
        patient.stop()
        s.receiver.start()


async def test_a_restarted_server_is_noticed_while_idle(stack: Stack) -> None:
    """The server SIGKILLed and restarted while no version is in flight comes back with the
    weights it loads from disk: the receiver noticed only at its next version or when asked
    ``/readyz``, the ack naming the old version meanwhile. Its idle check of the served
    version (every few seconds) finds it now and reloads the version held; nobody asks
    ``/readyz`` here. The ack was removed only once the new process answered with its launch
    label (after the receiver's wait for it, up to 8 s between probes): for that long a
    trainer read v in the ack while the server served its launch weights. It is removed now
    as soon as the check finds nothing listening, before the new process serves anything, and
    written again after the reload."""
    s = stack
    wait_for("the receiver up", lambda: s.receiver.get("/readyz")[0] == 200)
    v = s.trainer.ack_of(EID)
    assert v is not None
    s.server.stop(sig=signal.SIGKILL)
    wait_for("the ack withdrawn while the server is down", lambda: s.trainer.ack_of(EID) is None,
             timeout=60)  # fmt: skip
    assert s.receiver.status()["engine"]["ack_withdrawn"], s.receiver.tail()
    s.server.start()
    wait_for(
        f"v{v} reloaded into the new process",
        lambda: "asyncsync: full reload" in s.server.this_start(),
        timeout=60,
    )
    wait_for(f"v{v} served", lambda: s.server.model_info_version() == str(v))
    s.check_served(v)
    wait_for(f"v{v} acked again", lambda: s.trainer.ack_of(EID) == v)
    v = await s.trainer.step([ONE])  # and in place from there
    await s.wait_acked_or_broken(v)
    s.check_served(v)


@pytest.mark.heavy
async def test_a_stopped_server_loses_its_ack_and_gets_it_back_when_it_answers(
    stack: Stack,
) -> None:
    """The whole server stopped (SIGSTOP of its process group: a hung host, a debugger) answers
    nothing: the ack kept naming the version for as long as it stayed so, forever. With
    ``--engine-silence-timeout 5`` it is withdrawn once nothing was answered for 5 s; on
    SIGCONT the server answers with the version held, and the ack is written again, with no
    reload (the weights never changed)."""
    s = stack
    s.receiver.stop()
    strict = Receiver(
        s.dir / "strict.log", [*s.receiver.cmd[1:-4], "--engine-silence-timeout", "5"]
    )
    strict.start()
    assert s.server.proc is not None
    group = s.server.proc.pid
    try:
        wait_for("the receiver up", lambda: strict.get("/readyz")[0] == 200)
        v = s.trainer.ack_of(EID)
        assert v is not None
        started = s.updates_started()
        os.killpg(group, signal.SIGSTOP)
        try:
            wait_for("the ack withdrawn", lambda: s.trainer.ack_of(EID) is None, timeout=120)
            assert "answered nothing" in strict.status()["engine"]["ack_withdrawn"]
        finally:
            os.killpg(group, signal.SIGCONT)
        wait_for(f"v{v} acked again", lambda: s.trainer.ack_of(EID) == v, timeout=180)
        assert strict.status()["engine"]["ack_withdrawn"] is None
        assert s.updates_started() == started  # nothing reloaded: it serves v as before
        s.check_served(v)
    finally:
        strict.stop()
        s.receiver.start()
