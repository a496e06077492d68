#!/usr/bin/env bash
# The GPU checks and speed runs of the decode issue, in the order a short device session
# wants them: correctness first, then where the time goes, then the headline speed.
#
#   bash bench/device_checks.sh checks   # check_device (kernels, experts, fused, paths; TF32 off) (~7 min)
#   bash bench/device_checks.sh speed    # kernel_times (ncu, 4 layers), 43-layer decode at 128 and 4096,
#                                        # the stream's phases at 4096, an A/B of the HC input, research (~12 min)
#   bash bench/device_checks.sh split    # a 43-layer step's device time apart from its host encoding (one
#                                        # CUDA graph a step), the stream's host threads sampled, then ncu's
#                                        # sections for the slowest kernels (~20 min, over several calls:
#                                        # each new process first compiles ~50 kernels with NVRTC, 1-2 min)
#   bash bench/device_checks.sh graphs   # the 43-layer stream at 4096 tokens under larger MLX graph commits
#                                        # (MLX_MAX_MB_PER_BUFFER 500, 1000 (the default), 3000; then one
#                                        # graph a step; ~5 min)
#   bash bench/device_checks.sh geometry # a step's device time under the expert kernels' and q8_hc's
#                                        # geometry constants (device_time_ab.py), then ncu's warp
#                                        # stalls by instruction for q8_hc's tail (~8 min)
#   bash bench/device_checks.sh merged   # the merged launches (routed_swiglu, q8_pair with q_b and with the
#                                        # compressor update, q8_hc with output_a or the head's input,
#                                        # compressor_pool with the rows finished) against the launches
#                                        # they replace, then fast vs reference and the research checks,
#                                        # then each merge's stream A/B at 4096 (~25 min: `merged checks`,
#                                        # `merged paths`, `merged speed router q_b`, `merged speed
#                                        # output_a compressor_slot head`)
#   bash bench/device_checks.sh stream   # the research checks (a greedy stream straight after a prefill among
#                                        # them), then the issue's 43-layer bench at 128 and 4096 with the
#                                        # stream in 3 rounds of 64 steps (~6 min), then the .ptx_cache
#                                        # with MLX's own kernels added, back as $OUT/ptx_cache.tgz
#   bash bench/device_checks.sh profile  # where a 43-layer step's device time goes at 4096: ncu per kernel (4
#                                        # layers, base clock), then the step's device time without the
#                                        # routed experts' gate/up launch and without compressor_slot (one
#                                        # CUDA graph a step, each kernel priced in place), then a launch's
#                                        # read of a small input by where MLX put it (~4 min)
#   bash bench/device_checks.sh commits  # the issue's bench at 4096 as it is; then, under MLX's graph limits raised
#                                        # past a step, the greedy stream handing each step over in pieces
#                                        # (`Model.stream_commits`) against one piece, in one process, and
#                                        # the bench with the pieces (~8 min)
#   bash bench/device_checks.sh planes   # the IQ2_XXS gate and up on the input's byte planes against floats, two calls:
#                                        # `planes checks` (check_device's planes part: bars, the launches'
#                                        # times; then the bench on floats), `planes speed` (the step's device
#                                        # time with and without them, the stream A/B) (~6 min each); or
#                                        # `planes quick`, the bars and the device time only (~4 min)
#   bash bench/device_checks.sh launches # the issue's bench at 4096 with MLX's CUDA graphs, then with each kernel
#                                        # launched on the stream (MLX_USE_CUDA_GRAPHS=0), then with graphs
#                                        # again (the host's drift over the call) (~7 min)
#   bash bench/device_checks.sh host     # what a launch, an input and a commit cost MLX's encoding thread
#                                        # (launch_inputs.py), the greedy stream's log-prob made on the
#                                        # device against the row's (stream_ab.py), the bench with ds4lab's
#                                        # 12000 MB graphs against 1000 and 6000, the research checks (~6 min)
#   bash bench/device_checks.sh bar      # the issue's 43-layer bench at 128 and 4096 as ds4lab sets it up, then
#                                        # at 4096 under MLX graph limits of 1000, 24000 and 12000 MB, then the
#                                        # research checks (~5 min)
#   bash bench/device_checks.sh warm     # every kernel variant of a 43-layer run compiled into .ptx_cache
#                                        # (bench/warm_kernels.py; ~4 min on 2 cores, so best made on
#                                        # the CPU machine and carried)
#   bash bench/device_checks.sh all      # checks, then speed
#
# With a .ptx_cache folder (made by `warm`) MLX finds the kernels compiled there instead of
# compiling each at its first launch (1.5-2 minutes of every new process otherwise).
# Each run's output also goes to $OUT/<name>.txt when $OUT is set (the device machine's
# folder that comes back), so a run cut short by its time limit still reports what it did.
# Each step has its own time limit: one that hangs leaves the others their time.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -d .ptx_cache ]; then export MLX_PTX_CACHE_DIR="$PWD/.ptx_cache"; fi
# A kernel's text goes to MLX as an #include of a file in $DS4LAB_CACHE/kernels
# (`kernels.kernel_texts`), and MLX's key of the compiled module is that text's hash: the
# cache path must be the same where `warm` fills .ptx_cache and where the runs read it.
export DS4LAB_CACHE="${DS4LAB_CACHE:-$PWD/.ds4lab_cache}"
# The issue's bench: the 43-layer model in memory, the greedy stream in 3 rounds of 64 steps
# (the contexts, `--prompt`, follow).
ISSUE_BENCH=(python3 bench/bench_model.py --in-memory --layers 43 --steps 64 --rounds 3)

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
    step kernels 330 env MLX_ENABLE_TF32=0 python3 bench/check_device.py --parts kernels experts fused
    step paths 300 env MLX_ENABLE_TF32=0 python3 bench/check_device.py --parts paths
}

