/* Paged decode attention on the CPU, reading a page-major KV pool where it lies.
 *
 * One new query token per sequence attends to every token of its pages, in page-table order, with an online
 * softmax per page, or per 64 tokens of a longer one (flash-decoding's running max and sum), so its work and memory
 * follow the pages a step reads: no copy of a float32 page, no score for a page nobody in the batch reads, no score of a query head against a
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
/* pages ahead (in the step's order, across sequences) whose lines the loop asks for while it computes this one */
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

/* A step's attention: the pool layer view, the batch's queries, tables and lengths (all checked by the caller) */
typedef struct {
    const float *q;             /* [batch, H, D] */
    float *out;                 /* [batch, H, D] */
    const char *base;           /* the layer view's first element */
    int dtype;
    int64_t esize;
    int64_t page_stride, kv_stride, token_stride, head_stride;  /* in elements */
    int page_size, num_kv_heads, head_dim, group;
    const int64_t *table;
    int64_t table_stride;
    const int64_t *lens;
    int batch;
    float scale;
} pd_step;

static inline int64_t num_pages_of(const pd_step *st, int b) {
    return (st->lens[b] + st->page_size - 1) / st->page_size;
}

/* The generic path (any head_dim and group): one sequence at a time, every query head against its KV head's rows,
 * page by page and, within a page, KV head by KV head, a row at a time through row(). */
static void attend_any(const pd_step *st) {
    const int D = st->head_dim, G = st->group, kvh = st->num_kv_heads, H = kvh * G, ps = st->page_size;
    const int64_t esize = st->esize;
    float qs[H][D], acc[H][D], m[H], l[H], s[G][ps];
    float kbuf[MAX_HEAD_DIM], vbuf[MAX_HEAD_DIM];
    for (int b = 0; b < st->batch; b++) {
        const float *q = st->q + (int64_t)b * H * D;
        float *out = st->out + (int64_t)b * H * D;
        const int64_t *pages = st->table + b * st->table_stride, n = st->lens[b];
        for (int h = 0; h < H; h++) {
            for (int i = 0; i < D; i++) { qs[h][i] = q[h * D + i] * st->scale; acc[h][i] = 0.0f; }
            m[h] = -1e30f;
            l[h] = 0.0f;
        }
        for (int64_t p = 0; p < num_pages_of(st, b); p++) {
            const int cnt = (int)((n - p * ps) < ps ? (n - p * ps) : ps);
            const char *page = st->base + pages[p] * st->page_stride * esize;
            for (int j = 0; j < kvh; j++) {
                const char *kp = page + j * st->head_stride * esize, *vp = kp + st->kv_stride * esize;
                float (*qg)[D] = qs + j * G, (*ag)[D] = acc + j * G;
                for (int t = 0; t < cnt; t++) {
                    const float *k = row(kp + t * st->token_stride * esize, st->dtype, D, kbuf);
                    for (int g = 0; g < G; g++) {
                        float dot = 0.0f;
                        for (int i = 0; i < D; i++) dot += qg[g][i] * k[i];
                        s[g][t] = dot;
                    }
                }
                for (int g = 0; g < G; g++) {
                    const int h = j * G + g;
                    float mx = m[h];
                    for (int t = 0; t < cnt; t++) mx = s[g][t] > mx ? s[g][t] : mx;
                    if (mx > m[h]) {
                        const float alpha = exp_nonpositive(m[h] - mx);
                        l[h] *= alpha;
                        for (int i = 0; i < D; i++) ag[g][i] *= alpha;
                        m[h] = mx;
                    }
                    float sum = 0.0f;
                    for (int t = 0; t < cnt; t++) { s[g][t] = exp_nonpositive(s[g][t] - mx); sum += s[g][t]; }
                    l[h] += sum;
                }
                for (int t = 0; t < cnt; t++) {
                    const float *v = row(vp + t * st->token_stride * esize, st->dtype, D, vbuf);
                    for (int g = 0; g < G; g++) {
                        const float w = s[g][t];
                        for (int i = 0; i < D; i++) ag[g][i] += w * v[i];
                    }
                }
            }
        }
        for (int h = 0; h < H; h++) {
            const float inv = 1.0f / l[h];
            for (int i = 0; i < D; i++) out[h * D + i] = acc[h][i] * inv;
        }
    }
}

