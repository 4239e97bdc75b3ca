/* Paged decode attention on the CPU, reading a page-major KV pool where it lies.
 *
 * One new query token per sequence attends to every token of its pages, in page-table order, with an online
 * softmax per page (flash-decoding's running max and sum), so its work and memory follow the pages a step
 * reads: no copy of a page, no score for a page nobody in the batch reads, no score of a query head against a
 * KV head it does not use (grouped-query attention reads each KV row once for its whole group).
 *
 * The pool layer view is [num_pages, 2, page_size, kv_heads, head_dim] with any strides but a contiguous last
 * dimension (a layer of the page-major pool [num_pages, layers, 2, page_size, kv_heads, head_dim]). Elements
 * are float32, bfloat16 or float16; the arithmetic is float32 throughout. Every page id is checked against the
 * pool's size and every length against its page table before anything is read: a bad table is an error code,
 * never a read outside the pool.
 *
 * Built by services/engine/native.py (plain C, no Python or torch headers; called through ctypes, which
 * releases the GIL for the call).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define PD_F32 0
#define PD_BF16 1
#define PD_F16 2

#define PD_OK 0
#define PD_BAD_PAGE 1      /* a page id outside [0, num_pages) */
#define PD_BAD_LENGTH 2    /* a sequence longer than its page table, or empty */
#define PD_BAD_SHAPE 3     /* heads not a multiple of kv heads, head_dim or group too large, unknown dtype */

/* bounds of the per-call scratch, which lives on the calling thread's stack (at most ~400 KiB of it) */
#define MAX_HEAD_DIM 256
#define MAX_HEADS 128
#define MAX_PAGE 256
/* pages ahead whose rows a sequence's loop asks for while it computes this one: a layer's page lies a page stride
 * (all the layers' pages) from the last one read, past where the hardware's stride prefetch looks */
#define PREFETCH_PAGES 2

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
/* one build for every x86-64 host: the loader picks the widest vectors the CPU has */
#define PD_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define PD_CLONES
#endif

/* e^x for x <= 0 (a score less the running maximum): Cephes' expf, a degree-6 polynomial after reducing by
 * powers of two, within 2 ulp of expf over [-87, 0] and 0 below; plain arithmetic, so a loop of it vectorises
 * (libm's expf would not, unless -ffast-math, which sets flush-to-zero for the whole process); always inlined, as
 * from a large kernel gcc leaves a call per score and the loop does not vectorise */
