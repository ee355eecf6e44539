"""Build (or find) the real SGLang 0.5.23 CPU environment the real-server tests run against.

::

    python3.11 tests/sglang_env/build.py            # build if missing; print its directory
    python3.11 tests/sglang_env/build.py --check    # exit 1 (with the reason) if not built

Only the standard library is used here: the project's own venv need not exist yet.

The environment lives in the user's cache directory, named by a hash of everything that decides
its contents (``requirements.txt``, the stubs, the tiny-model script, :data:`RECIPE` for the
steps of this file, the project's runtime dependencies from ``pyproject.toml``)::

    ${ASYNCSYNC_SGLANG_ENV_CACHE:-${XDG_CACHE_HOME:-~/.cache}/asyncsync}/sglang-<hash>/
        venv/              python3.11 venv: torch==2.13.0+cpu, sglang==0.5.23 (--no-deps), ...
        models/tiny-llama  models/tiny-qwen2   (random float32 weights, local BPE tokenizer)
        COMPLETE           written last: a directory without it is rebuilt
        build.log

so a fresh clone reuses it and a second run costs a hash. What it takes, and why
(docs/ENGINES.md, "The real SGLang in the tests"):

1. ``torch==2.13.0+cpu`` first, pinned by a constraint file: any other torch is a CUDA build.
2. ``sglang==0.5.23 --no-deps``: its metadata pins torch 2.14.1, CUDA kernels, nvidia-*.
3. ``requirements.txt`` (the closure the CPU text server imports) ``--no-deps``, so pip's
   resolver never sees sglang's CUDA pins (it prints "sglang requires ..." warnings: expected).
4. torchvision 0.28.0 exists only as a CUDA build; its ``_C.so`` cannot load on CPU torch, and
   ``torchvision/__init__`` then dies registering fake ops: the registrations are made
   conditional on the ops having loaded (transforms, all sglang imports, then work).
5. The project's runtime dependencies (``pyproject.toml``, torch excluded by the constraint)
   with pip's normal resolver: what ``pip install asyncsync`` adds to an SGLang environment.
   The project itself is not in the cached venv: ``install_plugin`` puts it in a per-checkout
   folder (``build/sglang-plugin``) on the servers' PYTHONPATH, so checkouts never share code.
6. Tiny models, written by ``make_tiny_model.py`` with the venv's transformers.

At run time the servers need ``SGLANG_USE_CPU_ENGINE=1`` and ``stubs/`` (``sgl_kernel``: no CPU
build is on the package index) plus ``stubs-notriton/`` on PYTHONPATH (``server.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
TORCH_PIN = "torch==2.13.0+cpu"
#: bumped whenever a build step below changes what ends up in the environment
RECIPE = 1
#: files whose bytes decide the environment (with RECIPE and the project's runtime dependencies)
HASHED = (
    "requirements.txt",
    "make_tiny_model.py",
    "stubs/sgl_kernel/__init__.py",
    "stubs-notriton/triton/__init__.py",
)
MODELS = ("llama", "qwen2")
PLUGIN_DIR = REPO / "build" / "sglang-plugin"

_TORCHVISION_OLD = """from torchvision import (
    _autograd_registrations,
    _meta_registrations,
    datasets,"""
_TORCHVISION_NEW = """if extension._has_ops():  # patched: the CUDA _C.so cannot load on CPU torch
    from torchvision import _autograd_registrations, _meta_registrations  # noqa: F401
from torchvision import (
    datasets,"""


class BuildError(Exception):
    """The environment cannot be built; the message says which step failed and where the log is."""


def project_dependencies() -> list[str]:
    """The runtime dependencies ``pip install asyncsync`` brings (pyproject.toml)."""
    with open(REPO / "pyproject.toml", "rb") as f:
        return list(tomllib.load(f)["project"]["dependencies"])


def env_hash() -> str:
    h = hashlib.sha256(f"recipe {RECIPE}\n".encode())
    for rel in HASHED:
        h.update(rel.encode() + b"\0" + (HERE / rel).read_bytes() + b"\0")
    h.update("\n".join(project_dependencies()).encode())
    h.update(f"{sys.version_info[0]}.{sys.version_info[1]}".encode())
    return h.hexdigest()[:16]


def cache_root() -> Path:
    explicit = os.environ.get("ASYNCSYNC_SGLANG_ENV_CACHE")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "asyncsync"


def env_dir() -> Path:
    return cache_root() / f"sglang-{env_hash()}"


def python_of(env: Path) -> Path:
    return env / "venv" / "bin" / "python"


def model_dir(env: Path, arch: str) -> Path:
    return env / "models" / f"tiny-{arch}"


def is_complete(env: Path) -> bool:
    return (env / "COMPLETE").is_file() and python_of(env).exists()


def _run(cmd: list[str], log: Path, what: str, *, label: str = "SGLang", **kw: Any) -> None:
    """Run one build step, its output appended to ``log``; BuildError with the log's tail."""
    t0 = time.monotonic()
    with open(log, "ab") as out:
        out.write(f"\n$ {' '.join(map(str, cmd))}\n".encode())
        out.flush()
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=False, **kw)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-25:]
        raise BuildError(
            f"building the {label} test environment failed at: {what} (exit {proc.returncode}); "
            f"full log: {log}\n" + "\n".join(tail)
        )
    tag = f"[{label.lower()}-env]"
    print(f"{tag} {what}: {time.monotonic() - t0:.1f}s", file=sys.stderr, flush=True)


