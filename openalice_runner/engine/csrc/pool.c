/* A tiny persistent thread pool for the kernels, instead of OpenMP.

   Why not OpenMP: libgomp keeps one worker pool per thread that ever opened a parallel region
   (the main thread, torch's threads, the engine's scheduler thread, a server's worker threads).
   Once those pools together hold more threads than there are CPUs, libgomp stops spinning
   between regions and wakes its workers through the kernel: about 70 us per region, here 120
   regions per forward pass. This pool belongs to the kernels alone: its workers spin for a
   short while between calls (decode calls come every few microseconds) and then sleep.

   One caller at a time uses the workers; a second concurrent caller runs its work inline.

   Shares are claimed, not assigned: the caller and each worker take the next unclaimed share until
   none is left, and the caller waits only for shares another thread took. On a loaded machine (a CI
   run, a container's CPU quota) a worker may not be scheduled for milliseconds; with a share of its
   own, every call waited for it (a prefill pass of 120 calls took seconds whatever its rows, issue 49).
   Now the caller runs that share itself. A share's work and its bits do not depend on which thread
   runs it: every job still splits into the same `n_workers + 1` shares. */
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
static _Atomic uint32_t generation; /* bumped for every job: what sleeping workers wait on */
/* the job's number (high 32 bits) and its next unclaimed share (low 32): a claim is one CAS on both,
   so a worker that read an older job's function can never claim a share of a newer one */
static _Atomic uint64_t ticket;
static _Atomic int done; /* shares of the current job that have run */
static _Atomic int sleepers;
static _Atomic(share_fn) job_fn;
static _Atomic(void *) job_ctx;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Run unclaimed shares of the current job until none is left. */
static void claim_shares(void) {
    const int shares = n_workers + 1;
    uint64_t t = atomic_load_explicit(&ticket, memory_order_acquire);
    while ((int)(uint32_t)t < shares) {
        share_fn fn = atomic_load_explicit(&job_fn, memory_order_relaxed);
        void *ctx = atomic_load_explicit(&job_ctx, memory_order_relaxed);
        /* success means the job is the one whose fn and ctx were read: it cannot end, nor another
           start, while a share is unclaimed */
        if (atomic_compare_exchange_weak_explicit(&ticket, &t, t + 1, memory_order_acq_rel, memory_order_acquire)) {
            fn(ctx, (int)(uint32_t)t, shares);
            atomic_fetch_add_explicit(&done, 1, memory_order_release);
            t = atomic_load_explicit(&ticket, memory_order_acquire);
        }
    }
}

static void *worker(void *arg) {
    (void)arg;
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
        claim_shares();
    }
    return NULL;
}

int pool_start(int workers) {
    if (workers > MAX_WORKERS) workers = MAX_WORKERS;
    for (; n_workers < workers; n_workers++)
        if (pthread_create(&threads[n_workers], NULL, worker, NULL) != 0) break;
    return n_workers;
}

void pool_run(share_fn fn, void *ctx) {
    if (n_workers == 0 || pthread_mutex_trylock(&caller) != 0) {
        fn(ctx, 0, 1);
        return;
    }
    atomic_store_explicit(&job_fn, fn, memory_order_relaxed);
    atomic_store_explicit(&job_ctx, ctx, memory_order_relaxed);
    atomic_store_explicit(&done, 0, memory_order_relaxed);
    /* a new job number, share 0 next: publishes fn, ctx and done (every share of the last job ran) */
    const uint64_t job = (atomic_load_explicit(&ticket, memory_order_relaxed) >> 32) + 1;
    atomic_store_explicit(&ticket, job << 32, memory_order_release);
    atomic_fetch_add_explicit(&generation, 1, memory_order_release);
    if (atomic_load(&sleepers) > 0) syscall(SYS_futex, &generation, FUTEX_WAKE_PRIVATE, MAX_WORKERS, NULL, NULL, 0);
    claim_shares();
    while (atomic_load_explicit(&done, memory_order_acquire) < n_workers + 1) _mm_pause();
    pthread_mutex_unlock(&caller);
}
