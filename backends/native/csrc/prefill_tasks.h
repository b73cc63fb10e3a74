/* How the prefill attention kernels split a step's work: one task per (tile of up to `tile` query tokens of
 * one sequence, KV head), numbered tile-major over the sequences in order, so consecutive tasks share a
 * sequence's keys. Shared by paged_attention.c (vector) and prefill_attention_amx.c (tiles). */
#pragma once

#include <stdint.h>

struct prefill_task {
    int64_t seq, head;     /* the sequence and its KV head */
    int64_t first_q, nq;   /* the tile's first query token (counted within the sequence's chunk) and count */
};

/* Tiles of `tile` query tokens over all sequences (times the KV heads: the task count). */
static inline int64_t prefill_tiles(const int64_t *query_lens, int64_t num_seqs, int64_t tile) {
    int64_t tiles = 0;
    for (int64_t s = 0; s < num_seqs; s++) tiles += (query_lens[s] + tile - 1) / tile;
    return tiles;
}

static inline struct prefill_task prefill_task(int64_t task, const int64_t *query_lens, int64_t num_kv_heads,
                                               int64_t tile) {
    struct prefill_task t = {.seq = 0, .head = task % num_kv_heads};
    int64_t t0 = task / num_kv_heads;
    while (t0 >= (query_lens[t.seq] + tile - 1) / tile) t0 -= (query_lens[t.seq++] + tile - 1) / tile;
    t.first_q = t0 * tile;
    t.nq = query_lens[t.seq] - t.first_q < tile ? query_lens[t.seq] - t.first_q : tile;
    return t;
}
