/* A sampling profiler that needs nothing on the machine but ptrace: stops one thread of a
 * running process (PTRACE_INTERRUPT) every millisecond, reads its instruction pointer and
 * scans the top of its stack for return addresses into executable mappings, then lets it go.
 * cuda-gdb, the only debugger on the H200 machine, loads the CUDA debugger into the process
 * and slows it until the stream stalls; this does not.
 *
 *   pc_sampler PID TID SAMPLES > samples.txt
 *
 * Each output line is one sample: the pc, then the stack's candidate return addresses,
 * each as path+0xOFFSET (the offset into the file), innermost first. `fold_pc_samples.py`
 * turns them into function counts with the libraries' symbol tables. Stack scanning (no
 * frame pointers in these libraries) also finds stale return addresses: read the inclusive
 * counts as an upper bound. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ptrace.h>
#include <sys/uio.h>
#include <sys/user.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAX_MAPS 4096
#define STACK_WORDS 512

struct map { uint64_t lo, hi, off; char path[256]; };
static struct map maps[MAX_MAPS];
static int n_maps;

static void read_maps(int pid) {
    char name[64], line[512];
    snprintf(name, sizeof name, "/proc/%d/maps", pid);
    FILE *f = fopen(name, "r");
    if (!f) { perror(name); exit(1); }
    while (fgets(line, sizeof line, f) && n_maps < MAX_MAPS) {
        struct map m = {0};
        char perms[8] = {0};
        if (sscanf(line, "%lx-%lx %7s %lx %*s %*s %255s", &m.lo, &m.hi, perms, &m.off, m.path) >= 4
            && perms[2] == 'x' && m.path[0] == '/')
            maps[n_maps++] = m;
    }
    fclose(f);
}

static const struct map *find(uint64_t a) {
    for (int i = 0; i < n_maps; i++)
        if (a >= maps[i].lo && a < maps[i].hi) return &maps[i];
    return NULL;
}

static void put(uint64_t a) {
    const struct map *m = find(a);
    if (m) printf(" %s+0x%lx", m->path, a - m->lo + m->off);
}

int main(int argc, char **argv) {
    if (argc != 4) { fprintf(stderr, "usage: %s PID TID SAMPLES\n", argv[0]); return 2; }
    int pid = atoi(argv[1]), tid = atoi(argv[2]), samples = atoi(argv[3]);
    read_maps(pid);
    if (ptrace(PTRACE_SEIZE, tid, 0, 0) != 0) { perror("PTRACE_SEIZE"); return 1; }
    struct timespec gap = {0, 1000000};
    for (int s = 0; s < samples; s++) {
        int status;
        if (ptrace(PTRACE_INTERRUPT, tid, 0, 0) != 0) { perror("PTRACE_INTERRUPT"); break; }
        if (waitpid(tid, &status, __WALL) < 0) { perror("waitpid"); break; }
        struct user_regs_struct regs;
        if (ptrace(PTRACE_GETREGS, tid, 0, &regs) == 0) {
            uint64_t words[STACK_WORDS];
            struct iovec local = {words, sizeof words}, remote = {(void *)regs.rsp, sizeof words};
            ssize_t got = process_vm_readv(pid, &local, 1, &remote, 1, 0);
            printf("S");
            put(regs.rip);
            for (ssize_t i = 0; i < got / 8; i++) put(words[i]);
            printf("\n");
        }
        ptrace(PTRACE_CONT, tid, 0, 0);
        nanosleep(&gap, NULL);
    }
    ptrace(PTRACE_DETACH, tid, 0, 0);
    return 0;
}
