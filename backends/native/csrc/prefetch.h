/* Asking for the next keys and values of a decode task while it works on these ones, a slice at a time.
 *
 * A decode step reads the whole KV cache once, from memory, and its blocks are scattered over the cache, so the
 * hardware prefetcher, which follows one address stream, has barely started by the end of one. Each request
 * occupies one of the core's few line-fill buffers until memory answers; asked for all at once (a 16-key block
 * is 32 to 128 lines of keys and values), the requests past those buffers stall the instructions behind them,
 * and a block's arithmetic waited on the next block's memory. The decode kernels spread the requests over their
 * work instead (decode_attention_amx.c and paged_attention.c say where they ask). */
#pragma once

#include <stdint.h>

struct prefetch {
    const char *k, *v; /* the keys and values asked for; NULL: none */
    int64_t at, bytes; /* asked for up to `at` of `bytes` */
    int to_l2;         /* ask for them into L2 (prefetcht1), else into L1 */
};

/* Where the lines go: into L1 on Intel, where that was measured (above); into L2 on AMD Zen, where requests into L1
 * held its few L1 miss buffers as well (docs/performance.md, "Measurements behind the code"). */
static inline int prefetch_to_l2(void) {
    static int amd = -1; /* racing threads ask twice: harmless */
    if (amd < 0) amd = __builtin_cpu_is("amd");
    return amd;
}

/* The lines of `bytes` of keys at k and values at v, none asked for yet. */
static inline struct prefetch prefetch_lines(const void *k, const void *v, int64_t bytes) {
    return (struct prefetch){(const char *)k, (const char *)v, 0, bytes, prefetch_to_l2()};
}

/* Ask for up to `lines` more lines of the keys and as many of the values. */
static inline void prefetch_slice(struct prefetch *p, int64_t lines) {
    if (!p->k) return;
    for (; lines > 0 && p->at < p->bytes; lines--, p->at += 64) {
        if (p->to_l2) {
            __builtin_prefetch(p->k + p->at, 0, 2);
            __builtin_prefetch(p->v + p->at, 0, 2);
        } else {
            __builtin_prefetch(p->k + p->at);
            __builtin_prefetch(p->v + p->at);
        }
    }
}

/* Ask for all the lines not asked for yet. */
static inline void prefetch_rest(struct prefetch *p) { prefetch_slice(p, (p->bytes - p->at + 63) / 64); }
