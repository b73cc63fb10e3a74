/* How the prefill attention kernels split a step's work: one task per (tile of up to `tile` query tokens of
 * one sequence, KV head), numbered tile-major over the sequences in order (a tile's KV heads one after the
 * other), so a run of tasks covers a run of the step's tokens. Shared by paged_attention.c (vector) and prefill_attention_amx.c (tiles). */
#pragma once

#include <omp.h>
#include <stdint.h>

struct prefill_task {
    int64_t seq, head;     /* the sequence and its KV head */
    int64_t first_q, nq;   /* the tile's first query token (counted within the sequence's chunk) and count */
};

/* Task number `task`: its sequence, KV head and query tile. */
static inline struct prefill_task prefill_task(int64_t task, const int64_t *query_lens, int64_t num_kv_heads,
                                               int64_t tile) {
    struct prefill_task t = {.seq = 0, .head = task % num_kv_heads};
    int64_t t0 = task / num_kv_heads;
    while (t0 >= (query_lens[t.seq] + tile - 1) / tile) t0 -= (query_lens[t.seq++] + tile - 1) / tile;
    t.first_q = t0 * tile;
    t.nq = query_lens[t.seq] - t.first_q < tile ? query_lens[t.seq] - t.first_q : tile;
    return t;
}

/* What a query tile costs: its steps of `step` keys (its last token sees them all), plus `fixed`, its other work. */
static inline int64_t prefill_tile_cost(const int64_t *query_lens, const int64_t *context_lens, int64_t s, int64_t q0,
                                        int64_t tile, int64_t step, int64_t fixed) {
    const int64_t keys = context_lens[s] - query_lens[s] + (q0 + tile < query_lens[s] ? q0 + tile : query_lens[s]);
    return (keys + step - 1) / step + fixed;
}

/* The calling OpenMP thread's tasks [*first, *end): a run of them in token order, of about equal cost
 * (prefill_tile_cost). So a thread reads mostly its own sequences' keys, and, where cost spreads evenly over the
 * tokens (prompts of one length, as in a burst), writes about the output rows that the next matmul, which splits
 * rows evenly, reads on the same core; a dynamic schedule interleaved both between the cores. SmolLM2's 4 x
 * 512-token step on the tiles: attention 1.2 -> 0.95 ms per layer, the fp32 vector kernel 3% faster. */
static inline void prefill_share(const int64_t *query_lens, const int64_t *context_lens, int64_t num_seqs,
                                 int64_t num_kv_heads, int64_t tile, int64_t step, int64_t fixed, int64_t *first,
                                 int64_t *end) {
    const int64_t me = omp_get_thread_num(), threads = omp_get_num_threads();
    int64_t total = 0;
    for (int64_t s = 0; s < num_seqs; s++)
        for (int64_t q0 = 0; q0 < query_lens[s]; q0 += tile)
            total += prefill_tile_cost(query_lens, context_lens, s, q0, tile, step, fixed) * num_kv_heads;
    const int64_t from = total * me / threads, to = total * (me + 1) / threads;
    int64_t cost = 0, task = 0;
    *first = -1;
    for (int64_t s = 0; s < num_seqs; s++)
        for (int64_t q0 = 0; q0 < query_lens[s]; q0 += tile) {
            const int64_t each = prefill_tile_cost(query_lens, context_lens, s, q0, tile, step, fixed);
            for (int64_t h = 0; h < num_kv_heads; h++, task++) {
                if (cost >= from && *first < 0) *first = task;
                if (cost >= to) {
                    *end = task;
                    if (*first < 0) *first = task;
                    return;
                }
                cost += each;
            }
        }
    if (*first < 0) *first = task;
    *end = task;
}
