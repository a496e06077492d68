"""Samples the threads of a running process from /proc, without stopping it: per thread, its
CPU time (user and system) over the window, how often it was running, and, when it was not,
in which system call it waited (futex: a lock or a condition; ioctl: the GPU driver).
`bench/sample_stacks.sh` runs it on the decode stream before its stack samples: if the
encoding worker is running nearly always, its ~11 µs a primitive are CPU work; if it sleeps
in futex, it waits on a lock or on the device.

    python bench/thread_states.py PID [--seconds 5] [--top 6]
"""

from __future__ import annotations

import argparse
import os
import time
from collections import Counter, defaultdict
from pathlib import Path

SYSCALLS = {0: "read", 1: "write", 7: "poll", 16: "ioctl", 24: "sched_yield", 35: "nanosleep", 202: "futex",
            230: "clock_nanosleep", 232: "epoll_wait", 281: "epoll_pwait", 271: "ppoll"}


def cpu_ticks(task: Path) -> tuple[str, int, int]:
    """(state, user ticks, system ticks) of a thread, from its stat line."""
    fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
    return fields[0], int(fields[11]), int(fields[12])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pid", type=int)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--top", type=int, default=6)
    args = parser.parse_args()
    tasks = sorted(Path(f"/proc/{args.pid}/task").iterdir())
    start = {t.name: cpu_ticks(t)[1:] for t in tasks}
    states: dict[str, Counter] = defaultdict(Counter)
    waits: dict[str, Counter] = defaultdict(Counter)
    n, end = 0, time.monotonic() + args.seconds
    while time.monotonic() < end:
        for t in tasks:
            try:
                state = cpu_ticks(t)[0]
                states[t.name][state] += 1
                if state != "R":
                    nr = (t / "syscall").read_text().split()[0]
                    waits[t.name][SYSCALLS.get(int(nr), nr) if nr.lstrip("-").isdigit() else nr] += 1
            except (OSError, IndexError):
                continue
        n += 1
        time.sleep(0.0005)
    hz = os.sysconf("SC_CLK_TCK")
    rows = []
    for t in tasks:
        try:
            _, user, system = cpu_ticks(t)
        except OSError:
            continue
        u0, s0 = start[t.name]
        rows.append(((user - u0 + system - s0) / hz / args.seconds, (user - u0) / hz / args.seconds,
                     (system - s0) / hz / args.seconds, t.name))
    print(f"{n} samples over {args.seconds:.1f} s")
    for cpu, user, system, name in sorted(rows, reverse=True)[:args.top]:
        running = states[name]["R"] / max(1, sum(states[name].values()))
        top_waits = ", ".join(f"{k} {v / n:.0%}" for k, v in waits[name].most_common(4))
        print(f"thread {name}: CPU {cpu:.0%} (user {user:.0%}, system {system:.0%}), running in {running:.0%} "
              f"of samples; waiting in: {top_waits}")


if __name__ == "__main__":
    main()