typedef float v8f __attribute__((vector_size(32), aligned(4)));   /* 8 lanes, loaded from any float address */
typedef int32_t v8i __attribute__((vector_size(32), aligned(4)));
typedef uint32_t v8u __attribute__((vector_size(32), aligned(4)));
typedef uint16_t v8h __attribute__((vector_size(16), aligned(2)));

/* eight elements of a row as float32, exactly: bf16 and f16 widen by integer arithmetic in vectors (f16 as in
 * f16_to_f32: the exponent rebiased by a multiplication by 2^112, which is exact for subnormals too, since the
 * process keeps its subnormals; infinities and NaNs keep their bits) */
__attribute__((always_inline)) static inline v8f load8(const char *p, int dtype) {
    if (dtype == PD_F32) return *(const v8f *)p;
    const v8u x = __builtin_convertvector(*(const v8h *)p, v8u);
    if (dtype == PD_BF16) return (v8f)(x << 16);
    const v8u em = (x & 0x7fffu) << 13, special = (v8u)((x & 0x7c00u) == 0x7c00u);
    const v8u finite = (v8u)((v8f)em * 0x1p112f);
    return (v8f)((finite & ~special) | ((em | 0x7f800000u) & special) | ((x & 0x8000u) << 16));
}

static inline v8f vmax(v8f a, v8f b) {
    const v8i gt = a > b;
    return (v8f)(((v8i)a & gt) | ((v8i)b & ~gt));
}

/* exp_nonpositive in 8 lanes (n rounded half away from zero where the scalar one rounds half up: either keeps the
 * reduced argument within the polynomial's range) */
__attribute__((always_inline)) static inline v8f exp8(v8f x) {
    x = vmax(x, (v8f){0} - 87.0f);
    const v8i n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, v8i);  /* truncation, of a value < 0 */
    const v8f nf = __builtin_convertvector(n, v8f);
    const v8f r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
    v8f p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * (v8f)((n + 127) << 23);
}

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

static inline float hsum8(v8f v) { return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7])); }

/* Prefetching: a page's K rows (every KV head's) lie in one extent and its V rows in another, a layer's page a page
 * stride (all the layers' pages) from the last one read, past where the hardware's stride prefetch looks. While a
 * page is computed, the lines of the page PREFETCH_PAGES ahead in the step's order (into the next sequence's first
 * pages at the end of one) are asked for a share at a time between the passes over its heads, so misses stay in
 * flight while the core computes. Every line is asked for (every other one, leaving the rest to the hardware's
 * adjacent-line prefetch, ran at 2/3 of the speed), with prefetcht1: on an AMD EPYC (Zen 4), over KV far larger than
 * the cache, prefetcht0 or prefetchnta ran 1.6x slower. */
typedef struct {
    int b;              /* the sequence and page the prefetch has reached; b == batch: past the step's last page */
    int64_t p, np;      /* np: the sequence's pages */
    int64_t lines_k;    /* lines of a page's K extent (so of its V extent) */
} pd_ahead;

static inline void ahead_next(const pd_step *st, pd_ahead *a) {
    if (a->b < st->batch && ++a->p >= a->np) {
        a->p = 0;
        if (++a->b < st->batch) a->np = num_pages_of(st, a->b);
    }
}

/* lines [from, to) of the page ahead: its K extent's, then its V extent's. Always inlined: gcc 12 finds a function
 * of prefetches alone free of side effects and drops every call of it. */
__attribute__((always_inline)) static inline void ahead_fetch(const pd_step *st, const pd_ahead *a, int64_t from,
                                                              int64_t to) {
    if (a->b >= st->batch) return;
    if (to > 2 * a->lines_k) to = 2 * a->lines_k;
    const uintptr_t k = (uintptr_t)(st->base + st->table[a->b * st->table_stride + a->p] * st->page_stride *
                                    st->esize) & ~(uintptr_t)63;
    const uintptr_t v = (uintptr_t)(st->base + (st->table[a->b * st->table_stride + a->p] * st->page_stride +
                                                st->kv_stride) * st->esize) & ~(uintptr_t)63;
    for (int64_t i = from; i < to && i < a->lines_k; i++)
        __builtin_prefetch((const char *)(k + i * 64), 0, 2);
    for (int64_t i = from > a->lines_k ? from : a->lines_k; i < to; i++)
        __builtin_prefetch((const char *)(v + (i - a->lines_k) * 64), 0, 2);
}

