/* Prefill attention on the CPU, a whole prompt (prefix_len 0) or a chunk: a chunk of L tokens that continues a
 * prompt after prefix_len tokens already in the paged KV pool attends to that prefix where it lies, page by page,
 * with a causal offset (query i of the chunk sits at position prefix_len + i and sees keys 0 .. prefix_len + i).
 * No copy of the prefix is made and no mask is materialised: keys are taken a tile of TK positions at a time, and
 * the softmax is taken online across tiles (flash attention's running maximum and sum).
 *
 * The chunk's own keys and values come from the fresh k and v the caller passes (float32, as the projection left
 * them), so a chunked prompt does the same arithmetic as a whole one whatever the pool's dtype; the prefix comes
 * from the pool (float32, bfloat16 or float16, widened exactly), as decode reads it.
 *
 * Work is blocked for gcc -O3's vectoriser: a block of BR query rows (query positions times the query heads of
 * one KV head, so each key row is read once for its whole group) against a tile of TK keys. The scores are
 * kept transposed (keys by query rows): a key's elements are broadcasts against vectors of query rows (the block's
 * queries are transposed once), so float32 keys and values are read where they lie in the pool, and the online
 * softmax runs over vectors of rows without a horizontal reduction. The kernel is built for 8 lanes and, where
 * AVX-512 runs, 16 (prefill_attention_lanes.h, included once for each). Every page id is checked against the pool
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
#define PF_BAD_LENGTH 2    /* fewer pages than the prefix needs, an empty chunk, or positions past 2^31 */
#define PF_BAD_SHAPE 3     /* heads not a multiple of kv heads, head_dim not a multiple of 8 or too large, dtype */
#define PF_NO_MEMORY 5
#define PF_NO_LANES 6      /* 16 lanes asked of a CPU without AVX-512 */

#define PF_MAX_HEAD_DIM 256
#define TK 32              /* keys per tile (32: fewer rescalings of the output than 16, scores still in L1) */
#define BR 128             /* query rows per block (positions x group) */

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PF_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define PF_CLONES
#endif

typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }
static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }
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

/* The chunk's own queries, keys and values: token i's head h at q + i q_tok + h D (k and v likewise), so they
 * may be views into one projection's output */
struct chunk {
    const float *q, *k, *v;
    int64_t q_tok, k_tok, v_tok;
};

/* The rows of keys t0 .. t0 + cnt - 1 of KV head j, as float32: a float32 pool's rows where they lie, other pools'
 * widened into kbuf and vbuf ([TK][D]); slots past cnt point at a zero row, so a tile never carries a stale value
 * (a weight of 0 times a NaN would still be NaN). Positions below prefix_len are the pool's, the rest the chunk's
 * fresh k and v. */
