/* Chunked prefill attention on the CPU: a chunk of L tokens that continues a prompt after prefix_len tokens
 * already in the paged KV pool attends to that prefix where it lies, page by page, with a causal offset (query i
 * of the chunk sits at position prefix_len + i and sees keys 0 .. prefix_len + i). No copy of the prefix is made
 * and no mask is materialised: keys are read a tile of TK positions at a time into a small transposed buffer, and
 * the softmax is taken online across tiles (flash attention's running maximum and sum).
 *
 * The chunk's own keys and values come from the fresh k and v the caller passes (float32, as the projection left
 * them), so a chunked prompt does the same arithmetic as a whole one whatever the pool's dtype; the prefix comes
 * from the pool (float32, bfloat16 or float16, widened exactly), as decode reads it.
 *
 * Work is blocked for gcc -O3's vectoriser: a block of BR query rows (query positions times the query heads of
 * one KV head, so each key row is read once for its whole group) against a tile of TK = 16 keys; scores by
 * broadcast multiply-adds over a transposed key tile, the weighted values over head_dim. Every page id is
 * checked against the pool before anything is read: a bad page table is an error code, never a read outside it.
 *
 * Built into the engine's one library by services/engine/native_build.py; called through ctypes from
 * services/engine/native_prefill.py (which releases the GIL for the call).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PF_F32 0
#define PF_BF16 1
#define PF_F16 2

#define PF_OK 0
#define PF_BAD_PAGE 1      /* a page id outside [0, num_pages) */
#define PF_BAD_LENGTH 2    /* fewer pages than the prefix needs, or an empty chunk */
#define PF_BAD_SHAPE 3     /* heads not a multiple of kv heads, head_dim not a multiple of 8 or too large, dtype */
#define PF_NO_MEMORY 5

#define PF_MAX_HEAD_DIM 256
#define TK 16              /* keys per tile: two 8-float vectors of scores per query row */
#define BR 128             /* query rows per block (positions x group), a multiple of 4 */

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PF_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define PF_CLONES
#endif

typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }
static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }
typedef int32_t v8i __attribute__((vector_size(32)));

/* lane-wise a > b ? a : b (C has no vector ?:, a bit select is what it compiles to) */
static inline v8 max8(v8 a, v8 b) {
    const v8i m = a > b;
    return (v8)((m & (v8i)a) | (~m & (v8i)b));
}

static inline float hmax8(v8 x) {
    x = max8(x, __builtin_shuffle(x, (v8i){4, 5, 6, 7, 0, 1, 2, 3}));
    x = max8(x, __builtin_shuffle(x, (v8i){2, 3, 0, 1, 6, 7, 4, 5}));
    x = max8(x, __builtin_shuffle(x, (v8i){1, 0, 3, 2, 5, 4, 7, 6}));
    return x[0];
}

static inline float hsum8(v8 x) {
    x += __builtin_shuffle(x, (v8i){4, 5, 6, 7, 0, 1, 2, 3});
    x += __builtin_shuffle(x, (v8i){2, 3, 0, 1, 6, 7, 4, 5});
    x += __builtin_shuffle(x, (v8i){1, 0, 3, 2, 5, 4, 7, 6});
    return x[0];
}

/* e^x for x <= 0: the same Cephes polynomial as paged_attention.c's (a loop of it vectorises; libm's would not) */
static inline float exp_nonpositive(float x) {
    x = x > 0.0f ? 0.0f : x;  /* a masked key's score above the row's maximum: its weight is dropped anyway */
    x = x < -87.0f ? -87.0f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

/* the same on 8 lanes (x <= 0 assumed: scores less their row's maximum); n rounds x log2(e) to a nearest
 * integer by truncating y - 0.5 (y <= 0), which keeps the reduced argument within the polynomial's range */
static inline v8 exp8_nonpositive(v8 x) {
    x = max8(x, (v8){0} - 87.0f);
    const v8i ni = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, v8i);
    const v8 n = __builtin_convertvector(ni, v8);
    const v8 r = x - n * 0.693359375f + n * 2.12194440e-4f;
    v8 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * (v8)((ni + 127) << 23);
}

