#!/usr/bin/env bash
# The GPU checks and speed runs of the decode issue, in the order a short device session
# wants them: correctness first, then where the time goes, then the headline speed.
#
#   bash bench/device_checks.sh checks   # check_device (kernels, experts, fused, paths; TF32 off) (~7 min)
#   bash bench/device_checks.sh speed    # kernel_times (ncu, 4 layers), 43-layer decode at 128 and 4096,
#                                        # the stream's phases at 4096, research (~9 min)
#   bash bench/device_checks.sh all
#
# Each run's output also goes to $OUT/<name>.txt when $OUT is set (the device machine's
# folder that comes back), so a run cut short by its time limit still reports what it did.
# Each step has its own time limit: one that hangs leaves the others their time.
set -uo pipefail
cd "$(dirname "$0")/.."

step() {
    local name=$1 limit=$2
    shift 2
    echo "=== $name ($*)"
    if [ -n "${OUT:-}" ]; then
        timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"
    else
        timeout "$limit" "$@" 2>&1
    fi
    echo "=== $name: exit ${PIPESTATUS[0]}"
}

checks() {
    step kernels 240 env MLX_ENABLE_TF32=0 python3 bench/check_device.py --parts kernels experts fused
    step paths 300 env MLX_ENABLE_TF32=0 python3 bench/check_device.py --parts paths
}

speed() {
    step kernel_times 150 python3 bench/kernel_times.py --layers 4 --steps 2
    step decode43 200 python3 bench/bench_model.py --in-memory --layers 43 --prompt 128 4096 --steps 16
    step stream_phases 150 python3 bench/stream_phases.py --layers 43 --context 4096 --steps 32
    step research 150 python3 bench/check_device_research.py
}

case "${1:-all}" in
    checks) checks ;;
    speed) speed ;;
    all) checks; speed ;;
    *) echo "usage: $0 [checks|speed|all]" >&2; exit 2 ;;
esac
