/* Chunked prefill attention on the CPU: a chunk of L tokens that continues a prompt after prefix_len tokens
 * already in the paged KV pool attends to that prefix where it lies, page by page, with a causal offset (query i
 * of the chunk sits at position prefix_len + i and sees keys 0 .. prefix_len + i). No copy of the prefix is made
 * and no mask is materialised: keys are taken a tile of TK positions at a time, and the softmax is taken online
 * across tiles (flash attention's running maximum and sum).
 *
 * The chunk's own keys and values come from the fresh k and v the caller passes (float32, as the projection left
 * them), so a chunked prompt does the same arithmetic as a whole one whatever the pool's dtype; the prefix comes
 * from the pool (float32, bfloat16 or float16, widened exactly), as decode reads it.
 *
 * Work is blocked for gcc -O3's vectoriser: a block of BR query rows (query positions times the query heads of
 * one KV head, so each key row is read once for its whole group) against a tile of TK = 16 keys. The scores are
 * kept transposed (keys by query rows): a key's elements are broadcasts against vectors of query rows (the block's
 * queries are transposed once), so float32 keys and values are read where they lie in the pool, and the online
 * softmax runs over vectors of rows without a horizontal reduction. Every page id is checked against the pool
 * before anything is read: a bad page table is an error code, never a read outside it.
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
#define BR 128             /* query rows per block (positions x group) */

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

/* The rows of keys t0 .. t0 + cnt - 1 of KV head j, as float32: a float32 pool's rows where they lie, other pools'
 * widened into kbuf and vbuf ([TK][D]); slots past cnt point at a zero row, so a tile never carries a stale value
 * (a weight of 0 times a NaN would still be NaN). Positions below prefix_len are the pool's, the rest the chunk's
 * fresh k and v ([L, kvh, D] float32). */
static inline void tile_rows(const struct pool *pl, int64_t prefix_len, const float *k_new, const float *v_new,
                             int kvh, int j, int D, int64_t t0, int cnt, const float *zero, float *kbuf,
                             float *vbuf, const float **kr, const float **vr) {
    int64_t page = t0 / pl->page_size, slot = t0 % pl->page_size;  /* one division per tile, not per key */
    for (int t = 0; t < TK; t++, slot++) {
        if (slot == pl->page_size) { page++; slot = 0; }
        const int64_t pos = t0 + t;
        if (t >= cnt) {
            kr[t] = vr[t] = zero;
        } else if (pos >= prefix_len) {
            kr[t] = k_new + ((pos - prefix_len) * kvh + j) * D;
            vr[t] = v_new + ((pos - prefix_len) * kvh + j) * D;
        } else {
            const char *kp = pl->base + (pl->pages[page] * pl->page_stride + slot * pl->token_stride +
                                         j * pl->head_stride) * pl->esize;
            const char *vp = kp + pl->kv_stride * pl->esize;
            if (pl->dtype == PF_F32) {
                kr[t] = (const float *)kp;
                vr[t] = (const float *)vp;
            } else {
                float *kd = kbuf + t * D, *vd = vbuf + t * D;
                for (int i = 0; i < D; i++) {
                    kd[i] = widen(kp + i * pl->esize, pl->dtype);
                    vd[i] = widen(vp + i * pl->esize, pl->dtype);
                }
                kr[t] = kd;
                vr[t] = vd;
            }
        }
    }
}

/* st[t][r] = kr[t] . qt[.][r]: the scores transposed (keys by query rows), so the row vectors are the query rows
 * and a key's element is a broadcast; rp (a multiple of 16) rows, qt is [D][rp] */
static inline void scores_t(const float *qt, const float *const *kr, float *st, int rp, int D) {
    for (int rc = 0; rc < rp; rc += 16) {
        for (int t = 0; t < TK; t += 4) {
            const float *k0 = kr[t], *k1 = kr[t + 1], *k2 = kr[t + 2], *k3 = kr[t + 3];
            v8 a00 = {0}, a01 = {0}, a10 = {0}, a11 = {0}, a20 = {0}, a21 = {0}, a30 = {0}, a31 = {0};
            for (int i = 0; i < D; i++) {
                const v8 x = load8(qt + i * rp + rc), y = load8(qt + i * rp + rc + 8);
                /* a scalar times a vector: gcc broadcasts it once (a hand-built splat costs 8 inserts in a clone) */
                a00 += k0[i] * x; a01 += k0[i] * y;
                a10 += k1[i] * x; a11 += k1[i] * y;
                a20 += k2[i] * x; a21 += k2[i] * y;
                a30 += k3[i] * x; a31 += k3[i] * y;
            }
            float *o = st + t * rp + rc;
            store8(o, a00); store8(o + 8, a01);
            store8(o + rp, a10); store8(o + rp + 8, a11);
            store8(o + 2 * rp, a20); store8(o + 2 * rp + 8, a21);
            store8(o + 3 * rp, a30); store8(o + 3 * rp + 8, a31);
        }
    }
}