static inline void tile_rows(const struct pool *pl, int64_t prefix_len, const struct chunk *ch, int j, int D,
                             int64_t t0, int cnt, const float *zero, float *kbuf, float *vbuf, const float **kr,
                             const float **vr) {
    int64_t page = t0 / pl->page_size, slot = t0 % pl->page_size;  /* one division per tile, not per key */
    for (int t = 0; t < TK; t++, slot++) {
        if (slot == pl->page_size) { page++; slot = 0; }
        const int64_t pos = t0 + t;
        if (t >= cnt) {
            kr[t] = vr[t] = zero;
        } else if (pos >= prefix_len) {
            kr[t] = ch->k + (pos - prefix_len) * ch->k_tok + j * D;
            vr[t] = ch->v + (pos - prefix_len) * ch->v_tok + j * D;
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

/* A thread's working space, kept for its next call (at most ~370 KiB, at head_dim 256): taken and given back at
 * every call of a pass, the heap's free blocks shifted between passes and every other pass faulted fresh pages */
static float *scratch_floats(size_t n) {
    static __thread float *buf;
    static __thread size_t cap;
    if (n > cap) {
        free(buf);
        buf = aligned_alloc(64, ((n * sizeof(float) + 63) & ~(size_t)63));
        cap = buf == NULL ? 0 : n;
    }
    return buf;
}

#define PF_CAT(a, b) a##b
#define PF_XCAT(a, b) PF_CAT(a, b)

/* 8 lanes: helpers inlined into the kernel, which gcc builds for x86-64-v4 (ymm), v3 and the baseline */
#define VL 8
#define KP 4
#define VR 2
#define HATTR
#define KATTR PF_CLONES
#include "prefill_attention_lanes.h"
#undef VL
#undef KP
#undef VR
#undef HATTR
#undef KATTR

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PF_HAVE_V4 1
/* 16 lanes where AVX-512 runs: 32 registers, so twice the keys per pass of the scores and the rows of the values */
#define VL 16
#define KP 8
#define VR 4
#define HATTR __attribute__((target("arch=x86-64-v4"), always_inline))
#define KATTR __attribute__((target("arch=x86-64-v4")))
#include "prefill_attention_lanes.h"
#undef VL
#undef KP
#undef VR
#undef HATTR
#undef KATTR
#else
#define PF_HAVE_V4 0
#endif

/*
 * q:      [L, H, D] float32 (unscaled)
 * q_tok, k_tok, v_tok: elements from one token's row of q (k_new, v_new) to the next; a token's heads contiguous
 * k_new, v_new: [L, kvh, D] float32: the chunk's own keys (after RoPE) and values
 * out:    [L, H, D] float32, contiguous
 * cache:  the layer's pool view; strides in elements: page, kv (K -> V), token, head; dimension D contiguous
 * pages:  [num_prefix_pages] int64: the pages holding positions 0 .. prefix_len - 1, in order
 * kv heads head_lo .. head_hi - 1 are computed (callers may split the heads over threads); next: NULL, or a
 *         counter shared by threads that call with the same arguments (from 0): each takes the next block of
 *         queries of a head from it until none is left, so a thread the scheduler holds back takes fewer
 * lanes:  0 the widest vectors the CPU runs, 8 or 16 (PF_NO_LANES where it has no AVX-512): both give the same
 *         floats
 */
int pd_prefill_attention(const float *q, const float *k_new, const float *v_new, int64_t q_tok, int64_t k_tok,
                         int64_t v_tok, float *out, int64_t L,
                         const void *cache, int dtype, int64_t num_pages, int64_t page_stride, int64_t kv_stride,
                         int64_t token_stride, int64_t head_stride, int page_size, int num_kv_heads, int num_heads,
                         int head_dim, const int64_t *pages, int64_t num_prefix_pages, int64_t prefix_len,
                         int head_lo, int head_hi, float scale, int lanes, int64_t *next) {
    if (dtype < PF_F32 || dtype > PF_F16 || num_kv_heads <= 0 || num_heads % num_kv_heads != 0 ||
        head_dim <= 0 || head_dim % 8 != 0 || head_dim > PF_MAX_HEAD_DIM || page_size <= 0 ||
        num_heads / num_kv_heads > BR || head_lo < 0 || head_hi > num_kv_heads || head_lo > head_hi)
        return PF_BAD_SHAPE;
    if (L <= 0 || prefix_len < 0 || (prefix_len + page_size - 1) / page_size > num_prefix_pages ||
        prefix_len + L >= INT32_MAX)  /* positions are compared as 32-bit lanes */
        return PF_BAD_LENGTH;
    for (int64_t p = 0; p < (prefix_len + page_size - 1) / page_size; p++)
        if (pages[p] < 0 || pages[p] >= num_pages) return PF_BAD_PAGE;
    const struct pool pl = {(const char *)cache, dtype, dtype == PF_F32 ? 4 : 2, page_stride, kv_stride,
                            token_stride, head_stride, page_size, pages};
    const struct chunk ch = {q, k_new, v_new, q_tok, k_tok, v_tok};
#if PF_HAVE_V4
    const int wide = __builtin_cpu_supports("x86-64-v4") != 0;
    if (lanes == 16 && !wide) return PF_NO_LANES;
    if (lanes != 8 && wide)
        return heads16(&ch, out, L, &pl, num_kv_heads, num_heads, head_dim, prefix_len, head_lo,
                       head_hi, scale, next);
#else
    if (lanes == 16) return PF_NO_LANES;
#endif
    return heads8(&ch, out, L, &pl, num_kv_heads, num_heads, head_dim, prefix_len, head_lo, head_hi,
                  scale, next);
}