__attribute__((always_inline)) static inline float exp_nonpositive(float x) {
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

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, u;
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
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* one row of head_dim elements as float32: a pointer into the pool for float32, else a converted copy */
static inline const float *row(const char *p, int dtype, int d, float *buf) {
    if (dtype == PD_F32) return (const float *)p;
    const uint16_t *h = (const uint16_t *)p;
    if (dtype == PD_BF16) {
        for (int i = 0; i < d; i++) buf[i] = bf16_to_f32(h[i]);
    } else {
        for (int i = 0; i < d; i++) buf[i] = f16_to_f32(h[i]);
    }
    return buf;
}

/* One sequence: every query head against its KV head's rows, page by page and, within a page, KV head by KV head
 * (the page's rows stay in the nearest cache across the heads). HD and HG are head_dim and the query heads per KV
 * head when they are compile-time constants (the common sizes: dot products and the accumulators of a group
 * unroll into registers), else 0, and d_ and group_ carry them. */
#define PD_SEQUENCE(NAME, HD, HG)                                                                               \
PD_CLONES static void NAME(const float *q, float *out, const char *base, int dtype, int64_t esize,              \
                 int64_t page_stride, int64_t kv_stride, int64_t token_stride, int64_t head_stride,             \
                 int page_size, int num_kv_heads, int d_, int group_, const int64_t *pages, int64_t n,          \
                 float scale) {                                                                                 \
    const int D = HD ? HD : d_, G = HG ? HG : group_, H = num_kv_heads * G;                                     \
    float qs[H][D], acc[H][D], m[H], l[H], s[G][page_size];                                                     \
    float kbuf[MAX_HEAD_DIM], vbuf[MAX_HEAD_DIM];                                                               \
    for (int h = 0; h < H; h++) {                                                                               \
        for (int i = 0; i < D; i++) { qs[h][i] = q[h * D + i] * scale; acc[h][i] = 0.0f; }                      \
        m[h] = -1e30f;                                                                                          \
        l[h] = 0.0f;                                                                                            \
    }                                                                                                           \
    const int64_t np = (n + page_size - 1) / page_size;                                                         \
    for (int64_t p = 0; p < np; p++) {                                                                          \
        const int cnt = (int)((n - p * page_size) < page_size ? (n - p * page_size) : page_size);               \
        const char *page = base + pages[p] * page_stride * esize;                                               \
        for (int j = 0; j < num_kv_heads; j++) {                                                                \
            const char *kp = page + j * head_stride * esize, *vp = kp + kv_stride * esize;                      \
            float (*qg)[D] = qs + j * G, (*ag)[D] = acc + j * G;                                                \
            for (int t = 0; t < cnt; t++) {                                                                     \
                const float *k = row(kp + t * token_stride * esize, dtype, D, kbuf);                            \
                for (int g = 0; g < G; g++) {                                                                   \
                    float dot = 0.0f;                                                                           \
                    for (int i = 0; i < D; i++) dot += qg[g][i] * k[i];                                         \
                    s[g][t] = dot;                                                                              \
                }                                                                                               \
            }                                                                                                   \
            for (int g = 0; g < G; g++) {                                                                       \
                const int h = j * G + g;                                                                        \
                float mx = m[h];                                                                                \
                for (int t = 0; t < cnt; t++) mx = s[g][t] > mx ? s[g][t] : mx;                                 \
                if (mx > m[h]) {                                                                                \
                    const float alpha = exp_nonpositive(m[h] - mx);                                             \
                    l[h] *= alpha;                                                                              \
                    for (int i = 0; i < D; i++) ag[g][i] *= alpha;                                              \
                    m[h] = mx;                                                                                  \
                }                                                                                               \
                float sum = 0.0f;                                                                               \
                for (int t = 0; t < cnt; t++) { s[g][t] = exp_nonpositive(s[g][t] - mx); sum += s[g][t]; }      \
                l[h] += sum;                                                                                    \
            }                                                                                                   \
            for (int t = 0; t < cnt; t++) {                                                                     \
                const float *v = row(vp + t * token_stride * esize, dtype, D, vbuf);                            \
                for (int g = 0; g < G; g++) {                                                                   \
                    const float w = s[g][t];                                                                    \
                    for (int i = 0; i < D; i++) ag[g][i] += w * v[i];                                           \
                }                                                                                               \
            }                                                                                                   \
        }                                                                                                       \
    }                                                                                                           \
    for (int h = 0; h < H; h++) {                                                                               \
        const float inv = 1.0f / l[h];                                                                          \
        for (int i = 0; i < D; i++) out[h * D + i] = acc[h][i] * inv;                                           \
    }                                                                                                           \
}

typedef float v8f __attribute__((vector_size(32), aligned(4))); /* 8 lanes, loaded from any float address */

/* the lanes of a and b summed in pairs: [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7] */
static inline v8f hadd(v8f a, v8f b) {
    return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) +
           __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}
