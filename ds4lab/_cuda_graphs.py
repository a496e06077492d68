"""How much MLX CUDA puts into one CUDA graph, set before MLX makes its first stream.

MLX CUDA records launches into a CUDA graph and commits it (instantiates or updates it,
launches it) once the graph holds MLX_MAX_OPS_PER_BUFFER launches (100 on an H100/H200) or
once the inputs of its launches, each counted whole at every launch that takes it, pass
MLX_MAX_MB_PER_BUFFER (1000 MB there). The q2 model's routed-expert tensors are 0.55-0.7 GB
each, three a layer (gate, up, down: ~1.8 GB), so a 43-layer decode step committed ~86
graphs of ~6 launches. Each commit is cheap on the encoding thread (~7 µs, `bench/launch_inputs.py`), but
MLX's evaluation lets at most 10 committed graphs wait for the device (`MAX_ACTIVE_TASKS`)
before it blocks, so the thread that encodes step n + 1 could run only ~5 layers ahead of the
device. At 12000 MB a graph closes every ~7 layers (~80 launches, under the launch limit),
still at the same launch every step (the one whose expert tensor crosses the limit, so
MLX's cached graphs keep being updated rather than rebuilt), and the encoder can run a step
ahead. Measured on an H100 (34 layers
at 4096 tokens, `bench_model.py`, processes alternating in one call, 2026-12-05): the greedy
stream at 1000 MB 111.6-114.8 tok/s, at 3000 124.2, 6000 118.7-130.1, 12000 123.6-127.9,
24000 129.3.

Only on Linux, where MLX runs on CUDA or the CPU (the CPU backend reads neither limit); on
macOS the same variable sizes Metal's command buffers, which this leaves to MLX. A value the
user set is kept. MLX reads it once, when it makes its first GPU stream: import ds4lab before
using MLX on the GPU.
"""

from __future__ import annotations

import os
import sys

GRAPH_MB = 12000


def set_graph_limits() -> None:
    """MLX_MAX_MB_PER_BUFFER = GRAPH_MB on Linux, unless already set."""
    if sys.platform.startswith("linux"):
        os.environ.setdefault("MLX_MAX_MB_PER_BUFFER", str(GRAPH_MB))
