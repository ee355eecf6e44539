"""deploy/: the Kubernetes manifest and the systemd unit are valid and wired consistently
(the receiver's arguments parse with the real CLI, paths and ports agree, the key is a file)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
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
def statefulset() -> dict[str, Any]:
    yaml = pytest.importorskip("yaml", reason="PyYAML is needed to parse deploy/k8s manifests")
    docs = [d for d in yaml.safe_load_all(K8S.read_text()) if d]
    (sts,) = [d for d in docs if d.get("kind") == "StatefulSet"]
    assert sts["apiVersion"] == "apps/v1"
    return sts


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

    # the key is a file from the same Secret SGLang gets its --api-key from
    key_dir = mounts(rx)["api-key"]
    assert Path(args.api_key_file).parent == Path(key_dir)
    volumes = {v["name"]: v for v in spec["volumes"]}
    secret = volumes["api-key"]["secret"]["secretName"]
    sgl_env = {e["name"]: e for e in sgl["env"]}
    assert "--api-key=$(SGLANG_API_KEY)" in sgl["args"]
    assert sgl_env["SGLANG_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == secret
    assert not any("api-key" in a and "file" not in a for a in rx["args"])  # never inline

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
    for path in (env["ASYNCSYNC_ROOT"], str(Path(env["ASYNCSYNC_CHECKPOINT"]).parent)):
        assert path in svc["ReadWritePaths"][0].split()


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
