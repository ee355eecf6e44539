#!/usr/bin/env bash
# Issue 26's thread scaling and the accelerator paths, as one prepared run for the 16-core
# accelerator host that the `device` tool lends some sessions (BENCHMARKS.md, "Thread scaling").
#
# That host has Python 3.12 with torch, numpy, safetensors, xxhash, aiohttp, aiofiles,
# prometheus-client, tqdm and uvloop, and reaches no package registry. So, here first:
#
#   stress/device_scaling.sh fetch      # the missing wheels (zstandard, watchfiles) -> .whl/
#
# then one call of the device tool, carrying them (about 6 minutes of its 10):
#
#   run(command="bash stress/device_scaling.sh run", carry=[".whl"], timeout_s=580)
#
# It builds the C kernels with that Python, checks the accelerator paths bit-exact
# (`asyncsync bench --device cuda`), then runs `python -m asyncsync.ops.bench.threads` at
# 1, 2, 4, 8 and 16 threads; the tables and JSON land in $OUT (threads.md, threads.json,
# device.md, log.txt). `kernels` instead times each kernel stage apart at those thread counts
# (stress/kernel_scaling.py, 1 GiB: about 2 minutes). `run local` does the same here with this machine's python3 and
# thread counts 1,2 (to try the script without the host).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(zstandard==0.25.0 watchfiles==1.3.0)

case "${1:-run}" in
fetch)
    mkdir -p .git/info
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >>.git/info/exclude
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"
    ls -l .whl
    ;;
run | kernels | gpuprof)
    what=$1
    out=${OUT:-$(mktemp -d)}
    counts=1,2,4,8,16
    size=2GiB
    py=python3
    if [[ "${2:-}" == local ]]; then
        counts=1,2
        size=256MiB
        py=${PYTHON:-.venv/bin/python}
    else
        "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl
        export PYTHONPATH=/tmp/site
    fi
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    exec > >(tee "$out/log.txt") 2>&1
    echo "cores: $(nproc)  python: $("$py" -V 2>&1)"
    "$py" - <<'EOF'
import subprocess, sys, sysconfig
from pathlib import Path
src = Path("asyncsync/codec/_native.c")
so = src.with_name("_native" + sysconfig.get_config_var("EXT_SUFFIX"))
if not so.exists() or so.stat().st_mtime < src.stat().st_mtime:
    inc = sysconfig.get_paths()["include"]
    subprocess.run(["cc", "-O3", "-shared", "-fPIC", f"-I{inc}", str(src), "-o", str(so)],
                   check=True)
from asyncsync.codec import native
print("native kernels:", native.kernels is not None, so)
import torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available())
sys.exit(0 if native.kernels is not None else 1)
EOF
    if [[ "$what" == run ]] && "$py" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
        timeout 120 "$py" -m asyncsync bench --device cuda --scale-sizes 1GiB \
            --markdown "$out/device.md" || echo "bench --device failed: rc=$?"
    fi
    if [[ "$what" == gpuprof ]]; then  # the CUDA tests, the device check, then the profile
        timeout 150 "$py" -m pytest -q -p no:cacheprovider tests/test_memory.py \
            tests/test_engines.py -k "cuda or host" 2>&1 | tail -15 || echo "pytest: rc=$?"
        timeout 150 "$py" -m asyncsync bench --device cuda --scale-sizes 1GiB \
            --markdown "$out/device.md" || echo "bench --device failed: rc=$?"
        timeout 240 "$py" stress/device_profile.py --size 1GiB | tee "$out/device_profile.md"
        exit 0
    fi
    if [[ "$what" == kernels ]]; then  # each kernel stage apart (stress/kernel_scaling.py)
        timeout 300 "$py" stress/kernel_scaling.py --threads "$counts" --model-mib 1024 \
            --json "$out/kernels.json" | tee "$out/kernels.md"
        exit 0
    fi
    timeout 420 "$py" -m asyncsync.ops.bench.threads --threads "$counts" --size "$size" \
        --json "$out/threads.json" | tee "$out/threads.md"
    echo "results in $out"
    ;;
*)
    echo "usage: $0 fetch | run [local] | kernels [local] | gpuprof" >&2
    exit 2
    ;;
esac