def _patch_torchvision(py: Path, log: Path) -> None:
    out = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    )
    init = Path(out.stdout.strip()) / "torchvision" / "__init__.py"
    src = init.read_text()
    if _TORCHVISION_NEW not in src:
        if _TORCHVISION_OLD not in src:
            raise BuildError(f"{init}: layout changed; cannot patch torchvision (see build.py)")
        init.write_text(src.replace(_TORCHVISION_OLD, _TORCHVISION_NEW))
    with open(log, "a") as f:
        f.write(f"patched {init}\n")


def build(env: Path) -> None:
    """Build ``env`` from nothing (the caller holds the lock)."""
    if env.exists():
        shutil.rmtree(env)
    env.mkdir(parents=True)
    log = env / "build.log"
    py = python_of(env)
    constraints = env / "constraints.txt"
    constraints.write_text(TORCH_PIN + "\n")
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    t0 = time.monotonic()
    _run([sys.executable, "-m", "venv", str(env / "venv")], log, "venv")
    _run([*pip, "-c", str(constraints), TORCH_PIN], log, "torch (CPU build)")
    _run(
        [*pip, "--no-deps", "-c", str(constraints), "-r", str(HERE / "requirements.txt")],
        log,
        "sglang 0.5.23 and its CPU closure (--no-deps)",
    )
    _patch_torchvision(py, log)
    _run(
        [*pip, "-c", str(constraints), *project_dependencies()],
        log,
        "asyncsync's runtime dependencies (as pip install asyncsync adds them)",
    )
    check = (
        "import torch, torchvision.transforms, sglang, sglang.srt.entrypoints.http_server;"
        "assert torch.version.cuda is None, torch.__version__;"
        "print('sglang', sglang.__version__, 'torch', torch.__version__)"
    )
    _run([str(py), "-c", check], log, "import check", env=server_env(env))
    for arch in MODELS:
        _run(
            [str(py), str(HERE / "make_tiny_model.py"), str(model_dir(env, arch)), arch],
            log,
            f"tiny {arch} model",
            env=server_env(env),
        )
    (env / "COMPLETE").write_text(f"built in {time.monotonic() - t0:.0f}s\n")


def server_env(env: Path, extra_path: list[Path] | None = None) -> dict[str, str]:
    """The environment SGLang runs with on a CPU-only host (see the module docstring)."""
    out = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    paths = [*(extra_path or []), HERE / "stubs-notriton", HERE / "stubs"]
    out.update(
        PYTHONPATH=os.pathsep.join(map(str, paths)),
        SGLANG_USE_CPU_ENGINE="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONNOUSERSITE="1",
    )
    return out


@contextlib.contextmanager
def _locked(env: Path):  # type: ignore[no-untyped-def]
    env.parent.mkdir(parents=True, exist_ok=True)
    with open(env.parent / f"{env.name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def ensure() -> Path:
    """The built environment's directory, building it first when it is missing or partial."""
    return ensure_built(env_dir(), build, "SGLang", "about 2 minutes")


def ensure_built(env: Path, build_fn: Any, label: str, how_long: str) -> Path:
    """``env`` once complete: built by ``build_fn(env)`` under the lock when it is not."""
    if is_complete(env):
        return env
    with _locked(env):
        if not is_complete(env):  # another process may have built it while we waited
            print(f"[{label.lower()}-env] building {env} ({how_long})", file=sys.stderr,
                  flush=True)  # fmt: skip
            build_fn(env)
    return env


def install_plugin(env: Path, target: Path = PLUGIN_DIR, *, label: str = "SGLang") -> Path:
    """Install this checkout (no dependencies: the environment has them) into ``target``,
    which the servers get on PYTHONPATH: SGLang finds the ``sglang.srt.plugins`` entry point
    in its metadata, as it does after ``pip install asyncsync``."""
    staging = target.with_name(target.name + ".new")
    shutil.rmtree(staging, ignore_errors=True)
    log = env / f"plugin-{os.getpid()}.log"
    try:
        _run(
            [
                str(python_of(env)),
                "-m",
                "pip",
                "install",
                "-q",
                "--disable-pip-version-check",
                "--no-deps",
                "--no-build-isolation",
                "--target",
                str(staging),
                str(REPO),
            ],
            log,
            f"asyncsync into build/{target.name}",
            label=label,
        )
    finally:
        with contextlib.suppress(OSError):
            log.unlink()
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target


def main() -> int:
    return cli(__doc__, label="SGLang", env=env_dir(), ensure_fn=ensure, plugin_dir=PLUGIN_DIR)


def cli(doc: str | None, *, label: str, env: Path, ensure_fn: Any, plugin_dir: Path) -> int:
    """The command line of an environment builder (this one, ``tests/vllm_env/build.py``)."""
    p = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="only check that it is built")
    p.add_argument("--no-plugin", action="store_true", help="do not install this checkout")
    args = p.parse_args()
    tag = f"{label.lower()}-env"
    if args.check:
        if not is_complete(env):
            print(f"the {label} test environment {env} is not built: run `make {tag}`")
            return 1
        print(env)
        return 0
    try:
        env = ensure_fn()
        if not args.no_plugin:
            install_plugin(env, plugin_dir, label=label)
    except (BuildError, OSError, subprocess.CalledProcessError) as exc:
        print(f"[{tag}] {exc}", file=sys.stderr)
        return 1
    print(env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
