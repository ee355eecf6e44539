"""What a real SGLang 0.5.23 server costs the host, idle and serving, with and without the
asyncsync plugin and ``--sleep-on-idle``.

    python -m tests.sglang_env.bench_idle            # about 4 minutes on a quiet 2-core host

For each server (plugin, no plugin, plugin with ``--sleep-on-idle``; the tests' CPU flags
otherwise, 196 MiB float32 Llama): the CPU its processes use per second while no request
comes, then the client's median gap between back-to-back 1-token generations, alone and beside
a CPU burner (``torch.randperm`` in a loop, another process), before and after two
``update_weights_from_disk`` calls of the model. Run it under ``/work/bin/quiet``: it measures
wall time. It is how docs/ENGINES.md's numbers on ``--sleep-on-idle`` were measured.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tests.sglang_env import build, server
from tests.sglang_env.bench_reload import client


def burner(stop: Any, out: Any) -> None:
    n, t0 = 0, time.monotonic()
    while not stop.is_set():
        torch.randperm(786432)
        n += 1
    out.put(n / (time.monotonic() - t0))


def cpu_seconds(pgid: int) -> float:
    """User + system CPU of every process in the group (the launcher and its children)."""
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # field 5 of stat: the process group
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def gaps(url: str, seconds: float, burn: bool) -> tuple[float, float | None]:
    """(median gap between completions in ms, the burner's iterations per second)."""
    ctx = mp.get_context("spawn")
    stop, q = ctx.Event(), ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "client.log"
        c = ctx.Process(target=client, args=(url, str(log), stop), daemon=True)
        b = ctx.Process(target=burner, args=(stop, q), daemon=True) if burn else None
        c.start()
        time.sleep(4)  # the client's interpreter starts
        if b is not None:
            b.start()
        time.sleep(seconds)
        stop.set()
        c.join(30)
        rate = q.get(timeout=30) if b is not None else None
        if b is not None:
            b.join(10)
        done = [float(line.split()[0]) for line in log.read_text().splitlines() if line]
    done = done[3:]
    return statistics.median(b - a for a, b in itertools.pairwise(done)) * 1000, rate


def main() -> None:
    env = build.ensure()
    build.install_plugin(env)
    with tempfile.TemporaryDirectory(prefix="asyncsync-bench-idle-") as tmp:
        work = Path(tmp)
        model = work / "model"
        server.run_env_python(
            env, str(build.HERE / "make_tiny_model.py"), str(model), "llama",
            "--layers", "16", "--hidden", "512", "--intermediate", "1536",
        )  # fmt: skip
        flags = server.CPU_FLAGS
        base = tuple(f for f in flags if f != "--sleep-on-idle")
        for label, plugin, sleep in (
            ("plugin", True, False),
            ("no plugin", False, False),
            ("plugin, --sleep-on-idle", True, True),
        ):
            server.CPU_FLAGS = base + (("--sleep-on-idle",) if sleep else ())
            s = server.SGLangServer(env, model, work / f"{label}.log", plugin=plugin)
            server.CPU_FLAGS = flags
            s.start(timeout=900)
            try:
                assert s.proc is not None
                time.sleep(2)
                c0 = cpu_seconds(s.proc.pid)
                time.sleep(5)
                idle_cpu = (cpu_seconds(s.proc.pid) - c0) / 5
                alone, _ = gaps(s.url, 8, False)
                beside, rate = gaps(s.url, 8, True)
                for i in range(2):
                    status, _ = s.update(model, str(i + 1))
                    assert status == 200
                alone2, _ = gaps(s.url, 8, False)
                beside2, rate2 = gaps(s.url, 8, True)
            finally:
                s.stop()
            print(
                f"| {label} | {idle_cpu:.2f} | {alone:.0f} / {alone2:.0f} ms "
                f"| {beside:.0f} / {beside2:.0f} ms | {rate:.1f} / {rate2:.1f} |",
                flush=True,
            )
    print("columns: server, CPU-s per s idle, 1-token gap alone (before / after two full "
          "reloads), beside a burner (same), burner iterations per s (same)")  # fmt: skip


if __name__ == "__main__":
    main()
