/* A whole decode step of a Llama-family decoder on the CPU, in one call: for the few sequences of a step, every
 * op between the embedding and the logits is either a pass over the weights or a few hundred floats, and issued
 * from Python each costs more than it computes (and gives up the GIL to whichever thread holds it).
 *
 * Float32 weights and activations, the model.py arithmetic op for op: RMSNorm, the fused q/k/v projection,
 * pd_decode_attention_block (rope, the K/V write into the sequence's own slot, paged attention), the output
 * projection and residual, RMSNorm, the fused gate/up projection, SiLU(gate) * up, the down projection and residual;
 * then the final RMSNorm and the LM head. Every matrix product is gemm's: each weight row read once for all
 * rows of the step, each output one dot product in a fixed order, so a sequence's logits do not depend on which
 * others share its step.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PD_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define PD_CLONES
#endif

int pd_decode_attention_block(const float *qkv, int64_t qkv_stride, const float *cos, const float *sin,
                              float *q_rot, float *out, void *cache, int dtype, int64_t num_pages,
                              int64_t page_stride, int64_t kv_stride, int64_t token_stride, int64_t head_stride,
                              int page_size, int num_kv_heads, int num_heads, int head_dim,
                              const int64_t *table, int64_t table_stride, const int64_t *lens, int batch,
                              float scale);

typedef float v8f __attribute__((vector_size(32), aligned(4))); /* 8 lanes, loaded from any float address */

static inline float hsum(v8f v) { /* the lanes in one fixed order */
    return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

/* y[m, n] = x[m, :] . w[n, :] (+ b[n]) for a tile of MR rows of x by NR weight rows (compile-time constants): MR * NR
 * accumulators of 8 lanes each, MR + NR loads for MR * NR multiply-adds. Every output is the same arithmetic whatever
 * the tile: one accumulator over k in steps of 8, its lanes summed in hsum's order, then the tail of k in order. */
#define PD_TILE(NAME, MR, NR)                                                                                   \
PD_CLONES static void NAME(const float *x, int64_t K, const float *w, const float *b, float *y, int64_t N) {    \
    const int64_t K8 = K & ~(int64_t)7;                                                                         \
    v8f acc[MR][NR];                                                                                            \
    for (int m = 0; m < MR; m++)                                                                                \
        for (int j = 0; j < NR; j++) acc[m][j] = (v8f){0};                                                      \
    for (int64_t k = 0; k < K8; k += 8) {                                                                       \
        v8f u[NR];                                                                                              \
        for (int j = 0; j < NR; j++) u[j] = *(const v8f *)(w + j * K + k);                                      \
        for (int m = 0; m < MR; m++) {                                                                          \
            const v8f xv = *(const v8f *)(x + m * K + k);                                                       \
            for (int j = 0; j < NR; j++) acc[m][j] += xv * u[j];                                                \
        }                                                                                                       \
    }                                                                                                           \
    for (int m = 0; m < MR; m++)                                                                                \
        for (int j = 0; j < NR; j++) {                                                                          \
            float s = hsum(acc[m][j]);                                                                          \
            for (int64_t k = K8; k < K; k++) s += x[m * K + k] * w[j * K + k];                                  \
            y[m * N + j] = b ? s + b[j] : s;                                                                    \
        }                                                                                                       \
}
/* 16 vector registers (AVX2): 4 x 3 accumulators, 3 weight vectors and one of x */
#define TILE_M 4
#define TILE_N 3
PD_TILE(tile_1x1, 1, 1)
PD_TILE(tile_1x2, 1, 2)
PD_TILE(tile_1x3, 1, 3)
PD_TILE(tile_2x1, 2, 1)
PD_TILE(tile_2x2, 2, 2)
PD_TILE(tile_2x3, 2, 3)
PD_TILE(tile_3x1, 3, 1)
PD_TILE(tile_3x2, 3, 2)
PD_TILE(tile_3x3, 3, 3)
PD_TILE(tile_4x1, 4, 1)
PD_TILE(tile_4x2, 4, 2)
PD_TILE(tile_4x3, 4, 3)

typedef void (*tile_fn)(const float *, int64_t, const float *, const float *, float *, int64_t);
static const tile_fn TILE[TILE_M + 1][TILE_N + 1] = {
    {0, 0, 0, 0},
    {0, tile_1x1, tile_1x2, tile_1x3},
    {0, tile_2x1, tile_2x2, tile_2x3},
    {0, tile_3x1, tile_3x2, tile_3x3},
    {0, tile_4x1, tile_4x2, tile_4x3},
};

/* y [M, N] = x [M, K] w^T (+ b), contiguous rows, M of any size. Weight rows are taken TILE_N at a time (a few KiB,
 * they stay in L1) and run against every row of x before the next: each weight row is read from memory once per
 * call, however many sequences share the step. */
static void gemm(const float *x, int M, int64_t K, const float *w, const float *b, float *y, int64_t N) {
    for (int64_t n = 0; n < N; n += TILE_N) {
        const int nr = N - n < TILE_N ? (int)(N - n) : TILE_N;
        for (int m = 0; m < M; m += TILE_M) {
            const int mr = M - m < TILE_M ? M - m : TILE_M;
            TILE[mr][nr](x + (int64_t)m * K, K, w + n * K, b ? b + n : NULL, y + (int64_t)m * N + n, N);
        }
    }
}

PD_CLONES static void rms_norm(const float *x, const float *w, float eps, float *y, int M, int64_t D) {
    for (int m = 0; m < M; m++) {
        const float *r = x + m * D;
        float ss = 0.0f;
        for (int64_t i = 0; i < D; i++) ss += r[i] * r[i];
        const float inv = 1.0f / sqrtf(ss / (float)D + eps);
        for (int64_t i = 0; i < D; i++) y[m * D + i] = w[i] * (r[i] * inv);
    }
}

PD_CLONES static void add(float *x, const float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] += y[i];
}

