#!/usr/bin/env bash
# A sampling profiler for the decode stream's host threads, from what the H200 machine has
# (no nsys, no perf, no py-spy; cuda-gdb there loads the CUDA debugger into the process and
# stalls the stream): runs `stream_phases.py` in the background and, once it is decoding,
# samples its threads' states (`thread_states.py`), then the pcs and stacks of its two
# busiest threads (`pc_sampler.c`, built here with cc) and counts their functions
# (`fold_pc_samples.py`). The thread other than the main one is the worker encoding each step
# (`mx.async_eval`): its counts say where the encoding's ~11 µs a primitive go.
#
#   OUT=dir bash bench/sample_stacks.sh [samples] [seconds before looking] [stream_phases args...]
set -uo pipefail
cd "$(dirname "$0")/.."
samples=${1:-3000}
warm=${2:-60}
shift 2 || true
out=${OUT:-/tmp/stacks}
mkdir -p "$out"
sampler=${PC_SAMPLER:-$out/pc_sampler}   # PC_SAMPLER: a prebuilt one, where there is no cc
[ -x "$sampler" ] || cc -O2 -o "$sampler" bench/pc_sampler.c || exit 1
python3 bench/stream_phases.py --steps 100000 "$@" > "$out/stream.txt" 2>&1 &
pid=$!
sleep "$warm"
# Then wait for the stream itself: two threads busy (the generator building, the worker
# encoding). Before it, a new process compiles its ~50 kernels with NVRTC on one thread
# (1.5-2 minutes on the H200 machine), and samples taken then show only the compiler.
for _ in $(seq 1 90); do
    busy=$(python3 bench/thread_states.py "$pid" --seconds 2 |
           awk '/^thread/ {cpu = $4; sub("%", "", cpu); if (cpu + 0 >= 50) n++} END {print n + 0}')
    [ "$busy" -ge 2 ] && break
done
python3 bench/thread_states.py "$pid" --seconds 3 | tee "$out/thread_states.txt"
busiest=$(awk '/^thread/ {sub(":", "", $2); print $2}' "$out/thread_states.txt" | head -2)
for tid in $busiest; do
    role=worker
    [ "$tid" = "$pid" ] && role=main
    "$sampler" "$pid" "$tid" "$samples" > "$out/pcs_$role.txt"
    echo "=== $role thread ($tid)"
    python3 bench/fold_pc_samples.py "$out/pcs_$role.txt" --top 40
done
kill "$pid"
[ -z "${PC_SAMPLER:-}" ] && rm -f "$sampler"