speed() {
    step kernel_times 240 python3 bench/kernel_times.py --layers 4 --steps 2
    step decode43 200 python3 bench/bench_model.py --in-memory --layers 43 --prompt 128 4096 --steps 16
    step stream_phases 150 python3 bench/stream_phases.py --layers 43 --context 4096 --steps 32
    step stream_ab 200 python3 bench/stream_ab.py --layers 43 --context 4096 --steps 16 --rounds 5
    step research 150 python3 bench/check_device_research.py
}

host_and_device() {
    # With one CUDA graph a step (committed only when its encoding ends) the wait after the
    # encoding is the step's whole device time; beside it the default commits (the device
    # starting while the host encodes). Which of the two bounds the stream decides between
    # fewer launches and faster kernels.
    step one_graph 300 env MLX_MAX_OPS_PER_BUFFER=1000000 MLX_MAX_MB_PER_BUFFER=100000000 \
        python3 bench/step_costs.py --layers 43 --context 4096 --chain 0
    step default_graphs 300 python3 bench/step_costs.py --layers 43 --context 4096 --chain 0
    step profile 480 bash bench/sample_stacks.sh 3000 60 --layers 43 --context 4096
    for kernel in attention_heads routed_swiglu hc_pre; do
        step "details_$kernel" 240 python3 bench/kernel_times.py --layers 4 --context 4096 --steps 2 --details "$kernel"
    done
}

graph_commits() {
    # MLX commits a CUDA graph whenever the inputs it has counted pass MLX_MAX_MB_PER_BUFFER
    # (1000 MB on an H200), each routed-expert tensor (0.5-0.7 GB) counted whole: about once or
    # twice a layer, each commit a graph update and launch on the host, and its eval waits for
    # the device once 10 are outstanding. Larger limits commit every few layers, still at the
    # same places every step (so MLX's cache of graphs keeps hitting; a limit by operations
    # alone moves the boundaries from step to step: 2026-12-04, 80.7 tok/s against 84.8).
    for mb in 500 1000 3000; do
        step "graphs_mb$mb" 200 env MLX_MAX_MB_PER_BUFFER=$mb \
            python3 bench/bench_model.py --in-memory --layers 43 --prompt 4096 --steps 16
    done
    # One graph a step: encoded in ~6 ms where the default commits take 10.5-13.6 (2026-12-04),
    # but nothing of a step runs on the device until its encoding ends. The greedy stream
    # encodes step n + 1 while the device runs step n, so this may leave the device the bound.
    step graphs_one_per_step 200 env MLX_MAX_OPS_PER_BUFFER=1000000 MLX_MAX_MB_PER_BUFFER=100000000 \
        python3 bench/bench_model.py --in-memory --layers 43 --prompt 4096 --steps 16
}