/* act[m, i] = silu(gu[m, i]) * gu[m, I + i] */
PD_CLONES static void silu_mul(const float *gu, float *act, int M, int64_t I) {
    for (int m = 0; m < M; m++)
        for (int64_t i = 0; i < I; i++) {
            const float g = gu[m * 2 * I + i];
            act[m * I + i] = g / (1.0f + expf(-g)) * gu[m * 2 * I + I + i];
        }
}

/* What one layer's weights and pool view are: pointers and the pool strides (elements), as native.py packs them. */
typedef struct {
    const float *input_norm, *qkv, *qkv_bias, *o, *o_bias, *post_norm, *gate_up, *gate_up_bias, *down, *down_bias;
    void *cache;
} pd_layer;

typedef struct {
    int num_layers, hidden, intermediate, num_heads, num_kv_heads, head_dim, vocab, page_size, pool_dtype;
    float eps, scale; /* scale: head_dim ** -0.5, as Python rounds it */
    int64_t num_pages, page_stride, kv_stride, token_stride, head_stride;
    const float *embed, *final_norm, *lm_head;
    const pd_layer *layers;
} pd_model;

/*
 * ids: [B] token ids; cos, sin: [B, D] (rope.py's tables); table: [B, table_stride] page ids; lens: [B] tokens each
 * sequence attends (position + 1); logits: [B, vocab] out. Returns 0, or the attention's refusal (nothing written
 * when a page is outside the pool), or 4 for a token id outside the vocabulary, or 5 when out of memory.
 */
int pd_decode_step(const pd_model *model, const int64_t *ids, const float *cos, const float *sin,
                   const int64_t *table, int64_t table_stride, const int64_t *lens, int B, float *logits) {
    const pd_model *md = model;
    const int64_t Hd = md->hidden, I = md->intermediate, D = md->head_dim, H = md->num_heads,
                  kvh = md->num_kv_heads, Q = (H + 2 * kvh) * D;
    for (int b = 0; b < B; b++)
        if (ids[b] < 0 || ids[b] >= md->vocab) return 4;
    const int64_t floats = B * (2 * Hd + Q + 2 * H * D + 2 * I + I + Hd);
    float *buf = malloc(floats * sizeof(float));
    if (!buf) return 5;
    float *x = buf, *h = x + B * Hd, *qkv = h + B * Hd, *q_rot = qkv + B * Q, *attn = q_rot + B * H * D,
          *gu = attn + B * H * D, *act = gu + B * 2 * I, *tmp = act + B * I;
    for (int b = 0; b < B; b++) memcpy(x + b * Hd, md->embed + ids[b] * Hd, Hd * sizeof(float));
    int rc = 0;
    for (int l = 0; l < md->num_layers && rc == 0; l++) {
        const pd_layer *L = md->layers + l;
        rms_norm(x, L->input_norm, md->eps, h, B, Hd);
        gemm(h, B, Hd, L->qkv, L->qkv_bias, qkv, Q);
        rc = pd_decode_attention_block(qkv, Q, cos, sin, q_rot, attn, L->cache, md->pool_dtype, md->num_pages,
                                       md->page_stride, md->kv_stride, md->token_stride, md->head_stride,
                                       md->page_size, (int)kvh, (int)H, (int)D, table, table_stride, lens, B,
                                       md->scale);
        if (rc) break;
        gemm(attn, B, H * D, L->o, L->o_bias, tmp, Hd);
        add(x, tmp, B * Hd);
        rms_norm(x, L->post_norm, md->eps, h, B, Hd);
        gemm(h, B, Hd, L->gate_up, L->gate_up_bias, gu, 2 * I);
        silu_mul(gu, act, B, I);
        gemm(act, B, I, L->down, L->down_bias, tmp, Hd);
        add(x, tmp, B * Hd);
    }
    if (rc == 0) {
        rms_norm(x, md->final_norm, md->eps, h, B, Hd);
        gemm(h, B, Hd, md->lm_head, NULL, logits, md->vocab);
    }
    free(buf);
    return rc;
}