static inline float widen(const char *p, int dtype) {
    uint16_t h;
    if (dtype == PF_F32) { float f; memcpy(&f, p, 4); return f; }
    memcpy(&h, p, 2);
    uint32_t u;
    if (dtype == PF_BF16) {
        u = (uint32_t)h << 16;
    } else {
        uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
        if (exp == 0) {
            if (mant == 0) {
                u = sign;
            } else {  /* subnormal: normalise */
                exp = 127 - 15 + 1;
                while (!(mant & 0x400)) { mant <<= 1; exp--; }
                u = sign | (exp << 23) | ((mant & 0x3ff) << 13);
            }
        } else if (exp == 0x1f) {
            u = sign | 0x7f800000u | (mant << 13);
        } else {
            u = sign | ((exp + 127 - 15) << 23) | (mant << 13);
        }
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

struct pool {
    const char *base;
    int dtype;
    int64_t esize, page_stride, kv_stride, token_stride, head_stride;
    int page_size;
    const int64_t *pages;
};

/* Keys t0 .. t0 + cnt - 1 of KV head j into kt[D][TK] (transposed) and vt[TK][D]; slots past cnt are zero, so a
 * tile never carries a stale value (a weight of 0 times a NaN would still be NaN). Positions below prefix_len are
 * read from the pool, the rest from the chunk's fresh k and v ([L, kvh, D] float32). */
static inline void load_tile(const struct pool *pl, int64_t prefix_len, const float *k_new, const float *v_new,
                             int kvh, int j, int D, int64_t t0, int cnt, float *kt, float *vt) {
    int64_t page = t0 / pl->page_size, slot = t0 % pl->page_size;  /* one division per tile, not per key */
    for (int t = 0; t < TK; t++, slot++) {
        if (slot == pl->page_size) { page++; slot = 0; }
        float *vr = vt + t * D;
        if (t >= cnt) {
            for (int i = 0; i < D; i++) { kt[i * TK + t] = 0.0f; vr[i] = 0.0f; }
            continue;
        }
        const int64_t pos = t0 + t;
        if (pos < prefix_len) {
            const char *kp = pl->base + (pl->pages[page] * pl->page_stride + slot * pl->token_stride +
                                         j * pl->head_stride) * pl->esize;
            const char *vp = kp + pl->kv_stride * pl->esize;
            if (pl->dtype == PF_F32) {
                const float *kf = (const float *)kp;
                for (int i = 0; i < D; i++) kt[i * TK + t] = kf[i];
                memcpy(vr, vp, (size_t)D * 4);
            } else {
                for (int i = 0; i < D; i++) {
                    kt[i * TK + t] = widen(kp + i * pl->esize, pl->dtype);
                    vr[i] = widen(vp + i * pl->esize, pl->dtype);
                }
            }
        } else {
            const float *kf = k_new + ((pos - prefix_len) * kvh + j) * D;
            for (int i = 0; i < D; i++) kt[i * TK + t] = kf[i];
            memcpy(vr, v_new + ((pos - prefix_len) * kvh + j) * D, (size_t)D * 4);
        }
    }
}

/* s[r][0..TK) = qb[r] . kt for rows 0 .. rows (a multiple of 4) */
static inline void scores(const float *qb, const float *kt, float *s, int rows, int D) {
    for (int r = 0; r < rows; r += 4) {
        v8 a00 = {0}, a01 = {0}, a10 = {0}, a11 = {0}, a20 = {0}, a21 = {0}, a30 = {0}, a31 = {0};
        const float *q0 = qb + r * D, *q1 = q0 + D, *q2 = q1 + D, *q3 = q2 + D;
        for (int i = 0; i < D; i++) {
            const v8 k0 = load8(kt + i * TK), k1 = load8(kt + i * TK + 8);
            /* a scalar times a vector: gcc broadcasts it once (a hand-built splat costs 8 inserts in a clone) */
            a00 += q0[i] * k0; a01 += q0[i] * k1;
            a10 += q1[i] * k0; a11 += q1[i] * k1;
            a20 += q2[i] * k0; a21 += q2[i] * k1;
            a30 += q3[i] * k0; a31 += q3[i] * k1;
        }
        float *o = s + r * TK;
        store8(o, a00); store8(o + 8, a01);
        store8(o + TK, a10); store8(o + TK + 8, a11);
        store8(o + 2 * TK, a20); store8(o + 2 * TK + 8, a21);
        store8(o + 3 * TK, a30); store8(o + 3 * TK + 8, a31);
    }
}

/* ob[r] = ob[r] alpha[r] + sum_t w[r][t] vt[t] for rows 0 .. rows (a multiple of 2), D a multiple of 8 */
static inline void weighted_values(const float *w, const float *vt, const float *alpha, float *ob, int rows,
                                   int D) {
    int c = 0;
    for (; c + 32 <= D; c += 32) {
        for (int r = 0; r < rows; r += 2) {
            float *o0 = ob + r * D + c, *o1 = o0 + D;
            const float a0 = alpha[r], a1 = alpha[r + 1];
            v8 x0 = a0 * load8(o0), x1 = a0 * load8(o0 + 8), x2 = a0 * load8(o0 + 16), x3 = a0 * load8(o0 + 24);
            v8 y0 = a1 * load8(o1), y1 = a1 * load8(o1 + 8), y2 = a1 * load8(o1 + 16), y3 = a1 * load8(o1 + 24);
            const float *w0 = w + r * TK, *w1 = w0 + TK;
            for (int t = 0; t < TK; t++) {
                const float *v = vt + t * D + c;
                const v8 v0 = load8(v), v1 = load8(v + 8), v2 = load8(v + 16), v3 = load8(v + 24);
                const float b = w0[t], c1 = w1[t];
                x0 += b * v0; x1 += b * v1; x2 += b * v2; x3 += b * v3;
                y0 += c1 * v0; y1 += c1 * v1; y2 += c1 * v2; y3 += c1 * v3;
            }
            store8(o0, x0); store8(o0 + 8, x1); store8(o0 + 16, x2); store8(o0 + 24, x3);
            store8(o1, y0); store8(o1 + 8, y1); store8(o1 + 16, y2); store8(o1 + 24, y3);
        }
    }
    for (; c < D; c += 8) {
        for (int r = 0; r < rows; r++) {
            float *o = ob + r * D + c;
            v8 x = alpha[r] * load8(o);
            for (int t = 0; t < TK; t++) x += w[r * TK + t] * load8(vt + t * D + c);
            store8(o, x);
        }
    }
}

/*
 * q:      [L, H, D] float32, contiguous (unscaled)
 * k_new, v_new: [L, kvh, D] float32, contiguous: the chunk's own keys (after RoPE) and values
 * out:    [L, H, D] float32, contiguous
 * cache:  the layer's pool view; strides in elements: page, kv (K -> V), token, head; dimension D contiguous
 * pages:  [num_prefix_pages] int64: the pages holding positions 0 .. prefix_len - 1, in order
 * kv heads head_lo .. head_hi - 1 are computed (callers may split the heads over threads)
 */
PF_CLONES
int pd_prefill_attention(const float *q, const float *k_new, const float *v_new, float *out, int64_t L,
                         const void *cache, int dtype, int64_t num_pages, int64_t page_stride, int64_t kv_stride,
                         int64_t token_stride, int64_t head_stride, int page_size, int num_kv_heads, int num_heads,
                         int head_dim, const int64_t *pages, int64_t num_prefix_pages, int64_t prefix_len,
                         int head_lo, int head_hi, float scale) {
    if (dtype < PF_F32 || dtype > PF_F16 || num_kv_heads <= 0 || num_heads % num_kv_heads != 0 ||
        head_dim <= 0 || head_dim % 8 != 0 || head_dim > PF_MAX_HEAD_DIM || page_size <= 0 ||
        num_heads / num_kv_heads > BR || head_lo < 0 || head_hi > num_kv_heads || head_lo > head_hi)
        return PF_BAD_SHAPE;
    if (L <= 0 || prefix_len < 0 || (prefix_len + page_size - 1) / page_size > num_prefix_pages)
        return PF_BAD_LENGTH;
    for (int64_t p = 0; p < (prefix_len + page_size - 1) / page_size; p++)
        if (pages[p] < 0 || pages[p] >= num_pages) return PF_BAD_PAGE;
    const int D = head_dim, H = num_heads, kvh = num_kv_heads, G = H / kvh;
    const int bq = BR / G;  /* query positions per block */
    const struct pool pl = {(const char *)cache, dtype, dtype == PF_F32 ? 4 : 2, page_stride, kv_stride,
                            token_stride, head_stride, page_size, pages};
    float *scratch = aligned_alloc(64, sizeof(float) * (size_t)(2 * BR * D + BR * TK + 2 * TK * D + 3 * BR));
    if (scratch == NULL) return PF_NO_MEMORY;
    float *qb = scratch, *ob = qb + BR * D, *s = ob + BR * D, *kt = s + BR * TK, *vt = kt + TK * D,
          *m = vt + TK * D, *l = m + BR, *alpha = l + BR;
    for (int j = head_lo; j < head_hi; j++) {
        for (int64_t q0 = 0; q0 < L; q0 += bq) {
            const int nq = (int)(L - q0 < bq ? L - q0 : bq);
            const int rows = nq * G, padded = (rows + 3) & ~3;
            for (int a = 0; a < nq; a++)
                for (int g = 0; g < G; g++) {
                    const float *src = q + ((q0 + a) * H + j * G + g) * D;
                    float *dst = qb + (a * G + g) * D;
                    for (int i = 0; i < D; i++) dst[i] = src[i] * scale;
                }
            memset(qb + rows * D, 0, sizeof(float) * (size_t)(padded - rows) * D);
            memset(ob, 0, sizeof(float) * (size_t)padded * D);
            for (int r = 0; r < padded; r++) { m[r] = -1e30f; l[r] = 0.0f; }
            const int64_t first = prefix_len + q0;     /* the block's first query position */
            const int64_t end = prefix_len + q0 + nq;  /* keys 0 .. end - 1 are seen by some row of the block */
            for (int64_t t0 = 0; t0 < end; t0 += TK) {
                const int cnt = (int)(end - t0 < TK ? end - t0 : TK);
                load_tile(&pl, prefix_len, k_new, v_new, kvh, j, D, t0, cnt, kt, vt);
                scores(qb, kt, s, padded, D);
                const int masked = t0 + TK - 1 > first;  /* some key of the tile lies after some query */
                for (int r = 0; r < padded; r++) {
                    float *sr = s + r * TK;
                    int valid = TK;
                    if (masked) {  /* keys after this row's position (and every key, for a padding row) */
                        const int64_t last = r < rows ? first + r / G : t0 - 1;
                        valid = (int)(last - t0 + 1 < 0 ? 0 : (last - t0 + 1 > TK ? TK : last - t0 + 1));
                        for (int t = valid; t < TK; t++) sr[t] = -1e30f;
                    }
                    v8 s0 = load8(sr), s1 = load8(sr + 8);
                    const float mx = fmaxf(m[r], hmax8(max8(s0, s1)));
                    alpha[r] = exp_nonpositive(m[r] - mx);
                    m[r] = mx;
                    s0 = exp8_nonpositive(s0 - mx);
                    s1 = exp8_nonpositive(s1 - mx);
                    store8(sr, s0);
                    store8(sr + 8, s1);
                    if (valid < TK) {  /* exactly 0, not e^-87 */
                        for (int t = valid; t < TK; t++) sr[t] = 0.0f;
                        s0 = load8(sr);
                        s1 = load8(sr + 8);
                    }
                    l[r] = l[r] * alpha[r] + hsum8(s0 + s1);
                }
                weighted_values(s, vt, alpha, ob, padded, D);
            }
            for (int a = 0; a < nq; a++)
                for (int g = 0; g < G; g++) {
                    const int r = a * G + g;
                    const float inv = 1.0f / l[r];
                    float *dst = out + ((q0 + a) * H + j * G + g) * D;
                    for (int i = 0; i < D; i++) dst[i] = ob[r * D + i] * inv;
                }
        }
    }
    free(scratch);
    return PF_OK;
}
