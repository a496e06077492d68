/* Work split in contiguous ranges between threads, the calling thread taking the first. A
 * range's results never depend on the split: each kernel computes every item of its range
 * on its own. */
#ifndef DS4LAB_PARALLEL_H
#define DS4LAB_PARALLEL_H

#include <pthread.h>
#include <stdint.h>

#define MAX_THREADS 16

typedef void (*range_fn)(void *ctx, int64_t begin, int64_t end);

typedef struct {
    range_fn fn;
    void *ctx;
    int64_t begin, end;
} range_job_t;

static void *run_range(void *arg) {
    const range_job_t *job = (const range_job_t *)arg;
    job->fn(job->ctx, job->begin, job->end);
    return 0;
}

/* fn(ctx, begin, end) over [0, n) in up to n_threads ranges; a thread that cannot start
 * has its range run by the caller. */
static void parallel_ranges(range_fn fn, void *ctx, int64_t n, int n_threads) {
    if (n_threads < 1) n_threads = 1;
    if (n_threads > MAX_THREADS) n_threads = MAX_THREADS;
    if (n_threads > n) n_threads = (int)n;
    if (n_threads <= 1) {
        if (n > 0) fn(ctx, 0, n);
        return;
    }
    range_job_t jobs[MAX_THREADS];
    pthread_t threads[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int i = 0; i < n_threads; i++) jobs[i] = (range_job_t){fn, ctx, n * i / n_threads, n * (i + 1) / n_threads};
    for (int i = 1; i < n_threads; i++) started[i] = pthread_create(&threads[i], 0, run_range, &jobs[i]) == 0;
    run_range(&jobs[0]);
    for (int i = 1; i < n_threads; i++) {
        if (started[i]) pthread_join(threads[i], 0);
        else run_range(&jobs[i]);
    }
}

#endif
