#!/usr/bin/env bash
# The GPU check, for the day a CUDA machine is at hand: in at most 10 minutes, the tests that mean something only
# on a GPU (marked `gpu`), the mesh / device / calibrate tests, `hybridpar calibrate` on one GPU, the spatial demo
# on the GPU(s) (checked against one process) and a short spatial benchmark; then a summary. Every step has its
# own time limit, and the steps together stay inside BUDGET_S.
#
#     bash benchmarks/gpu_check.sh                 # from the repository root, its .venv (or PYTHON=...) in place
#     GPU_CHECK_OUT=/tmp/gpu bash benchmarks/gpu_check.sh   # keep the logs and the cluster TOML there
#
# Exit status: 0 when every step passed, 1 when one failed or ran out of time, 2 when torch sees no CUDA GPU
# (nothing is run then). Logs: one file per step in $GPU_CHECK_OUT (default: a fresh directory under /tmp).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-.venv/bin/python}
[[ -x $PY ]] || PY=python3
BUDGET_S=${BUDGET_S:-590}  # the whole check, start-up included; under 10 minutes

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    about=$("$PY" -c 'import torch; print(f"torch {torch.__version__}, CUDA build {torch.version.cuda}")' \
            2>/dev/null || echo "torch cannot be imported by $PY")
    echo "gpu_check: no CUDA GPU is available to torch ($about): nothing was run." >&2
    echo "gpu_check: run it on a machine with a CUDA GPU, from the repository root, with .venv (or PYTHON=...)." >&2
    exit 2
fi

OUT=${GPU_CHECK_OUT:-$(mktemp -d -t gpu_check.XXXXXX)}
mkdir -p "$OUT"
NAMES=()
VERDICTS=()
FAILED=0

# step NAME LIMIT_S COMMAND...: COMMAND under `timeout` (LIMIT_S, or what is left of BUDGET_S), its output on the
# terminal and in $OUT/NAME.log; the outcome goes to the summary.
step() {
    local name=$1 limit=$2 rc=0 start=$SECONDS verdict
    shift 2
    local left=$((BUDGET_S - SECONDS))
    ((limit <= left)) || limit=$left
    if ((limit < 15)); then
        NAMES+=("$name") VERDICTS+=("SKIPPED: the ${BUDGET_S} s budget is spent")
        FAILED=1
        return
    fi
    echo
    echo "== $name (at most ${limit} s): $*"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log" || rc=$?
    case $rc in
        0) verdict="passed" ;;
        124 | 137) verdict="TIMED OUT after ${limit} s" FAILED=1 ;;
        *) verdict="FAILED (exit $rc)" FAILED=1 ;;
    esac
    NAMES+=("$name") VERDICTS+=("$verdict, $((SECONDS - start)) s")
}

step gpus 20 "$PY" -c '
import torch
nccl = ".".join(map(str, torch.cuda.nccl.version()))
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, NCCL {nccl}")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i}: {p.name}, {p.total_memory / 2**30:.1f} GiB, compute capability {p.major}.{p.minor}")
'
NUM_GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())')

# the tests that need a GPU (marked gpu), then the fast ones of meshes, accelerators and calibrate, which on this
# machine take the CUDA path (build_mesh, accelerator_type, calibrate's device selection)
step gpu-tests 90 "$PY" -m pytest tests -m gpu -rs -p no:cacheprovider
step mesh-tests 120 "$PY" -m pytest tests -m "not slow and not gpu" -k "mesh or accelerator or calibrat" -rs \
    -p no:cacheprovider

# calibrate on one GPU, quick: compute on cuda:0 (CUDA events), communication between 2 CPU workers (no second
# GPU in the launch); the TOML must say what was measured and load
step calibrate 150 "$PY" -m hybridpar calibrate --quick --nproc 1 --out "$OUT/cluster.toml" --overwrite
step calibrate-spec 20 "$PY" -c '
import pathlib, sys
from hybridpar.plan.io import load_cluster
path = sys.argv[1]
header = [line for line in pathlib.Path(path).read_text().splitlines() if line.startswith("# measured: ")]
assert header and "(cuda, nccl)" in header[0], path + ": its header lacks the line # measured: ... (cuda, nccl)"
spec = load_cluster(path)
tflops = spec.peak_flops["float32"] / 1e12
print(header[0][2:], "|", spec.name, f"| matmul {tflops:.1f} TFLOP/s float32",
      f"| memory {spec.memory_bandwidth / 1e9:.0f} GB/s | {spec.device_memory / 2**30:.1f} GiB")
' "$OUT/cluster.toml"

# spatial parallelism on the GPU, checked against one process (float64): halos between 2 GPUs where there are
# 2 (NCCL), else the spatial layers on one GPU (a 1x1x1 grid: no halo)
if ((NUM_GPUS >= 2)); then GRID=2,1,1; else GRID=1,1,1; fi
step spatial-demo 60 "$PY" -m hybridpar demo --dp 1 --spatial "$GRID" --steps 2

# the spatial benchmark, quick (32^3): it runs CPU ranks on gloo (benchmarks/spatial.py has no device option)
step spatial-benchmark 120 "$PY" benchmarks/spatial.py --quick

echo
echo "== gpu_check summary ($SECONDS s in all; logs and cluster.toml in $OUT)"
for i in "${!NAMES[@]}"; do
    printf '  %-18s %s\n' "${NAMES[$i]}" "${VERDICTS[$i]}"
done
exit "$FAILED"
