/* A whole decode step of a Llama-family decoder on the CPU, in one call: for the few sequences of a step, every
 * op between the embedding and the logits is either a pass over the weights or a few hundred floats, and issued
 * from Python each costs more than it computes (and gives up the GIL to whichever thread holds it).
 *
 * Float32 weights and activations, the model.py arithmetic op for op: RMSNorm, the fused q/k/v projection,
 * pd_decode_attention_block (rope, the K/V write into the sequence's own slot, paged attention), the output
 * projection and residual, RMSNorm, the fused gate/up projection, SiLU(gate) * up, the down projection and residual;
 * then the final RMSNorm and the LM head. Every matrix product is small_gemm's: each weight row read once for all
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

#define MAX_ROWS 8 /* rows of one small_gemm pass; a larger step is done in passes of this many */

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

/* y[m, n] = x[m, :] . w[n, :] (+ b[n]) for M (a compile-time constant) rows, two weight rows at a time */
#define PD_GEMM(NAME, M)                                                                                        \
PD_CLONES static void NAME(const float *x, int64_t K, const float *w, const float *b, float *y, int64_t N) {    \
    const int64_t K8 = K & ~(int64_t)7;                                                                         \
    int64_t n = 0;                                                                                              \
    for (; n + 2 <= N; n += 2) {                                                                                \
        const float *w0 = w + n * K, *w1 = w0 + K;                                                              \
        v8f a0[M], a1[M];                                                                                       \
        for (int m = 0; m < M; m++) { a0[m] = (v8f){0}; a1[m] = (v8f){0}; }                                     \
        for (int64_t k = 0; k < K8; k += 8) {                                                                   \
            const v8f u0 = *(const v8f *)(w0 + k), u1 = *(const v8f *)(w1 + k);                                \
            for (int m = 0; m < M; m++) {                                                                       \
                const v8f xv = *(const v8f *)(x + m * K + k);                                                   \
                a0[m] += xv * u0;                                                                               \
                a1[m] += xv * u1;                                                                               \
            }                                                                                                   \
        }                                                                                                       \
        for (int m = 0; m < M; m++) {                                                                           \
            float s0 = hsum(a0[m]), s1 = hsum(a1[m]);                                                           \
            for (int64_t k = K8; k < K; k++) {                                                                  \
                s0 += x[m * K + k] * w0[k];                                                                     \
                s1 += x[m * K + k] * w1[k];                                                                     \
            }                                                                                                   \
            y[m * N + n] = b ? s0 + b[n] : s0;                                                                  \
            y[m * N + n + 1] = b ? s1 + b[n + 1] : s1;                                                          \
        }                                                                                                       \
    }                                                                                                           \
    for (; n < N; n++) {                                                                                        \
        const float *w0 = w + n * K;                                                                            \
        for (int m = 0; m < M; m++) {                                                                           \
            v8f a = (v8f){0};                                                                                   \
            for (int64_t k = 0; k < K8; k += 8) a += *(const v8f *)(x + m * K + k) * *(const v8f *)(w0 + k);   \
            float s = hsum(a);                                                                                  \
            for (int64_t k = K8; k < K; k++) s += x[m * K + k] * w0[k];                                         \
            y[m * N + n] = b ? s + b[n] : s;                                                                    \
        }                                                                                                       \
    }                                                                                                           \
}
PD_GEMM(gemm_m1, 1)
PD_GEMM(gemm_m2, 2)
PD_GEMM(gemm_m3, 3)
PD_GEMM(gemm_m4, 4)
PD_GEMM(gemm_m5, 5)
PD_GEMM(gemm_m6, 6)
PD_GEMM(gemm_m7, 7)
PD_GEMM(gemm_m8, 8)

typedef void (*gemm_fn)(const float *, int64_t, const float *, const float *, float *, int64_t);
static const gemm_fn GEMM[MAX_ROWS + 1] = {0, gemm_m1, gemm_m2, gemm_m3, gemm_m4, gemm_m5, gemm_m6, gemm_m7,
                                           gemm_m8};

/* y [M, N] = x [M, K] w^T (+ b), contiguous rows; M of any size, in passes of at most MAX_ROWS rows */
static void gemm(const float *x, int M, int64_t K, const float *w, const float *b, float *y, int64_t N) {
    for (int m = 0; m < M; m += MAX_ROWS) {
        const int rows = M - m < MAX_ROWS ? M - m : MAX_ROWS;
        GEMM[rows](x + m * K, K, w, b, y + m * N, N);
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
