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
 * call, however many sequences share the step. The block of rows 4 blocks on is prefetched into L2 in address
 * order before each block runs (why: gemm16's comment). */
static void gemm8(const float *x, int M, int64_t K, const float *w, const float *b, float *y, int64_t N) {
    const int64_t ahead = 4 * TILE_N, end = N * K;
    for (int64_t i = 0; i < (ahead < N ? ahead : N) * K; i += 16) __builtin_prefetch(w + i, 0, 2);
    for (int64_t n = 0; n < N; n += TILE_N) {
        const int nr = N - n < TILE_N ? (int)(N - n) : TILE_N;
        for (int64_t i = (n + ahead) * K; i < (n + ahead + TILE_N) * K && i < end; i += 16)
            __builtin_prefetch(w + i, 0, 2);
        for (int m = 0; m < M; m += TILE_M) {
            const int mr = M - m < TILE_M ? M - m : TILE_M;
            TILE[mr][nr](x + (int64_t)m * K, K, w + n * K, b ? b + n : NULL, y + (int64_t)m * N + n, N);
        }
    }
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define PD_V4 __attribute__((target("arch=x86-64-v4")))
#define PD_HAVE_V4 1

/* The same product where AVX-512 runs: 32 registers of 16 lanes. A tile is up to V4_M rows of x by V4_N weight
 * rows: 16 accumulators, 4 weight vectors and one of x, so each weight vector loaded feeds 4 rows of the step and
 * a tile's 16 sums are reduced together (lanes(), below) rather than one by one. Every output is the same
 * arithmetic whatever the tile: one accumulator over k in steps of 16 (the last step's lanes past K loaded as
 * zeros), its 16 lanes then summed in halves: lane l + lane l+8, then l + l+4, l + l+2, l + l+1.
 * The weights stream from memory (the KV pages the attention reads in between push them out of the caches), and
 * a tile's loads, four rows a few KiB apart at once, defeat the hardware prefetcher: read that way a model's
 * weights take twice as long as read in address order. So while its first rows of x run, a tile prefetches into
 * L2 the block of weight rows V4_AHEAD blocks on, in address order, and gemm16 the first blocks before it starts. */
#define V4_M 4
#define V4_N 4
#define V4_AHEAD 4

static inline __attribute__((always_inline)) PD_V4 float lanes(__m512 a) { /* one accumulator's sum, in halves */
    const __m256 p = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    const __m128 q = _mm_add_ps(_mm256_castps256_ps128(p), _mm256_extractf128_ps(p, 1));
    const __m128 r = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(r, _mm_shuffle_ps(r, r, 1)));
}

/* lanes() of 16 accumulators at once, the same additions: a[i] is row i % 4, weight row i / 4 of a 4 x 4 tile; the
 * result holds row m's four sums in its m-th quarter. Each step adds two vectors whose lanes are the two halves of
 * the step before, for twice as many accumulators as the step before packed in one vector. */
static inline __attribute__((always_inline)) PD_V4 __m512 lanes16(const __m512 a[16]) {
    __m512 p[8], q[4], r[2];
    for (int i = 0; i < 8; i++) /* [a2i lanes 0-7, a2i+1 lanes 0-7] + [their lanes 8-15] */
        p[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++) /* quarter k: a[4i + k]'s l + l+4 */
        q[i] = _mm512_add_ps(_mm512_shuffle_f32x4(p[2 * i], p[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(p[2 * i], p[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++) /* quarter k: a[8i + k]'s and a[8i + 4 + k]'s l + l+2 */
        r[i] = _mm512_add_ps(_mm512_shuffle_ps(q[2 * i], q[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(q[2 * i], q[2 * i + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(r[0], r[1], 0x88), _mm512_shuffle_ps(r[0], r[1], 0xDD));
}

static inline __attribute__((always_inline)) PD_V4 void tile16(const float *x, int64_t K, const float *w,
                                                               const float *b, float *y, int64_t N, const float *pf,
                                                               const int MR, const int NR, const int PF) {
    const int64_t K16 = K & ~(int64_t)15;
    __m512 acc[V4_M][V4_N];
    for (int m = 0; m < MR; m++)
        for (int j = 0; j < NR; j++) acc[m][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K16; k += 16) {
        __m512 u[V4_N];
        for (int j = 0; j < NR; j++) u[j] = _mm512_loadu_ps(w + j * K + k);
        if (PF)
            for (int j = 0; j < NR; j++) _mm_prefetch((const char *)(pf + k * NR + j * 16), _MM_HINT_T1);
        for (int m = 0; m < MR; m++) {
            __m512 xv = _mm512_loadu_ps(x + m * K + k);
            __asm__("" : "+v"(xv)); /* one load of x for its NR products: gcc would fold it into each of them */
            for (int j = 0; j < NR; j++) acc[m][j] = _mm512_fmadd_ps(xv, u[j], acc[m][j]);
        }
    }
    if (K16 < K) {
        const __mmask16 tail = (__mmask16)((1u << (K - K16)) - 1);
        __m512 u[V4_N];
        for (int j = 0; j < NR; j++) u[j] = _mm512_maskz_loadu_ps(tail, w + j * K + K16);
        for (int m = 0; m < MR; m++) {
            const __m512 xv = _mm512_maskz_loadu_ps(tail, x + m * K + K16);
            for (int j = 0; j < NR; j++) acc[m][j] = _mm512_fmadd_ps(xv, u[j], acc[m][j]);
        }
    }
    if (MR == V4_M && NR == V4_N) {
        __m512 a[16];
        for (int i = 0; i < 16; i++) a[i] = acc[i % 4][i / 4];
        __m512 s = lanes16(a);
        if (b) s = _mm512_add_ps(s, _mm512_broadcast_f32x4(_mm_loadu_ps(b)));
        _mm_storeu_ps(y, _mm512_extractf32x4_ps(s, 0));
        _mm_storeu_ps(y + N, _mm512_extractf32x4_ps(s, 1));
        _mm_storeu_ps(y + 2 * N, _mm512_extractf32x4_ps(s, 2));
        _mm_storeu_ps(y + 3 * N, _mm512_extractf32x4_ps(s, 3));
    } else {
        for (int m = 0; m < MR; m++)
            for (int j = 0; j < NR; j++) {
                const float s = lanes(acc[m][j]);
                y[m * N + j] = b ? s + b[j] : s;
            }
    }
}

/* One function per tile shape (mr, nr, prefetching or not), so that each keeps its accumulators in registers. */
#define V4_TILE(MR, NR, PF)                                                                                      \
    static PD_V4 void tile16_##MR##_##NR##_##PF(const float *x, int64_t K, const float *w, const float *b,       \
                                                  float *y, int64_t N, const float *pf) {                        \
        tile16(x, K, w, b, y, N, pf, MR, NR, PF);                                                                \
    }
#define V4_ROW(MR, PF) V4_TILE(MR, 1, PF) V4_TILE(MR, 2, PF) V4_TILE(MR, 3, PF) V4_TILE(MR, 4, PF)
#define V4_ROWS(PF) V4_ROW(1, PF) V4_ROW(2, PF) V4_ROW(3, PF) V4_ROW(4, PF)
V4_ROWS(0)
V4_ROWS(1)
typedef void (*tile16_fn)(const float *, int64_t, const float *, const float *, float *, int64_t, const float *);
#define V4_ENTRY(MR, PF) {0, tile16_##MR##_1_##PF, tile16_##MR##_2_##PF, tile16_##MR##_3_##PF, tile16_##MR##_4_##PF}
#define V4_TABLE(PF) {{0, 0, 0, 0, 0}, V4_ENTRY(1, PF), V4_ENTRY(2, PF), V4_ENTRY(3, PF), V4_ENTRY(4, PF)}
static const tile16_fn TILE16[2][V4_M + 1][V4_N + 1] = {V4_TABLE(0), V4_TABLE(1)};

static PD_V4 void gemm16(const float *x, int M, int64_t K, const float *w, const float *b, float *y, int64_t N) {
    const int64_t ahead = V4_AHEAD * V4_N; /* weight rows */
    for (int64_t i = 0; i < (ahead < N ? ahead : N) * K; i += 16) _mm_prefetch((const char *)(w + i), _MM_HINT_T1);
    for (int64_t n = 0; n < N; n += V4_N) {
        const int nr = N - n < V4_N ? (int)(N - n) : V4_N;
        const float *next = n + ahead < N ? w + (n + ahead) * K : NULL;
        for (int m = 0; m < M; m += V4_M) {
            const int mr = M - m < V4_M ? M - m : V4_M;
            const int pf = m == 0 && next != NULL;
            TILE16[pf][mr][nr](x + (int64_t)m * K, K, w + n * K, b ? b + n : NULL, y + (int64_t)m * N + n, N,
                               next);
        }
    }
}
#else
#define PD_HAVE_V4 0
#endif

static int wide(void) {
#if PD_HAVE_V4
    return __builtin_cpu_supports("x86-64-v4") != 0;
#else
    return 0;
#endif
}

static void gemm(const float *x, int M, int64_t K, const float *w, const float *b, float *y, int64_t N) {
#if PD_HAVE_V4
    if (wide()) {
        gemm16(x, M, K, w, b, y, N);
        return;
    }
#endif
    gemm8(x, M, K, w, b, y, N);
}

/* gemm alone, for the tests: lanes 16 for the AVX-512 product (refused with -1 where the CPU has none), 8 for the
 * other, whichever CPU runs it, 0 for what the step uses here. */
int pd_gemm(const float *x, int M, int64_t K, const float *w, const float *b, float *y, int64_t N, int lanes) {
    if (lanes == 0) lanes = wide() ? 16 : 8;
    if (lanes == 8) {
        gemm8(x, M, K, w, b, y, N);
        return 0;
    }
#if PD_HAVE_V4
    if (lanes == 16 && wide()) {
        gemm16(x, M, K, w, b, y, N);
        return 0;
    }
#endif
    return -1;
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

/* A prefill pass's row-wise ops on the same code as the step's: one call for all T rows of a pass, in the calling
 * thread (torch's would start its thread team for each, and wait at its barrier for a thread that decode holds). */
void pd_rms_norm(const float *x, const float *w, float eps, float *y, int M, int64_t D) {
    rms_norm(x, w, eps, y, M, D);
}

void pd_silu_mul(const float *gu, float *act, int M, int64_t I) {
    silu_mul(gu, act, M, I);
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
