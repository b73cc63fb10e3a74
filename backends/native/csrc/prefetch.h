/* Asking for the next keys and values of a decode task while it works on these ones, a slice at a time.
 *
 * A decode step reads the whole KV cache once, from memory, and its blocks are scattered over the cache, so the
 * hardware prefetcher, which follows one address stream, has barely started by the end of one. Each request
 * occupies one of the core's few line-fill buffers until memory answers; asked for all at once (a 16-key block
 * is 32 to 128 lines of keys and values), the requests past those buffers stall the instructions behind them,
 * and a block's arithmetic waited on the next block's memory (asked at once, two to four blocks ahead were 2-10%
 * slower than one). The decode kernels spread the requests over their work instead (64 x 512 keys, 30 layers, interleaved A/B on the Xeon: the tile kernel 1.12x faster in bf16 and
 * 1.23x in fp8, the vector kernel 1.07x in fp32 and 1.09x in bf16; decode_attention_amx.c and paged_attention.c
 * say where they ask). */
#pragma once

#include <stdint.h>

struct prefetch {
    const char *k, *v; /* the keys and values asked for; NULL: none */
    int64_t at, bytes; /* asked for up to `at` of `bytes` */
};

/* The lines of `bytes` of keys at k and values at v, none asked for yet. */
static inline struct prefetch prefetch_lines(const void *k, const void *v, int64_t bytes) {
    return (struct prefetch){(const char *)k, (const char *)v, 0, bytes};
}

/* Ask for up to `lines` more lines of the keys and as many of the values. */
static inline void prefetch_slice(struct prefetch *p, int64_t lines) {
    if (!p->k) return;
    for (; lines > 0 && p->at < p->bytes; lines--, p->at += 64) {
        __builtin_prefetch(p->k + p->at);
        __builtin_prefetch(p->v + p->at);
    }
}

/* Ask for all the lines not asked for yet. */
static inline void prefetch_rest(struct prefetch *p) { prefetch_slice(p, (p->bytes - p->at + 63) / 64); }
