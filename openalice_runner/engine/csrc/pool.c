/* A tiny persistent thread pool for the kernels, instead of OpenMP.

   Why not OpenMP: libgomp keeps one worker pool per thread that ever opened a parallel region
   (the main thread, torch's threads, the engine's scheduler thread, a server's worker threads).
   Once those pools together hold more threads than there are CPUs, libgomp stops spinning
   between regions and wakes its workers through the kernel: about 70 us per region, here 120
   regions per forward pass. This pool belongs to the kernels alone: its workers spin for a
   short while between calls (decode calls come every few microseconds) and then sleep.

   One caller at a time uses the workers; a second concurrent caller runs its work inline. */
#define _GNU_SOURCE
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include <immintrin.h>

#include "pool.h"

#define MAX_WORKERS 63
#define SPIN_NS 2000000 /* spin this long for the next call before sleeping */

static int n_workers;
static pthread_t threads[MAX_WORKERS];
static pthread_mutex_t caller = PTHREAD_MUTEX_INITIALIZER;
static _Atomic uint32_t generation;
static _Atomic int finished;
static _Atomic int sleepers;
static share_fn job_fn;
static void *job_ctx;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void *worker(void *arg) {
    int share = (int)(intptr_t)arg;
    uint32_t seen = atomic_load(&generation);
    for (;;) {
        int64_t start = now_ns();
        int spins = 0;
        while (atomic_load_explicit(&generation, memory_order_acquire) == seen) {
            _mm_pause();
            if (++spins % 256 == 0 && now_ns() - start > SPIN_NS) {
                atomic_fetch_add(&sleepers, 1);
                if (atomic_load(&generation) == seen)
                    syscall(SYS_futex, &generation, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
                atomic_fetch_sub(&sleepers, 1);
                start = now_ns();
            }
        }
        seen = atomic_load(&generation);
        job_fn(job_ctx, share, n_workers + 1);
        atomic_fetch_add_explicit(&finished, 1, memory_order_release);
    }
    return NULL;
}

int pool_start(int workers) {
    if (workers > MAX_WORKERS) workers = MAX_WORKERS;
    for (; n_workers < workers; n_workers++)
        if (pthread_create(&threads[n_workers], NULL, worker, (void *)(intptr_t)(n_workers + 1)) != 0) break;
    return n_workers;
}

void pool_run(share_fn fn, void *ctx) {
    if (n_workers == 0 || pthread_mutex_trylock(&caller) != 0) {
        fn(ctx, 0, 1);
        return;
    }
    job_fn = fn;
    job_ctx = ctx;
    atomic_store(&finished, 0);
    atomic_fetch_add_explicit(&generation, 1, memory_order_release);
    if (atomic_load(&sleepers) > 0) syscall(SYS_futex, &generation, FUTEX_WAKE_PRIVATE, MAX_WORKERS, NULL, NULL, 0);
    fn(ctx, 0, n_workers + 1);
    while (atomic_load_explicit(&finished, memory_order_acquire) < n_workers) _mm_pause();
    pthread_mutex_unlock(&caller);
}
