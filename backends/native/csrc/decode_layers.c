/* Every decoder layer of a small decode step in one call: the CPU's counterpart of a CUDA graph.
 *
 * One decoded token of SmolLM2 reads ~270 MB of weights, ~10 ms at this machine's memory bandwidth; run
 * layer by layer from Python, the same step took ~14 ms: ~300 kernel calls through ctypes, each with its
 * tensor allocations and Python frames. Here the same kernels run in the same order on the same buffers
 * (so the step's results are bit for bit the eager path's), called from C: per layer RMSNorm (+ residual),
 * the fused q/k/v projection, rotary embedding and the KV-cache write, decode attention, the output
 * projection, RMSNorm + residual, gate/up, SiLU-and-mul, down. Linear layers read their small-step copies:
 * AMX tiles (bf16 or int8 weights, bf16 activations) or AVX-512 strips (fp32). The embedding lookup, the
 * final norm and the LM head stay in Python (fused_decode.py), once per step. Built by cpu_kernels.py.
 */

#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

/* One layer's weights and KV cache, as fused_decode.py lays them out (NULL for a missing bias or scales). */
struct layer_weights {
    const void *input_norm, *post_norm;
    const void *qkv, *qkv_scales, *qkv_bias;
    const void *o, *o_scales;
    const void *gate_up, *gate_up_scales;
    const void *down, *down_scales;
    void *k_cache, *v_cache;
};

enum weight_kind { BF16_TILES = 0, INT8_TILES = 1, FP32_STRIPS = 2 };

/* The step's shape and the model's constants. */
struct step_shape {
    int64_t rows, hidden, num_heads, num_kv_heads, head_dim, intermediate;
    int64_t num_blocks, block_size; /* of the caches: blocks (scratch block included) and their size */
    float eps, scale;
    int32_t is_bf16, weight_kind, scales_bf16;
};

/* Per-step buffers: hidden [rows, hidden] holds the embeddings on entry and the last layer's output on
 * return, residual [rows, hidden] the residual stream beside it; the rest is scratch. */
struct step_buffers {
    void *hidden, *residual, *qkv, *attn, *gate_up, *act;
};

/* The step's tokens: rotary tables [rows, head_dim / 2] for their positions, their cache slots, and the
 * decode attention's block tables (rows of table_stride) and context lengths. */
struct step_tokens {
    const float *cos, *sin;
    const int64_t *slot_mapping, *block_tables, *context_lens;
    int64_t table_stride;
};

static int linear(const struct step_shape *s, const void *x, const void *w, const void *scales, const void *bias,
                  void *out, int64_t n, int64_t k) {
    const int rc = s->weight_kind == FP32_STRIPS
        ? strip_linear(x, w, out, s->rows, n, k)
        : tile_linear(x, w, scales, out, s->rows, n, k, s->weight_kind == INT8_TILES, s->scales_bf16);
    if (rc || !bias) return rc;
    for (int64_t r = 0; r < s->rows; r++) { /* as torch adds a bias: in fp32, rounded to the storage type */
        for (int64_t i = 0; i < n; i++) {
            const float sum = load(out, r * n + i, s->is_bf16) + load(bias, i, s->is_bf16);
            store(out, r * n + i, sum, s->is_bf16);
        }
    }
    return 0;
}

#define RUN(call) do { const int rc = (call); if (rc) return rc; } while (0)

/* Run every layer; returns 0, or nonzero as soon as a kernel refuses its layout (fused_decode.py checks the
 * layout up front, and raises if one does: the KV cache and `hidden` are written by then). */
int decode_layers(const struct layer_weights *layers, int64_t num_layers, const struct step_shape *s,
                  const struct step_buffers *b, const struct step_tokens *t) {
    const int64_t q_size = s->num_heads * s->head_dim, kv_size = s->num_kv_heads * s->head_dim;
    const int64_t qkv_size = q_size + 2 * kv_size, hidden_bytes = s->rows * s->hidden * (s->is_bf16 ? 2 : 4);
    memcpy(b->residual, b->hidden, hidden_bytes); /* the residual stream starts as the embeddings */
    for (int64_t l = 0; l < num_layers; l++) {
        const struct layer_weights *w = &layers[l];
        RUN(add_rms_norm(b->hidden, l ? b->residual : NULL, w->input_norm, b->hidden, s->rows, s->hidden, s->eps,
                         s->is_bf16));
        RUN(linear(s, b->hidden, w->qkv, w->qkv_scales, w->qkv_bias, b->qkv, qkv_size, s->hidden));
        RUN(rotary_store_kv(b->qkv, qkv_size, t->cos, t->sin, w->k_cache, w->v_cache, t->slot_mapping, s->rows,
                            s->num_heads, s->num_kv_heads, s->head_dim, s->num_blocks * s->block_size, s->is_bf16));
        RUN(paged_decode_attention(b->qkv, qkv_size, w->k_cache, w->v_cache, t->block_tables, t->table_stride,
                                   t->context_lens, b->attn, s->rows, s->num_heads, s->num_kv_heads, s->num_blocks,
                                   s->block_size, s->head_dim, s->scale, s->is_bf16));
        RUN(linear(s, b->attn, w->o, w->o_scales, NULL, b->hidden, s->hidden, q_size));
        RUN(add_rms_norm(b->hidden, b->residual, w->post_norm, b->hidden, s->rows, s->hidden, s->eps, s->is_bf16));
        RUN(linear(s, b->hidden, w->gate_up, w->gate_up_scales, NULL, b->gate_up, 2 * s->intermediate, s->hidden));
        RUN(silu_and_mul(b->gate_up, b->act, s->rows, s->intermediate, s->is_bf16));
        RUN(linear(s, b->act, w->down, w->down_scales, NULL, b->hidden, s->hidden, s->intermediate));
    }
    return 0;
}
