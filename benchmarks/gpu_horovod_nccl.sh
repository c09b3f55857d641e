#!/usr/bin/env bash
# Runs the cluster file's GPU recipe for Horovod (cluster/config.py, _horovod_commands) on a
# machine with an NVIDIA GPU, then checks that the build's allreduce runs on the GPU through NCCL.
# For a GPU node, or a lent GPU machine with no network: put the Horovod sdist in
# HOROVOD_SDIST (pip download --no-deps --no-binary :all: horovod==0.28.1 fetches it elsewhere).
#
# Usage: benchmarks/gpu_horovod_nccl.sh [ACCELERATOR]   (default nvidia-h100-80gb: Hopper, 9.0)
# Prints each step's time; writes the build log to ${OUT:-/tmp}/horovod-build.log.
set -uo pipefail
cd "$(dirname "$0")/.."
accelerator="${1:-nvidia-h100-80gb}"
out="${OUT:-/tmp}"
py="$(command -v python3)"
t0=$SECONDS
step() { echo "[$((SECONDS - t0)) s] $*"; }

step "machine: $(nvidia-smi -L 2>&1 | head -1); cores $(nproc); $(g++ --version | head -1)"
step "nvcc: $(/usr/local/cuda/bin/nvcc --version 2>&1 | tail -1); cmake: $(/usr/bin/cmake --version 2>/dev/null | head -1 || true) / $(cmake --version 2>/dev/null | head -1)"
"$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.is_available() and torch.cuda.get_device_name())'

# The recipe names `python` (a node's venv); a machine with only python3 gets a shim.
if ! command -v python >/dev/null; then
  mkdir -p /tmp/pyshim && ln -sf "$py" /tmp/pyshim/python && export PATH="/tmp/pyshim:$PATH"
fi
# No PyPI: the sdist and its one build requirement (cffi) from the sdist's folder.
[ -z "${HOROVOD_SDIST:-}" ] || export HOROVOD_SDIST="$(realpath "$HOROVOD_SDIST")" PIP_NO_INDEX=1 PIP_FIND_LINKS="$(dirname "$(realpath "$HOROVOD_SDIST")")"

recipe="$(PYTHONPATH=. "$py" -c "import sys; from cluster.config import _horovod_commands; print(_horovod_commands(sys.argv[1])[-1])" "$accelerator")" || exit 1
recipe="${recipe/cd ~\/launcher/cd $PWD}"
step "recipe: $recipe"
nccl="$(python -c 'import importlib.util as u; s = u.find_spec("nvidia") and u.find_spec("nvidia.nccl"); print(list(s.submodule_search_locations)[0] if s else "")')"
step "NCCL wheel at '${nccl}': $(ls "$nccl/lib" 2>&1 | tr '\n' ' ')"
[ -n "$nccl" ] || step "libnccl.so.2 found elsewhere: $(find / -name 'libnccl.so*' -not -path '/proc/*' 2>/dev/null | head -5 | tr '\n' ' ')"

XDG_CACHE_HOME=/tmp/hvdcache bash -c "$recipe"
rc=$?
cp /tmp/hvdcache/launcher/logs/horovod-build.log "$out/" 2>/dev/null
step "recipe exit $rc"
[ $rc = 0 ] || { tail -n 40 /tmp/hvdcache/launcher/logs/horovod-build.log; exit 1; }

lib="$("$py" -c 'import horovod.torch.mpi_lib_v2 as m; print(m.__file__)')"
step "built: $lib; links: $(ldd "$lib" | grep -E 'nccl|cudart' | tr -s ' \t' ' ' | tr '\n' ';')"
"$py" - <<'EOF'
import time
import torch
import horovod.torch as hvd

hvd.init()
assert hvd.nccl_built(), "Horovod was built without NCCL"
torch.cuda.set_device(hvd.local_rank())
x = torch.arange(8, dtype=torch.float32, device="cuda")
y = hvd.allreduce(x, op=hvd.Sum, name="check")
assert y.is_cuda and torch.equal(y.cpu(), x.cpu() * hvd.size()), y
big = torch.ones(64 << 20, device="cuda")  # 256 MiB of float32
hvd.allreduce(big, name="warm")
torch.cuda.synchronize()
start = time.perf_counter()
for i in range(10):
    hvd.allreduce(big, name=f"big{i}")
torch.cuda.synchronize()
per = (time.perf_counter() - start) / 10
import horovod
print(f"horovod {horovod.__version__} on {torch.cuda.get_device_name()}: nccl_built={hvd.nccl_built()} size={hvd.size()} "
      f"allreduce of 256 MiB on the GPU in {per * 1e3:.2f} ms (one rank: the NCCL path end to end, not a bandwidth)")
EOF
step "done"