geometry() {
    # Rows a warp of the expert kernels (the input's L1 reads against the weights'), row sets a
    # block of q8_hc with the next input (its tail's threads): each against the code as it is.
    step geometry_ab 330 python3 bench/device_time_ab.py --layers 43 --context 4096 \
        --variants base _Q8_HC_GROUPS=1 _SWIGLU_ROWS=1,_MATVEC_ROWS=2
    # Where the tail's cycles go: ncu's stall samples by instruction (the launch's last block).
    step q8_hc_stalls 240 python3 bench/kernel_times.py --layers 4 --context 4096 --steps 2 \
        --details q8_hc_4096_8192 --launches 1 --sections SourceCounters WarpStateStats
}

merged() {
    # The five steps that can run in the launch of another (2026-12-05 on the H200: the same
    # bits; only the head's merge by default, `model.DEFAULT_MERGED`): their bars first (each
    # against its two launches), then the paths and the research checks, then each merge's
    # stream against its two launches in one process. One call each (a call may run 10 minutes: `merged speed router q_b`, then
    # `merged speed output_a compressor_slot head`).
    local part="${1:-checks}"
    shift || true
    case "$part" in
        checks) step fused 420 env MLX_ENABLE_TF32=0 python3 bench/check_device.py --parts fused ;;
        paths)
            step paths 300 env MLX_ENABLE_TF32=0 python3 bench/check_device.py --parts paths
            step research 200 python3 bench/check_device_research.py ;;
        speed)
            local variants=("$@")
            [ ${#variants[@]} -gt 0 ] || variants=(router q_b output_a compressor_slot head)
            for variant in "${variants[@]}"; do
                step "ab_$variant" 180 python3 bench/stream_ab.py --layers 43 --context 4096 --steps 16 \
                    --rounds 3 --variant "$variant"
            done ;;
    esac
}

profile() {
    step kernel_times 240 python3 bench/kernel_times.py --layers 4 --context 4096 --steps 2
    step in_place 300 python3 bench/device_time_ab.py --layers 43 --context 4096 \
        --variants base without:expert_swiglu without:compressor_slot base
    step small_inputs 120 python3 bench/small_inputs.py
}

commits() {
    # MLX commits a CUDA graph whenever the inputs it has counted pass MLX_MAX_MB_PER_BUFFER
    # (1000 MB on an H200, each routed-expert tensor counted whole): about twice a layer, ~86
    # commits a step, each a graph update, launch and teardown on the host (the encoding
    # worker's samples: 29% under cudaGraphDestroy, 2026-12-05). One graph a step encodes in
    # 4-5 ms where those take 10-13, but the device then starts only when the whole step is
    # encoded. Pieces: the device starts on the first layers while the rest is encoded, and
    # each piece is committed at the same place every step (MLX's graph cache keeps hitting).
    local bench=("${ISSUE_BENCH[@]}" --prompt 4096)
    local one_graph=(env MLX_MAX_OPS_PER_BUFFER=1000000 MLX_MAX_MB_PER_BUFFER=100000000)
    local layers=(1 3 7 14 26)
    step commits_default 150 "${bench[@]}"
    step commits_ab 200 "${one_graph[@]}" python3 bench/stream_ab.py --variant commits --commits "${layers[@]}" \
        --steps 32 --rounds 4
    step commits_bench 150 "${one_graph[@]}" "${bench[@]}" --commits "${layers[@]}"
}

planes() {
    # The IQ2_XXS gate and up on the FFN input's byte planes (`Model.expert_planes`, the
    # default) against floats, in two calls (a call may run 10 minutes): `planes checks`, the
    # kernels' bars and times and fast vs reference with them, then the issue's bench on
    # floats; `planes speed`, the step's device time with and without them (one CUDA graph a
    # step; one output row a warp too), then the stream A/B in one process.
    case "${1:-checks}" in
        checks)
            step planes_checks 300 env MLX_ENABLE_TF32=0 python3 bench/check_device.py --parts planes
            step floats_bench 150 "${ISSUE_BENCH[@]}" --prompt 4096 --float-experts ;;
        quick)      # for a short budget: the bars, then the step's device time (~4 min)
            step planes_checks 300 env MLX_ENABLE_TF32=0 python3 bench/check_device.py --parts planes
            step planes_in_place 200 python3 bench/device_time_ab.py --layers 43 --context 4096 \
                --variants floats base floats ;;
        speed)
            step planes_in_place 300 python3 bench/device_time_ab.py --layers 43 --context 4096 \
                --variants floats base _SWIGLU_ROWS=1 floats,_SWIGLU_ROWS=1 floats
            step planes_ab 200 python3 bench/stream_ab.py --variant planes --steps 32 --rounds 4 ;;
    esac
}

