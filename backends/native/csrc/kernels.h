/* The kernels step_layers.c runs in sequence (defined in layer_ops.c, tile_linear.c, strip_linear.c,
 * paged_attention.c, decode_attention_amx.c and prefill_attention_amx.c, where their contracts are written
 * down). `kv_format` is how the KV cache stores keys and values: fp8.h's enum kv_format. */
#pragma once

#include <stdint.h>

/* Up to this many rows tile_linear streams the weight (4 A tiles per B tile); more take its blocked path, where
 * the rounding pass can add into the residual stream or do SwiGLU (step_layers.c). TILE_ROWS in
 * linear_kernels.py, up to which weights that are not a tile layout's only copy read the tiles at all, is the same. */
#define STREAM_ROWS 64

int add_rms_norm(void *x, void *residual, const void *weight, void *out, int64_t rows, int64_t hidden, float eps,
                 int is_bf16);
int silu_and_mul(const void *x, void *out, int64_t rows, int64_t d, int is_bf16);
int rotary_store_kv(void *qkv, int64_t stride, const float *cos, const float *sin, void *k_cache, void *v_cache,
                    const int64_t *slot_mapping, int64_t tokens, int64_t num_heads, int64_t num_kv_heads,
                    int64_t head_dim, int64_t cache_slots, int is_bf16, int kv_format);
int tile_linear(const uint16_t *x, const void *w_tiles, const void *scales, uint16_t *out, int64_t m, int64_t n,
                int64_t k, int w_int8, int scales_bf16);
int tile_linear_silu_mul(const uint16_t *x, const void *w_tiles, const void *scales, uint16_t *out, int64_t m,
                         int64_t half, int64_t k, int w_int8, int scales_bf16);
int tile_linear_add(const uint16_t *x, const void *w_tiles, const void *scales, uint16_t *residual, int64_t m,
                    int64_t n, int64_t k, int w_int8, int scales_bf16);
int strip_linear(const float *x, const float *w_strips, float *out, int64_t m, int64_t n, int64_t k);
int paged_decode_attention(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                           const int64_t *block_tables, int64_t table_stride, const int64_t *context_lens, void *out,
                           int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t num_blocks,
                           int64_t block_size, int64_t head_dim, float scale, int is_bf16, int kv_format);
int paged_decode_attention_amx(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                               const int64_t *block_tables, int64_t table_stride, const int64_t *context_lens,
                               void *out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                               int64_t num_blocks, int64_t block_size, int64_t head_dim, float scale, int is_bf16,
                               int kv_format);
int paged_prefill_attention(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                            const int64_t *block_tables, int64_t table_stride, const int64_t *query_starts,
                            const int64_t *query_lens, const int64_t *context_lens, void *out, int64_t num_seqs,
                            int64_t num_heads, int64_t num_kv_heads, int64_t num_blocks, int64_t block_size,
                            int64_t head_dim, float scale, int is_bf16, int kv_format);
int paged_prefill_attention_amx(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                                const int64_t *block_tables, int64_t table_stride, const int64_t *query_starts,
                                const int64_t *query_lens, const int64_t *context_lens, void *out, int64_t num_seqs,
                                int64_t num_heads, int64_t num_kv_heads, int64_t num_blocks, int64_t block_size,
                                int64_t head_dim, float scale, int is_bf16, int kv_format);