/* ob[r] = ob[r] alpha[r] + sum_t w[t][r] vr[t] for rows 0 .. rp (a multiple of 2), D a multiple of 8 */
static inline void weighted_values(const float *w, const float *const *vr, const float *alpha, float *ob, int rp,
                                   int D) {
    int c = 0;
    for (; c + 32 <= D; c += 32) {
        for (int r = 0; r < rp; r += 2) {
            float *o0 = ob + r * D + c, *o1 = o0 + D;
            const float a0 = alpha[r], a1 = alpha[r + 1];
            v8 x0 = a0 * load8(o0), x1 = a0 * load8(o0 + 8), x2 = a0 * load8(o0 + 16), x3 = a0 * load8(o0 + 24);
            v8 y0 = a1 * load8(o1), y1 = a1 * load8(o1 + 8), y2 = a1 * load8(o1 + 16), y3 = a1 * load8(o1 + 24);
            for (int t = 0; t < TK; t++) {
                const float *v = vr[t] + c;
                const v8 v0 = load8(v), v1 = load8(v + 8), v2 = load8(v + 16), v3 = load8(v + 24);
                const float b = w[t * rp + r], b1 = w[t * rp + r + 1];
                x0 += b * v0; x1 += b * v1; x2 += b * v2; x3 += b * v3;
                y0 += b1 * v0; y1 += b1 * v1; y2 += b1 * v2; y3 += b1 * v3;
            }
            store8(o0, x0); store8(o0 + 8, x1); store8(o0 + 16, x2); store8(o0 + 24, x3);
            store8(o1, y0); store8(o1 + 8, y1); store8(o1 + 16, y2); store8(o1 + 24, y3);
        }
    }
    for (; c < D; c += 8) {
        for (int r = 0; r < rp; r++) {
            float *o = ob + r * D + c;
            v8 x = alpha[r] * load8(o);
            for (int t = 0; t < TK; t++) x += w[t * rp + r] * load8(vr[t] + c);
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
    const int RPMAX = (BR + 15) & ~15;
    float *scratch = aligned_alloc(64, sizeof(float) * (size_t)(2 * RPMAX * D + RPMAX * TK + 3 * TK * D + 3 * RPMAX));
    if (scratch == NULL) return PF_NO_MEMORY;
    float *qt = scratch, *ob = qt + RPMAX * D, *st = ob + RPMAX * D, *kbuf = st + RPMAX * TK, *vbuf = kbuf + TK * D,
          *zero = vbuf + TK * D, *m = zero + TK * D, *l = m + RPMAX, *alpha = l + RPMAX;
    memset(zero, 0, sizeof(float) * (size_t)D);
    const float *kr[TK], *vr[TK];
    for (int j = head_lo; j < head_hi; j++) {
        for (int64_t q0 = 0; q0 < L; q0 += bq) {
            const int nq = (int)(L - q0 < bq ? L - q0 : bq);
            const int rows = nq * G, rp = (rows + 15) & ~15;  /* padding rows: zero queries, results dropped */
            memset(qt, 0, sizeof(float) * (size_t)rp * D);
            for (int a = 0; a < nq; a++)
                for (int g = 0; g < G; g++) {
                    const float *src = q + ((q0 + a) * H + j * G + g) * D;
                    for (int i = 0; i < D; i++) qt[i * rp + a * G + g] = src[i] * scale;
                }
            memset(ob, 0, sizeof(float) * (size_t)rp * D);
            for (int r = 0; r < rp; r++) { m[r] = -1e30f; l[r] = 0.0f; }
            const int64_t first = prefix_len + q0;     /* the block's first query position */
            const int64_t end = prefix_len + q0 + nq;  /* keys 0 .. end - 1 are seen by some row of the block */
            for (int64_t t0 = 0; t0 < end; t0 += TK) {
                const int cnt = (int)(end - t0 < TK ? end - t0 : TK);
                tile_rows(&pl, prefix_len, k_new, v_new, kvh, j, D, t0, cnt, zero, kbuf, vbuf, kr, vr);
                scores_t(qt, kr, st, rp, D);
                /* keys after a row's position, or past the tile's end, weigh exactly 0 */
                const int masked = t0 + TK - 1 > first;
                if (masked)
                    for (int t = 0; t < TK; t++)
                        for (int r = 0; r < rp; r++)
                            if (t >= cnt || t0 + t > first + r / G) st[t * rp + r] = -1e30f;
                for (int r = 0; r < rp; r += 8) {
                    const v8 old = load8(m + r);
                    v8 mx = old;
                    for (int t = 0; t < TK; t++) mx = max8(mx, load8(st + t * rp + r));
                    store8(alpha + r, exp8_nonpositive(old - mx));
                    store8(m + r, mx);
                    for (int t = 0; t < TK; t++) store8(st + t * rp + r, exp8_nonpositive(load8(st + t * rp + r) - mx));
                }
                if (masked)  /* exactly 0, not e^-87 */
                    for (int t = 0; t < TK; t++)
                        for (int r = 0; r < rp; r++)
                            if (t >= cnt || t0 + t > first + r / G) st[t * rp + r] = 0.0f;
                for (int r = 0; r < rp; r += 8) {
                    v8 sum = load8(l + r) * load8(alpha + r);
                    for (int t = 0; t < TK; t++) sum += load8(st + t * rp + r);
                    store8(l + r, sum);
                }
                weighted_values(st, vr, alpha, ob, rp, D);
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