/* The attention in 8-lane vectors for the common sizes: head_dim HD (a multiple of 32), the group HG and the pool
 * dtype DT compile-time. A page is read up to SEGMENT tokens at a time in three passes over its KV heads, each
 * pass's work independent across heads so the core overlaps it: every token's score for every query head (a
 * vector of products per token, eight tokens' reduced together in sums8's order); the online softmax of each head
 * (the running maximum, once per head and segment, and the running sum in 8 lanes); the V rows weighted into the
 * accumulators, a V row's four vectors at a time for two heads of a group at once (eight chains of multiply-adds
 * in registers). Float32 rows are read where they lie; other dtypes', and the rows of a segment that does not end
 * on a multiple of eight, are first copied into a float32 block padded with zero rows of weight zero (never the
 * bytes past the sequence's end). */
#define SEGMENT 64
#define PD_ATTEND(NAME, HD, HG, DT)                                                                             \
PD_CLONES static void NAME(const pd_step *st) {                                                                 \
    enum { D = HD, G = HG, NV = HD / 8, GS = HG > 1 ? 2 : 1 };                                                  \
    const int kvh = st->num_kv_heads, H = kvh * G, ps = st->page_size;                                          \
    const int64_t es = DT == PD_F32 ? 4 : 2, tsb = st->token_stride * es, hsb = st->head_stride * es,           \
                  kvb = st->kv_stride * es, psb = st->page_stride * es;                                         \
    v8f qs[H][NV], acc[H][NV], lsum[H], sc[H][SEGMENT / 8];                                                     \
    float m[H], w[H][SEGMENT] __attribute__((aligned(32)));                                                     \
    v8f rows[SEGMENT][NV];                                                                                      \
    const int64_t extent = ((ps - 1) * st->token_stride + (kvh - 1) * st->head_stride + D) * es;                \
    pd_ahead ahead = {0, 0, num_pages_of(st, 0), (extent + 63) / 64 + 1};                                       \
    const int64_t lines = 2 * ahead.lines_k, share = (lines + 2 * kvh - 1) / (2 * kvh);                         \
    for (int i = 0; i < PREFETCH_PAGES; i++) { ahead_fetch(st, &ahead, 0, lines); ahead_next(st, &ahead); }     \
    for (int b = 0; b < st->batch; b++) {                                                                       \
        const float *q = st->q + (int64_t)b * H * D;                                                            \
        const int64_t n = st->lens[b], np = num_pages_of(st, b), *pages = st->table + b * st->table_stride;     \
        for (int h = 0; h < H; h++) {                                                                           \
            for (int v = 0; v < NV; v++) {                                                                      \
                qs[h][v] = *(const v8f *)(q + h * D + v * 8) * st->scale;                                       \
                acc[h][v] = (v8f){0};                                                                           \
            }                                                                                                   \
            lsum[h] = (v8f){0};                                                                                 \
            m[h] = -1e30f;                                                                                      \
        }                                                                                                       \
        for (int64_t p = 0; p < np; p++) {                                                                      \
            const int cnt = (int)((n - p * ps) < ps ? (n - p * ps) : ps);                                       \
            const char *kpage = st->base + pages[p] * psb, *vpage = kpage + kvb;                                \
            int64_t fetched = 0;                                                                                \
            for (int s0 = 0; s0 < cnt; s0 += SEGMENT) {                                                         \
                const int scnt = cnt - s0 < SEGMENT ? cnt - s0 : SEGMENT, nb = (scnt + 7) / 8;                  \
                const int direct = DT == PD_F32 && scnt % 8 == 0;                                               \
                for (int j = 0; j < kvh; j++) {                                                                 \
                    if (fetched < lines) ahead_fetch(st, &ahead, fetched, fetched + share);                     \
                    fetched += share;                                                                           \
                    const char *kr = kpage + s0 * tsb + j * hsb;                                                \
                    int64_t rs = tsb;                                                                           \
                    if (!direct) {                                                                              \
                        for (int u = 0; u < nb * 8; u++)                                                        \
                            for (int v = 0; v < NV; v++)                                                        \
                                rows[u][v] = u < scnt ? load8(kr + u * tsb + v * 8 * es, DT) : (v8f){0};        \
                        kr = (const char *)rows;                                                                \
                        rs = sizeof rows[0];                                                                    \
                    }                                                                                           \
                    for (int i = 0; i < nb; i++) {                                                              \
                        for (int g = 0; g < G; g++) {                                                           \
                            const int h = j * G + g;                                                            \
                            v8f part[8];                                                                        \
                            _Pragma("GCC unroll 4")                                                             \
                            for (int c = 0; c < NV; c += 4) {                                                   \
                                const v8f q0 = qs[h][c], q1 = qs[h][c + 1], q2 = qs[h][c + 2], q3 = qs[h][c + 3]; \
                                _Pragma("GCC unroll 8")                                                         \
                                for (int u = 0; u < 8; u++) {                                                   \
                                    const v8f *k = (const v8f *)(kr + (i * 8 + u) * rs) + c;                    \
                                    const v8f s = q0 * k[0] + q1 * k[1] + q2 * k[2] + q3 * k[3];                \
                                    part[u] = c ? part[u] + s : s;                                              \
                                }                                                                               \
                            }                                                                                   \
                            sc[h][i] = sums8(part);                                                             \
                        }                                                                                       \
                    }                                                                                           \
                }                                                                                               \
                const v8i live = (v8i){0, 1, 2, 3, 4, 5, 6, 7} < scnt - (nb - 1) * 8;                           \
                for (int h = 0; h < H; h++) {                                                                   \
                    sc[h][nb - 1] = (v8f)(((v8i)sc[h][nb - 1] & live) | ((v8i)((v8f){0} - 1e30f) & ~live));     \
                    v8f mv = sc[h][0];                                                                          \
                    for (int i = 1; i < nb; i++) mv = vmax(mv, sc[h][i]);                                       \
                    mv = vmax(mv, __builtin_shufflevector(mv, mv, 4, 5, 6, 7, 0, 1, 2, 3));                     \
                    mv = vmax(mv, __builtin_shufflevector(mv, mv, 2, 3, 0, 1, 6, 7, 4, 5));                     \
                    mv = vmax(mv, __builtin_shufflevector(mv, mv, 1, 0, 3, 2, 5, 4, 7, 6));                     \
                    const float mx = mv[0] > m[h] ? mv[0] : m[h];                                               \
                    if (mx > m[h]) {                                                                            \
                        const float alpha = exp_nonpositive(m[h] - mx);                                         \
                        lsum[h] *= alpha;                                                                       \
                        for (int v = 0; v < NV; v++) acc[h][v] *= alpha;                                        \
                        m[h] = mx;                                                                              \
                    }                                                                                           \
                    for (int i = 0; i < nb; i++) {                                                              \
                        v8f e = exp8(sc[h][i] - mx);                                                            \
                        if (i == nb - 1) e = (v8f)((v8i)e & live);                                              \
                        lsum[h] += e;                                                                           \
                        *(v8f *)(w[h] + i * 8) = e;                                                             \
                    }                                                                                           \
                }                                                                                               \
                for (int j = 0; j < kvh; j++) {                                                                 \
                    if (fetched < lines) ahead_fetch(st, &ahead, fetched, fetched + share);                     \
                    fetched += share;                                                                           \
                    const char *vr = vpage + s0 * tsb + j * hsb;                                                \
                    int64_t rs = tsb;                                                                           \
                    if (!direct) {                                                                              \
                        for (int u = 0; u < nb * 8; u++)                                                        \
                            for (int v = 0; v < NV; v++)                                                        \
                                rows[u][v] = u < scnt ? load8(vr + u * tsb + v * 8 * es, DT) : (v8f){0};        \
                        vr = (const char *)rows;                                                                \
                        rs = sizeof rows[0];                                                                    \
                    }                                                                                           \
                    for (int g = 0; g < G; g += GS) {                                                           \
                        const int h = j * G + g;                                                                \
                        _Pragma("GCC unroll 4")                                                                 \
                        for (int c = 0; c < NV; c += 4) {                                                       \
                            v8f a[GS][4];                                                                       \
                            for (int x = 0; x < GS; x++)                                                        \
                                for (int y = 0; y < 4; y++) a[x][y] = acc[h + x][c + y];                        \
                            for (int t = 0; t < nb * 8; t++) {                                                  \
                                const v8f *v = (const v8f *)(vr + t * rs) + c;                                  \
                                const v8f v0 = v[0], v1 = v[1], v2 = v[2], v3 = v[3];                           \
                                for (int x = 0; x < GS; x++) {                                                  \
                                    const float wt = w[h + x][t];                                               \
                                    a[x][0] += wt * v0; a[x][1] += wt * v1;                                     \
                                    a[x][2] += wt * v2; a[x][3] += wt * v3;                                     \
                                }                                                                               \
                            }                                                                                   \
                            for (int x = 0; x < GS; x++)                                                        \
                                for (int y = 0; y < 4; y++) acc[h + x][c + y] = a[x][y];                        \
                        }                                                                                       \
                    }                                                                                           \
                }                                                                                               \
            }                                                                                                   \
            if (fetched < lines) ahead_fetch(st, &ahead, fetched, lines);                                       \
            ahead_next(st, &ahead);                                                                             \
        }                                                                                                       \
        float *out = st->out + (int64_t)b * H * D;                                                              \
        for (int h = 0; h < H; h++) {                                                                           \
            const float inv = 1.0f / hsum8(lsum[h]);                                                            \
            for (int v = 0; v < NV; v++) {                                                                      \
                const v8f o = acc[h][v] * inv;                                                                  \
                memcpy(out + h * D + v * 8, &o, sizeof o);                                                      \
            }                                                                                                   \
        }                                                                                                       \
    }                                                                                                           \
}