stream() {
    step research 200 python3 bench/check_device_research.py
    step decode43 280 "${ISSUE_BENCH[@]}" --prompt 128 4096
    pack_kernels
}

launches() {
    # A graph node costs MLX's encoding thread its add, its share of the graph's update and
    # launch, and its destruction (29% of that thread's samples under cudaGraphDestroy,
    # 2026-12-05); a launch on the stream costs only the launch. The sixteenth session's run
    # without graphs encoded a step in 7.4 ms against 14 and left the device behind (89.4
    # tok/s against 84.8); since then the device's step fell from ~10 ms to ~8.7 and the
    # worker thread encodes while the next step is built.
    local bench=("${ISSUE_BENCH[@]}" --prompt 4096)
    step launches_graphs 200 "${bench[@]}"
    step launches_direct 200 env MLX_USE_CUDA_GRAPHS=0 "${bench[@]}"
    step launches_graphs_again 160 "${bench[@]}"
}

bench_limits() {
    # The issue's bench at 4096 once under each MLX_MAX_MB_PER_BUFFER given, in that order
    # (alternate processes: the host drifts over a call); each step named <name>_mb<limit>_<n>.
    local name=$1 round=0 mb
    shift
    for mb in "$@"; do
        round=$((round + 1))
        step "${name}_mb${mb}_$round" 100 env MLX_MAX_MB_PER_BUFFER="$mb" "${ISSUE_BENCH[@]}" --prompt 4096
    done
}

host() {
    # At MLX's MLX_MAX_MB_PER_BUFFER (1000 MB) a decode step commits ~86 CUDA graphs (each
    # routed-expert tensor counted whole), and MLX lets only 10 wait for the device, so the
    # encoder ran ~5 layers ahead of it; ds4lab now sets 12000 (a graph every ~7 layers, at the
    # same launch every step; H100, 34 layers: +8-12%). Here on the 43-layer model against
    # 1000 and 6000, after the launch and commit prices and the log-prob A/B.
    step launch_inputs 90 python3 bench/launch_inputs.py --inputs 1 4 16 32 --big-every 6
    step logprob_ab 200 python3 bench/stream_ab.py --variant logprob --steps 32 --rounds 4
    bench_limits bench 12000 1000 12000 6000      # 12000: ds4lab's default (ds4lab/_cuda_graphs.py)
    step research 200 python3 bench/check_device_research.py
}

bar() {
    # The issue's bar first: the 43-layer bench at 128 and 4096 tokens under ds4lab's own
    # settings, then at 4096 with MLX's graph limit at 1000 (its default), 24000 and 12000
    # again in alternate processes (the host's drift over the call), then the research checks.
    step bar 150 "${ISSUE_BENCH[@]}" --prompt 128 4096
    bench_limits bar 1000 24000 12000
    step research 200 python3 bench/check_device_research.py
}

pack_kernels() {
    # MLX's own kernels (the fused elementwise ones of each compiled sublayer, its reductions
    # and sorts) compile with NVRTC on a new machine's first process, one at a time: the
    # first 43-layer bench of a call took ~4 minutes where the same one took 20 s after it
    # (2026-12-05). They land in the .ptx_cache as cubins beside the ones `warm` made; this
    # hands the folder back (one file, $OUT/ptx_cache.tgz) to unpack here and carry next time.
    if [ -n "${OUT:-}" ] && [ -d .ptx_cache ]; then
        tar czf "$OUT/ptx_cache.tgz" .ptx_cache && ls -l "$OUT/ptx_cache.tgz"
    fi
}
case "${1:-all}" in
    checks) checks ;;
    speed) speed ;;
    split) host_and_device ;;
    graphs) graph_commits ;;
    geometry) geometry ;;
    merged) shift; merged "$@" ;;
    stream) stream ;;
    profile) profile ;;
    commits) commits ;;
    planes) shift; planes "$@" ;;
    launches) launches ;;
    host) host ;;
    bar) bar ;;
    warm) step warm 900 python3 bench/warm_kernels.py --cache .ptx_cache ;;
    all) checks; speed ;;
    *) echo "usage: $0 [checks|speed|split|graphs|geometry|merged [checks|paths|speed]|stream|profile|commits|planes [checks|speed|quick]|launches|host|bar|warm|all]" >&2
       exit 2 ;;
esac
