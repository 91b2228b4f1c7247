#pragma once
#include <stdint.h>

/* fn(ctx, share, shares): do share `share` (0-based) of `shares` equal parts of a job. */
typedef void (*share_fn)(void *ctx, int share, int shares);

int pool_start(int workers);          /* start workers beside the caller; returns how many run */
void pool_run(share_fn fn, void *ctx); /* run fn on the caller and every worker, each its own share */