#define PD_GROUPS(D, DT, T)                                                                                     \
    PD_ATTEND(attend_d##D##_g1_##T, D, 1, DT)                                                                   \
    PD_ATTEND(attend_d##D##_g2_##T, D, 2, DT)                                                                   \
    PD_ATTEND(attend_d##D##_g4_##T, D, 4, DT)                                                                   \
    PD_ATTEND(attend_d##D##_g8_##T, D, 8, DT)
#define PD_SIZES(DT, T) PD_GROUPS(32, DT, T) PD_GROUPS(64, DT, T) PD_GROUPS(128, DT, T)
PD_SIZES(PD_F32, f32)
PD_SIZES(PD_BF16, bf16)
PD_SIZES(PD_F16, f16)

typedef void (*attend_fn)(const pd_step *);

static attend_fn pick(int dtype, int head_dim, int group) {
#define PD_PICK_G(D, T)                                                                                         \
    if (group == 1) return attend_d##D##_g1_##T;                                                                \
    if (group == 2) return attend_d##D##_g2_##T;                                                                \
    if (group == 4) return attend_d##D##_g4_##T;                                                                \
    if (group == 8) return attend_d##D##_g8_##T;
#define PD_PICK(D)                                                                                              \
    if (head_dim == D) {                                                                                        \
        if (dtype == PD_F32) { PD_PICK_G(D, f32) }                                                              \
        if (dtype == PD_BF16) { PD_PICK_G(D, bf16) }                                                            \
        if (dtype == PD_F16) { PD_PICK_G(D, f16) }                                                              \
    }
    PD_PICK(32)
    PD_PICK(64)
    PD_PICK(128)
#undef PD_PICK
#undef PD_PICK_G
    return attend_any;
}

/* the step's attention, its table and lengths already checked */
static void attend(const float *q, float *out, const void *cache, int dtype, int64_t page_stride,
                   int64_t kv_stride, int64_t token_stride, int64_t head_stride, int page_size, int num_kv_heads,
                   int num_heads, int head_dim, const int64_t *table, int64_t table_stride, const int64_t *lens,
                   int batch, float scale) {
    const pd_step st = {q, out, (const char *)cache, dtype, dtype == PD_F32 ? 4 : 2, page_stride, kv_stride,
                        token_stride, head_stride, page_size, num_kv_heads, head_dim, num_heads / num_kv_heads,
                        table, table_stride, lens, batch, scale};
    pick(dtype, head_dim, num_heads / num_kv_heads)(&st);
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
    attend(q, out, cache, dtype, page_stride, kv_stride, token_stride, head_stride, page_size, num_kv_heads,
           num_heads, head_dim, table, table_stride, lens, batch, scale);
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

/* One token's K and V heads into its slot: a float32 pool takes them as they are, a bfloat16 one rounded. */
static void write_slot(const float *k, const float *v, char *slot, int dtype, int64_t kv_stride, int64_t head_stride,
                       int kvh, int D) {
    const int64_t esize = dtype == PD_F32 ? 4 : 2;
    for (int j = 0; j < kvh; j++) {
        char *kd = slot + j * head_stride * esize, *vd = kd + kv_stride * esize;
        if (dtype == PD_F32) {
            memcpy(kd, k + j * D, D * 4);
            memcpy(vd, v + j * D, D * 4);
        } else {
            uint16_t *kb = (uint16_t *)kd, *vb = (uint16_t *)vd;
            for (int i = 0; i < D; i++) { kb[i] = f32_to_bf16(k[j * D + i]); vb[i] = f32_to_bf16(v[j * D + i]); }
        }
    }
}

/*
 * A prefill pass's rotation and K/V write, one call per layer in place of a dozen tensor ops: RoPE on every q and k
 * head of the fused projection's rows, in place (the pass's attention reads them there), then each token's K and V
 * into the slot slot_pages[t], slot_offsets[t] names. Every slot is checked before any byte moves.
 *
 * qkv:    [T, (H + 2 kvh) * D] float32, rows qkv_stride apart; cos, sin: [T, D] (rope.py's tables)
 */
PD_CLONES
int pd_prefill_rope_kv(float *qkv, int64_t T, int64_t qkv_stride, const float *cos, const float *sin, void *cache,
                       int dtype, int64_t num_pages, int64_t page_stride, int64_t kv_stride, int64_t token_stride,
                       int64_t head_stride, const int64_t *slot_pages, const int64_t *slot_offsets, int page_size,
                       int num_kv_heads, int num_heads, int head_dim) {
    if (dtype != PD_F32 && dtype != PD_BF16) return PD_BAD_SHAPE;
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || head_dim <= 0 || head_dim > MAX_HEAD_DIM ||
        head_dim % 2 != 0 || page_size <= 0)
        return PD_BAD_SHAPE;
    for (int64_t t = 0; t < T; t++)
        if (slot_pages[t] < 0 || slot_pages[t] >= num_pages || slot_offsets[t] < 0 || slot_offsets[t] >= page_size)
            return PD_BAD_PAGE;
    const int D = head_dim, H = num_heads, kvh = num_kv_heads;
    const int64_t esize = dtype == PD_F32 ? 4 : 2;
    float tmp[MAX_HEAD_DIM];
    for (int64_t t = 0; t < T; t++) {
        float *row = qkv + t * qkv_stride;
        const float *c = cos + t * D, *s = sin + t * D;
        for (int h = 0; h < H + kvh; h++) {
            rope(row + h * D, c, s, D, tmp);
            memcpy(row + h * D, tmp, D * 4);
        }
        char *slot = (char *)cache + (slot_pages[t] * page_stride + slot_offsets[t] * token_stride) * esize;
        write_slot(row + H * D, row + (H + kvh) * D, slot, dtype, kv_stride, head_stride, kvh, D);
    }
    return PD_OK;
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
    float k_rot[MAX_HEADS * MAX_HEAD_DIM];
    for (int b = 0; b < batch; b++) {
        const float *row = qkv + b * qkv_stride, *c = cos + (int64_t)b * D, *s = sin + (int64_t)b * D;
        for (int h = 0; h < H; h++) rope(row + h * D, c, s, D, q_rot + ((int64_t)b * H + h) * D);
        const int64_t pos = lens[b] - 1;
        const int64_t page = table[b * table_stride + pos / page_size];
        char *slot = (char *)cache + (page * page_stride + (pos % page_size) * token_stride) * esize;
        for (int j = 0; j < kvh; j++) rope(row + (H + j) * D, c, s, D, k_rot + j * D);
        write_slot(k_rot, row + (H + kvh) * D, slot, dtype, kv_stride, head_stride, kvh, D);
    }
    attend(q_rot, out, cache, dtype, page_stride, kv_stride, token_stride, head_stride, page_size, kvh, H, D, table,
           table_stride, lens, batch, scale);
    return PD_OK;
}
