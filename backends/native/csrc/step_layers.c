/* Every decoder layer of a CPU step in one call: the CPU's counterpart of a CUDA graph.
 *
 * A decode step's time should be its weights' bytes from memory; run layer by layer from Python it also paid for
 * hundreds of kernel calls through ctypes, each with its tensor allocations and Python frames, while the other
 * OpenMP threads wait (fused_step.py). Here the same kernels run in the same order on the same buffers (so the step's results
 * are bit for bit the eager path's), called from C: per layer RMSNorm (+ residual), the fused q/k/v projection,
 * rotary embedding and the KV-cache write, attention (decodes, then prefill chunks), the output projection,
 * RMSNorm (+ residual), gate/up and SiLU-and-mul, down. Linear layers read their small-step copies, AMX tiles
 * (bf16 or int8 weights, bf16 activations) or AVX-512 strips (fp32); tile layouts that are a weight's only copy
 * (bf16 or int8) also serve larger steps on the tile kernel's blocked path, which adds the output and down
 * projections into the residual stream and computes SwiGLU in its rounding pass (as Linear.with_residual and
 * GateUpLinear.silu_and_mul do). The embedding lookup, the final norm and the LM head stay in Python
 * (fused_step.py), once per step. Built by cpu_kernels.py.
 */

#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

/* One layer's weights and KV cache, as fused_step.py lays them out (NULL for a missing bias or scales). */
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
    int32_t amx_prefill; /* prefill chunks on prefill_attention_amx.c, else paged_attention.c's vector kernel */
    int32_t kv_format;   /* how the KV cache stores keys and values (fp8.h) */
};

/* Per-step buffers: on entry hidden [rows, hidden] holds the embeddings and residual [rows, hidden] is free; on
 * return hidden holds the last layer's output and residual the residual stream beside it, or (blocked steps)
 * residual holds their sum, the layers' output. The rest is scratch (gate_up unused by blocked steps). */
struct step_buffers {
    void *hidden, *residual, *qkv, *attn, *gate_up, *act;
};

/* The step's tokens: rotary tables [rows, head_dim / 2] for their positions and their cache slots; the first
 * num_decodes rows decode one token each (block tables in rows of decode_table_stride, context lengths), the
 * num_prefills chunks after them are the last query_lens[i] of context_lens[i] positions of their sequences
 * (query_starts counted from the first prefill row). */
struct step_tokens {
    const float *cos, *sin;
    const int64_t *slot_mapping;
    int64_t num_decodes, decode_table_stride;
    const int64_t *decode_tables, *decode_context_lens;
    int64_t num_prefills, prefill_table_stride;
    const int64_t *prefill_tables, *prefill_query_starts, *prefill_query_lens, *prefill_context_lens;
};

#define RUN(call) do { const int rc = (call); if (rc) return rc; } while (0)

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

/* Attention of every row into out [rows, num_heads * head_dim], as CpuAttention.forward runs it. */
static int attention(const struct step_shape *s, const struct step_tokens *t, const struct layer_weights *w,
                     const void *qkv, int64_t qkv_size, void *out) {
    const int64_t nd = t->num_decodes, size = s->is_bf16 ? 2 : 4, q_size = s->num_heads * s->head_dim;
    if (nd)
        RUN(paged_decode_attention(qkv, qkv_size, w->k_cache, w->v_cache, t->decode_tables, t->decode_table_stride,
                                   t->decode_context_lens, out, nd, s->num_heads, s->num_kv_heads, s->num_blocks,
                                   s->block_size, s->head_dim, s->scale, s->is_bf16, s->kv_format));
    if (t->num_prefills)
        RUN((s->amx_prefill ? paged_prefill_attention_amx : paged_prefill_attention)(
            (const char *)qkv + nd * qkv_size * size, qkv_size, w->k_cache, w->v_cache, t->prefill_tables,
            t->prefill_table_stride, t->prefill_query_starts, t->prefill_query_lens, t->prefill_context_lens,
            (char *)out + nd * q_size * size, t->num_prefills, s->num_heads, s->num_kv_heads, s->num_blocks,
            s->block_size, s->head_dim, s->scale, s->is_bf16, s->kv_format));
    return 0;
}

/* Run every layer; returns 0, or nonzero as soon as a kernel refuses its layout (fused_step.py checks the
 * layout up front, and raises if one does: the KV cache and the buffers are written by then). */
int step_layers(const struct layer_weights *layers, int64_t num_layers, const struct step_shape *s,
                const struct step_buffers *b, const struct step_tokens *t) {
    const int64_t q_size = s->num_heads * s->head_dim, kv_size = s->num_kv_heads * s->head_dim;
    const int64_t qkv_size = q_size + 2 * kv_size, hidden_bytes = s->rows * s->hidden * (s->is_bf16 ? 2 : 4);
    const int blocked = s->weight_kind != FP32_STRIPS && s->rows > STREAM_ROWS, int8 = s->weight_kind == INT8_TILES;
    memcpy(b->residual, b->hidden, hidden_bytes); /* the residual stream starts as the embeddings */
    for (int64_t l = 0; l < num_layers; l++) {
        const struct layer_weights *w = &layers[l];
        if (blocked) /* the stream holds the sum already: the norm only normalises */
            RUN(add_rms_norm(b->residual, NULL, w->input_norm, b->hidden, s->rows, s->hidden, s->eps, s->is_bf16));
        else
            RUN(add_rms_norm(b->hidden, l ? b->residual : NULL, w->input_norm, b->hidden, s->rows, s->hidden, s->eps,
                             s->is_bf16));
        RUN(linear(s, b->hidden, w->qkv, w->qkv_scales, w->qkv_bias, b->qkv, qkv_size, s->hidden));
        RUN(rotary_store_kv(b->qkv, qkv_size, t->cos, t->sin, w->k_cache, w->v_cache, t->slot_mapping, s->rows,
                            s->num_heads, s->num_kv_heads, s->head_dim, s->num_blocks * s->block_size, s->is_bf16,
                            s->kv_format));
        RUN(attention(s, t, w, b->qkv, qkv_size, b->attn));
        if (blocked) {
            RUN(tile_linear_add(b->attn, w->o, w->o_scales, b->residual, s->rows, s->hidden, q_size, int8,
                                s->scales_bf16));
            RUN(add_rms_norm(b->residual, NULL, w->post_norm, b->hidden, s->rows, s->hidden, s->eps, s->is_bf16));
            RUN(tile_linear_silu_mul(b->hidden, w->gate_up, w->gate_up_scales, b->act, s->rows, s->intermediate,
                                     s->hidden, int8, s->scales_bf16));
            RUN(tile_linear_add(b->act, w->down, w->down_scales, b->residual, s->rows, s->hidden, s->intermediate,
                                int8, s->scales_bf16));
        } else {
            RUN(linear(s, b->attn, w->o, w->o_scales, NULL, b->hidden, s->hidden, q_size));
            RUN(add_rms_norm(b->hidden, b->residual, w->post_norm, b->hidden, s->rows, s->hidden, s->eps,
                             s->is_bf16));
            RUN(linear(s, b->hidden, w->gate_up, w->gate_up_scales, NULL, b->gate_up, 2 * s->intermediate,
                       s->hidden));
            RUN(silu_and_mul(b->gate_up, b->act, s->rows, s->intermediate, s->is_bf16));
            RUN(linear(s, b->act, w->down, w->down_scales, NULL, b->hidden, s->hidden, s->intermediate));
        }
    }
    return 0;
}
