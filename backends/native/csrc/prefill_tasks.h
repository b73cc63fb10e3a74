/* How the prefill attention kernels split a step's work: one task per (tile of up to `tile` query rows of one
 * sequence, KV head). A sequence's query rows are its query tokens times the `group` query heads of a KV head,
 * token-major (row r: token r / group, head r % group of the KV head), so a tile of rows is full whatever the
 * group (tiles of whole tokens left a row of every 16 empty at SmolLM2's group of 3). Tasks are numbered
 * tile-major over the sequences in order (a tile's KV heads one after the other), so a run of tasks covers a run
 * of the step's tokens. Shared by paged_attention.c (vector) and prefill_attention_amx.c (tiles). */
#pragma once

#include <omp.h>
#include <stdint.h>

struct prefill_task {
    int64_t seq, head;        /* the sequence and its KV head */
    int64_t first_row, rows;  /* the tile's first query row (counted within the sequence's chunk) and count */
};

/* The rows of sequence s's tile from row r0: `tile`, or fewer in its last. */
static inline int64_t prefill_tile_rows(const int64_t *query_lens, int64_t s, int64_t r0, int64_t group, int64_t tile) {
    return query_lens[s] * group - r0 < tile ? query_lens[s] * group - r0 : tile;
}

/* Task number `task`: its sequence, KV head and tile of rows. */
static inline struct prefill_task prefill_task(int64_t task, const int64_t *query_lens, int64_t num_kv_heads,
                                               int64_t group, int64_t tile) {
    struct prefill_task t = {.seq = 0, .head = task % num_kv_heads};
    int64_t t0 = task / num_kv_heads;
    while (t0 >= (query_lens[t.seq] * group + tile - 1) / tile) t0 -= (query_lens[t.seq++] * group + tile - 1) / tile;
    t.first_row = t0 * tile;
    t.rows = prefill_tile_rows(query_lens, t.seq, t.first_row, group, tile);
    return t;
}

/* The keys the tile of rows from r0 sees: its last row's token sees them all. */
static inline int64_t prefill_tile_keys(const int64_t *query_lens, const int64_t *context_lens, int64_t s, int64_t r0,
                                        int64_t rows, int64_t group) {
    return context_lens[s] - query_lens[s] + (r0 + rows - 1) / group + 1;
}

/* What a tile costs: its steps of `step` keys, plus `fixed`, its other work. */
static inline int64_t prefill_tile_cost(const int64_t *query_lens, const int64_t *context_lens, int64_t s, int64_t r0,
                                        int64_t group, int64_t tile, int64_t step, int64_t fixed) {
    const int64_t rows = prefill_tile_rows(query_lens, s, r0, group, tile);
    return (prefill_tile_keys(query_lens, context_lens, s, r0, rows, group) + step - 1) / step + fixed;
}

/* The calling OpenMP thread's tasks [*first, *end): a run of them in token order, of about equal cost
 * (prefill_tile_cost). So a thread reads mostly its own sequences' keys, and, where cost spreads evenly over the
 * tokens (prompts of one length, as in a burst), writes about the output rows that the next matmul, which splits
 * rows evenly, reads on the same core; a dynamic schedule interleaved both between the cores, and was slower. */
static inline void prefill_share(const int64_t *query_lens, const int64_t *context_lens, int64_t num_seqs,
                                 int64_t num_kv_heads, int64_t group, int64_t tile, int64_t step, int64_t fixed,
                                 int64_t *first, int64_t *end) {
    const int64_t me = omp_get_thread_num(), threads = omp_get_num_threads();
    int64_t total = 0;
    for (int64_t s = 0; s < num_seqs; s++)
        for (int64_t r0 = 0; r0 < query_lens[s] * group; r0 += tile)
            total += prefill_tile_cost(query_lens, context_lens, s, r0, group, tile, step, fixed) * num_kv_heads;
    const int64_t from = total * me / threads, to = total * (me + 1) / threads;
    int64_t cost = 0, task = 0;
    *first = -1;
    for (int64_t s = 0; s < num_seqs; s++)
        for (int64_t r0 = 0; r0 < query_lens[s] * group; r0 += tile) {
            const int64_t each = prefill_tile_cost(query_lens, context_lens, s, r0, group, tile, step, fixed);
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