/* eight vectors' lane sums, one per lane, each in one fixed order */
static inline v8f sums8(const v8f *a) {
    const v8f ab = hadd(a[0], a[1]), cd = hadd(a[2], a[3]), ef = hadd(a[4], a[5]), gh = hadd(a[6], a[7]);
    const v8f abcd = hadd(ab, cd), efgh = hadd(ef, gh); /* lanes 0-3 and 4-7 hold the two halves' sums */
    return __builtin_shufflevector(abcd, efgh, 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(abcd, efgh, 4, 5, 6, 7, 12, 13, 14, 15);
}

/* PD_SEQUENCE's attention in 8-lane vectors for the common sizes (head_dim HD a multiple of 8 and the group HG
 * compile-time), a page read token by token: one token's K (then V) rows of every KV head, the bytes in the order
 * they lie, where a KV head at a time strides through the page once per head (in a step whose KV is far larger
 * than the cache, the kernel waits on memory far longer than it computes, and the head-by-head order waited
 * longer), and the rows of the page PREFETCH_PAGES ahead asked for meanwhile.
 * Each score is a vector of products summed lane-wise, eight tokens' scores reduced together in sums8's order (a
 * lane's sum reads only its own token's products; the unused ones of a page's last eight are zeros, not whatever
 * the stack held). */
#define PD_SEQUENCE_V(NAME, HD, HG)                                                                             \
PD_CLONES static void NAME(const float *q, float *out, const char *base, int dtype, int64_t esize,              \
                 int64_t page_stride, int64_t kv_stride, int64_t token_stride, int64_t head_stride,             \
                 int page_size, int num_kv_heads, int d_, int group_, const int64_t *pages, int64_t n,          \
                 float scale) {                                                                                 \
    enum { D = HD, G = HG, NV = HD / 8 };                                                                       \
    (void)d_; (void)group_;                                                                                     \
    const int H = num_kv_heads * G, padded = (page_size + 7) & ~7;                                              \
    v8f qs[H][NV], acc[H][NV], part[H][8];                                                                      \
    float m[H], l[H], s[H][padded];                                                                             \
    float kbuf[MAX_HEAD_DIM], vbuf[MAX_HEAD_DIM];                                                               \
    for (int h = 0; h < H; h++) {                                                                               \
        for (int v = 0; v < NV; v++) {                                                                          \
            qs[h][v] = *(const v8f *)(q + h * D + v * 8) * scale;                                               \
            acc[h][v] = (v8f){0};                                                                               \
        }                                                                                                       \
        m[h] = -1e30f;                                                                                          \
        l[h] = 0.0f;                                                                                            \
    }                                                                                                           \
    const int64_t np = (n + page_size - 1) / page_size;                                                         \
    const int64_t span = ((num_kv_heads - 1) * head_stride + D) * esize;                                        \
    for (int64_t p = 0; p < np; p++) {                                                                          \
        const int cnt = (int)((n - p * page_size) < page_size ? (n - p * page_size) : page_size);               \
        const char *kpage = base + pages[p] * page_stride * esize, *vpage = kpage + kv_stride * esize;          \
        if (p + PREFETCH_PAGES < np) {                                                                          \
            const char *nk = base + pages[p + PREFETCH_PAGES] * page_stride * esize;                            \
            for (int t = 0; t < page_size; t++)                                                                 \
                for (int64_t o = 0; o < span; o += 64) {                                                        \
                    __builtin_prefetch(nk + t * token_stride * esize + o, 0, 2);                                \
                    __builtin_prefetch(nk + (kv_stride + t * token_stride) * esize + o, 0, 2);                  \
                }                                                                                               \
        }                                                                                                       \
        for (int t0 = 0; t0 < cnt; t0 += 8) {                                                                   \
            const int m8 = cnt - t0 < 8 ? cnt - t0 : 8;                                                         \
            for (int u = 0; u < m8; u++) {                                                                      \
                const char *kt = kpage + (t0 + u) * token_stride * esize;                                       \
                for (int j = 0; j < num_kv_heads; j++) {                                                        \
                    const float *k = row(kt + j * head_stride * esize, dtype, D, kbuf);                         \
                    for (int g = 0; g < G; g++) {                                                               \
                        const v8f *qh = qs[j * G + g];                                                          \
                        v8f a = qh[0] * *(const v8f *)k;                                                        \
                        for (int v = 1; v < NV; v++) a += qh[v] * *(const v8f *)(k + v * 8);                    \
                        part[j * G + g][u] = a;                                                                 \
                    }                                                                                           \
                }                                                                                               \
            }                                                                                                   \
            for (int h = 0; h < H; h++) {                                                                       \
                for (int u = m8; u < 8; u++) part[h][u] = (v8f){0};                                             \
                const v8f sv = sums8(part[h]);                                                                  \
                memcpy(s[h] + t0, &sv, sizeof sv);                                                              \
            }                                                                                                   \
        }                                                                                                       \
        for (int h = 0; h < H; h++) {                                                                           \
            float mx = m[h];                                                                                    \
            for (int t = 0; t < cnt; t++) mx = s[h][t] > mx ? s[h][t] : mx;                                     \
            if (mx > m[h]) {                                                                                    \
                const float alpha = exp_nonpositive(m[h] - mx);                                                 \
                l[h] *= alpha;                                                                                  \
                for (int v = 0; v < NV; v++) acc[h][v] *= alpha;                                                \
                m[h] = mx;                                                                                      \
            }                                                                                                   \
            float sum = 0.0f;                                                                                   \
            for (int t = 0; t < cnt; t++) { s[h][t] = exp_nonpositive(s[h][t] - mx); sum += s[h][t]; }          \
            l[h] += sum;                                                                                        \
        }                                                                                                       \
        for (int t = 0; t < cnt; t++) {                                                                         \
            const char *vt = vpage + t * token_stride * esize;                                                  \
            for (int j = 0; j < num_kv_heads; j++) {                                                            \
                const float *vr = row(vt + j * head_stride * esize, dtype, D, vbuf);                            \
                for (int g = 0; g < G; g++) {                                                                   \
                    const int h = j * G + g;                                                                    \
                    const float w = s[h][t];                                                                    \
                    for (int v = 0; v < NV; v++) acc[h][v] += w * *(const v8f *)(vr + v * 8);                   \
                }                                                                                               \
            }                                                                                                   \
        }                                                                                                       \
    }                                                                                                           \
    for (int h = 0; h < H; h++) {                                                                               \
        const float inv = 1.0f / l[h];                                                                          \
        for (int v = 0; v < NV; v++) {                                                                          \
            const v8f o = acc[h][v] * inv;                                                                      \
            memcpy(out + h * D + v * 8, &o, sizeof o);                                                          \
        }                                                                                                       \
    }                                                                                                           \
}

#define PD_SIZES(D)                                                                                             \
    PD_SEQUENCE_V(sequence_d##D##_g1, D, 1)                                                                     \
    PD_SEQUENCE_V(sequence_d##D##_g2, D, 2)                                                                     \
    PD_SEQUENCE_V(sequence_d##D##_g4, D, 4)                                                                     \
    PD_SEQUENCE_V(sequence_d##D##_g8, D, 8)
PD_SIZES(32)
PD_SIZES(64)
PD_SIZES(128)
PD_SEQUENCE(sequence_any, 0, 0)

typedef void (*sequence_fn)(const float *, float *, const char *, int, int64_t, int64_t, int64_t, int64_t, int64_t,
                            int, int, int, int, const int64_t *, int64_t, float);

static sequence_fn pick(int head_dim, int group) {
#define PD_PICK(D)                                                                                              \
    if (head_dim == D) {                                                                                        \
        if (group == 1) return sequence_d##D##_g1;                                                              \
        if (group == 2) return sequence_d##D##_g2;                                                              \
        if (group == 4) return sequence_d##D##_g4;                                                              \
        if (group == 8) return sequence_d##D##_g8;                                                              \
    }
    PD_PICK(32)
    PD_PICK(64)
    PD_PICK(128)
#undef PD_PICK
    return sequence_any;
}

/*
 * q:      [B, H, D] float32, contiguous
 * out:    [B, H, D] float32, contiguous
 * cache:  the layer's pool view; strides in elements: page, kv (K -> V), token, head; dimension D contiguous
 * table:  [B, table_stride] int64 page ids; lens: [B] int64 tokens each sequence attends (position + 1)
 */
PD_CLONES
int pd_paged_decode_attention(const float *q, float *out, const void *cache, int dtype, int64_t num_pages,
                              int64_t page_stride, int64_t kv_stride, int64_t token_stride, int64_t head_stride,
                              int page_size, int num_kv_heads, int num_heads, int head_dim,
                              const int64_t *table, int64_t table_stride, const int64_t *lens, int batch,
                              float scale) {
    if (dtype < PD_F32 || dtype > PD_F16 || num_kv_heads <= 0 || num_heads % num_kv_heads != 0 ||
        head_dim <= 0 || head_dim > MAX_HEAD_DIM || num_heads > MAX_HEADS || page_size <= 0 ||
        page_size > MAX_PAGE)
        return PD_BAD_SHAPE;
    /* every table entry a step reads, checked before any read */
    for (int b = 0; b < batch; b++) {
        int64_t n = lens[b];
        if (n <= 0 || (n + page_size - 1) / page_size > table_stride) return PD_BAD_LENGTH;
        for (int64_t p = 0; p < (n + page_size - 1) / page_size; p++) {
            int64_t page = table[b * table_stride + p];
            if (page < 0 || page >= num_pages) return PD_BAD_PAGE;
        }
    }
    const int64_t esize = dtype == PD_F32 ? 4 : 2;
    const sequence_fn fn = pick(head_dim, num_heads / num_kv_heads);
    for (int b = 0; b < batch; b++)
        fn(q + (int64_t)b * num_heads * head_dim, out + (int64_t)b * num_heads * head_dim, (const char *)cache,
           dtype, esize, page_stride, kv_stride, token_stride, head_stride, page_size, num_kv_heads, head_dim,
           num_heads / num_kv_heads, table + b * table_stride, lens[b], scale);
    return PD_OK;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, as torch's .to(torch.bfloat16) */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays a quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* x * cos + rotate_half(x) * sin, transformers' rotation, with sin's first half negated (rope.py), rounded as
 * torch rounds it: each product, then the sum. -ffast-math lets gcc contract a * b + c * d into a fused
 * multiply-add in the x86-64-v3/v4 clones (1 ulp off torch's K in ~9 % of elements on an AVX-512 machine), and the
 * K written here must be, bit for bit, the K the torch path writes; not inlined, so the caller's clone target
 * cannot bring FMA back. */
__attribute__((noinline, optimize("fp-contract=off")))
static void rope(const float *x, const float *cos, const float *sin, int d, float *out) {
    const int half = d / 2;  /* rotate_half(x)[i] is x[i + half] in the first half, x[i - half] in the second */
    for (int i = 0; i < half; i++) out[i] = x[i] * cos[i] + x[i + half] * sin[i];
    for (int i = half; i < d; i++) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

/*
 * A decode step's attention from the fused q/k/v projection on: RoPE on q and k, the new token's K and V written
 * into its slot of its own last page, then paged attention over each sequence's pages (pd_paged_decode_attention's
 * arithmetic). One call per layer instead of a dozen tensor ops.
 *
 * qkv:    [B, (H + 2 kvh) * D] float32, rows qkv_stride apart (q heads, then k heads, then v heads)
 * cos, sin: [B, D] float32 (sin with its first half negated)
 * q_rot:  [B, H, D] float32 scratch; out: [B, H, D] float32
 * The slot written is the one lens[b] - 1 names in the sequence's own table: nothing is written anywhere else.
 * dtype: the pool's, float32 or bfloat16.
 */
PD_CLONES
int pd_decode_attention_block(const float *qkv, int64_t qkv_stride, const float *cos, const float *sin,
                              float *q_rot, float *out, void *cache, int dtype, int64_t num_pages,
                              int64_t page_stride, int64_t kv_stride, int64_t token_stride, int64_t head_stride,
                              int page_size, int num_kv_heads, int num_heads, int head_dim,
                              const int64_t *table, int64_t table_stride, const int64_t *lens, int batch,
                              float scale) {
    if (dtype != PD_F32 && dtype != PD_BF16) return PD_BAD_SHAPE;
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || head_dim <= 0 || head_dim > MAX_HEAD_DIM ||
        head_dim % 2 != 0 || num_heads > MAX_HEADS || page_size <= 0 || page_size > MAX_PAGE)
        return PD_BAD_SHAPE;
    for (int b = 0; b < batch; b++) {  /* every page read or written, checked before any byte moves */
        int64_t n = lens[b];
        if (n <= 0 || (n + page_size - 1) / page_size > table_stride) return PD_BAD_LENGTH;
        for (int64_t p = 0; p < (n + page_size - 1) / page_size; p++) {
            int64_t page = table[b * table_stride + p];
            if (page < 0 || page >= num_pages) return PD_BAD_PAGE;
        }
    }
    const int D = head_dim, H = num_heads, kvh = num_kv_heads;
    const int64_t esize = dtype == PD_F32 ? 4 : 2;
    float k_rot[MAX_HEAD_DIM];
    for (int b = 0; b < batch; b++) {
        const float *row = qkv + b * qkv_stride, *c = cos + (int64_t)b * D, *s = sin + (int64_t)b * D;
        for (int h = 0; h < H; h++) rope(row + h * D, c, s, D, q_rot + ((int64_t)b * H + h) * D);
        const int64_t pos = lens[b] - 1;
        const int64_t page = table[b * table_stride + pos / page_size];
        char *slot = (char *)cache + (page * page_stride + (pos % page_size) * token_stride) * esize;
        for (int j = 0; j < kvh; j++) {
            const float *k = row + (H + j) * D, *v = row + (H + kvh + j) * D;
            rope(k, c, s, D, k_rot);
            char *kd = slot + j * head_stride * esize, *vd = kd + kv_stride * esize;
            if (dtype == PD_F32) {
                memcpy(kd, k_rot, D * 4);
                memcpy(vd, v, D * 4);
            } else {
                uint16_t *kb = (uint16_t *)kd, *vb = (uint16_t *)vd;
                for (int i = 0; i < D; i++) { kb[i] = f32_to_bf16(k_rot[i]); vb[i] = f32_to_bf16(v[i]); }
            }
        }
    }
    const sequence_fn fn = pick(head_dim, num_heads / num_kv_heads);
    for (int b = 0; b < batch; b++)
        fn(q_rot + (int64_t)b * H * D, out + (int64_t)b * H * D, (const char *)cache, dtype, esize, page_stride,
           kv_stride, token_stride, head_stride, page_size, kvh, D, H / kvh, table + b * table_stride, lens[b],
           scale);
    return PD_OK;
}
