/* The body of csrc/prefill_attention.c's kernel for one vector width: that file includes it once for 8 lanes
 * (target clones for AVX2 and older) and, where gcc builds for x86-64, once for 16 (AVX-512), with
 *   VL     lanes per vector (8 or 16)
 *   KP     keys per pass of the score product (accumulators: KP x 2 vectors)
 *   VR     query rows per pass of the value product (accumulators: VR x 32 / VL vectors)
 *   HATTR  the helpers' attributes (empty: inlined into the clones; else the width's target, always inlined)
 *   KATTR  the kernel's
 * Every lane is one query row and does the same arithmetic in the same order whatever VL is: a score is a sum over
 * the head's dimensions in order, a row's maximum and sum are taken over the tile's keys in order, an output
 * element sums the tile's keys in order, so both widths give the same floats. */

#define PF_N(name) PF_XCAT(name, VL)
#define VF PF_N(vf)
#define VI PF_N(vi)
typedef float VF __attribute__((vector_size(VL * 4)));
typedef int32_t VI __attribute__((vector_size(VL * 4)));

static inline HATTR VF PF_N(vload)(const float *p) { VF v; memcpy(&v, p, sizeof v); return v; }
static inline HATTR void PF_N(vstore)(float *p, VF v) { memcpy(p, &v, sizeof v); }
static inline HATTR VI PF_N(iload)(const int32_t *p) { VI v; memcpy(&v, p, sizeof v); return v; }

static inline HATTR VF PF_N(vmax)(VF a, VF b) {
    const VI m = a > b;
    return (VF)((m & (VI)a) | (~m & (VI)b));
}

/* exp8_nonpositive's polynomial on VL lanes */
static inline HATTR VF PF_N(vexp)(VF x) {
    x = PF_N(vmax)(x, (VF){0} - 87.0f);
    const VI ni = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, VI);
    const VF n = __builtin_convertvector(ni, VF);
    const VF r = x - n * 0.693359375f + n * 2.12194440e-4f;
    VF p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * (VF)((ni + 127) << 23);
}

/* st[t][r] = kr[t] . qt[.][r]: the scores transposed (keys by query rows), so the row vectors are the query rows
 * and a key's element is a broadcast; rp (a multiple of 2 VL) rows, qt is [D][rp] */
static inline HATTR void PF_N(scores_t)(const float *qt, const float *const *kr, float *st, int rp, int D) {
    for (int rc = 0; rc < rp; rc += 2 * VL) {
        for (int t = 0; t < TK; t += KP) {
            VF a[KP][2];
            for (int u = 0; u < KP; u++) a[u][0] = a[u][1] = (VF){0};
            for (int i = 0; i < D; i++) {
                const VF x = PF_N(vload)(qt + i * rp + rc), y = PF_N(vload)(qt + i * rp + rc + VL);
                /* a scalar times a vector: gcc broadcasts it once (a hand-built splat costs 8 inserts in a clone) */
                for (int u = 0; u < KP; u++) {
                    const float kv = kr[t + u][i];
                    a[u][0] += kv * x;
                    a[u][1] += kv * y;
                }
            }
            for (int u = 0; u < KP; u++) {
                PF_N(vstore)(st + (t + u) * rp + rc, a[u][0]);
                PF_N(vstore)(st + (t + u) * rp + rc + VL, a[u][1]);
            }
        }
    }
}

/* ob[r] = ob[r] alpha[r] + sum_t w[t][r] vr[t] for rows 0 .. rp (a multiple of VR), D a multiple of 8 */
#define CV (32 / VL)  /* vectors per 32 columns */
static inline HATTR void PF_N(weighted_values)(const float *w, const float *const *vr, const float *alpha, float *ob,
                                               int rp, int D) {
    int c = 0;
    for (; c + 32 <= D; c += 32) {
        for (int r = 0; r < rp; r += VR) {
            VF x[VR][CV];
            for (int s = 0; s < VR; s++)
                for (int e = 0; e < CV; e++) x[s][e] = alpha[r + s] * PF_N(vload)(ob + (r + s) * D + c + e * VL);
            for (int t = 0; t < TK; t++) {
                const float *v = vr[t] + c;
                VF vv[CV];
                for (int e = 0; e < CV; e++) vv[e] = PF_N(vload)(v + e * VL);
                for (int s = 0; s < VR; s++) {
                    const float b = w[t * rp + r + s];
                    for (int e = 0; e < CV; e++) x[s][e] += b * vv[e];
                }
            }
            for (int s = 0; s < VR; s++)
                for (int e = 0; e < CV; e++) PF_N(vstore)(ob + (r + s) * D + c + e * VL, x[s][e]);
        }
    }
    for (; c < D; c += 8) {  /* 8 columns at a time: D is a multiple of 8, not always of VL */
        for (int r = 0; r < rp; r++) {
            float *o = ob + r * D + c;
            v8 x = alpha[r] * load8(o);
            for (int t = 0; t < TK; t++) x += w[t * rp + r] * load8(vr[t] + c);
            store8(o, x);
        }
    }
}
#undef CV

/* KV heads head_lo .. head_hi - 1 of pd_prefill_attention, whose arguments it has checked */
KATTR
static int PF_N(heads)(const struct chunk *ch, float *out, int64_t L,
                       const struct pool *pl, int kvh, int H, int D, int64_t prefix_len, int head_lo, int head_hi,
                       float scale, int64_t *next) {
    const int G = H / kvh;
    const int bq = BR / G;  /* query positions per block */
    const int RPMAX = (BR + 2 * VL - 1) & ~(2 * VL - 1);
    float *scratch = scratch_floats((size_t)(2 * RPMAX * D + RPMAX * TK + 3 * TK * D + 4 * RPMAX));
    if (scratch == NULL) return PF_NO_MEMORY;
    float *qt = scratch, *ob = qt + RPMAX * D, *st = ob + RPMAX * D, *kbuf = st + RPMAX * TK, *vbuf = kbuf + TK * D,
          *zero = vbuf + TK * D, *m = zero + TK * D, *l = m + RPMAX, *alpha = l + RPMAX;
    int32_t *rowpos = (int32_t *)(alpha + RPMAX);  /* each row's query position */
    memset(zero, 0, sizeof(float) * (size_t)D);
    const float *kr[TK], *vr[TK];
    const int64_t nh = head_hi - head_lo, blocks = (L + bq - 1) / bq;
    for (int64_t item = 0;; item++) {
        /* one block of queries of one head at a time: the last blocks (the most keys) first, so threads that share
         * the items through next end together */
        const int64_t it = next != NULL ? __atomic_fetch_add(next, 1, __ATOMIC_RELAXED) : item;
        if (it >= nh * blocks) break;
        const int j = head_lo + (int)(it % nh);
        const int64_t q0 = (blocks - 1 - it / nh) * bq;
        {
            const int nq = (int)(L - q0 < bq ? L - q0 : bq);
            /* padding rows: zero queries, results dropped */
            const int rows = nq * G, rp = (rows + 2 * VL - 1) & ~(2 * VL - 1);
            memset(qt, 0, sizeof(float) * (size_t)rp * D);
            for (int a = 0; a < nq; a++)
                for (int g = 0; g < G; g++) {
                    const float *src = ch->q + (q0 + a) * ch->q_tok + (j * G + g) * D;
                    for (int i = 0; i < D; i++) qt[i * rp + a * G + g] = src[i] * scale;
                }
            memset(ob, 0, sizeof(float) * (size_t)rp * D);
            for (int r = 0; r < rp; r++) { m[r] = -1e30f; l[r] = 0.0f; }
            const int64_t first = prefix_len + q0;     /* the block's first query position */
            const int64_t end = prefix_len + q0 + nq;  /* keys 0 .. end - 1 are seen by some row of the block */
            for (int r = 0; r < rp; r++) rowpos[r] = (int32_t)(first + r / G);
            for (int64_t t0 = 0; t0 < end; t0 += TK) {
                const int cnt = (int)(end - t0 < TK ? end - t0 : TK);
                tile_rows(pl, prefix_len, ch, j, D, t0, cnt, zero, kbuf, vbuf, kr, vr);
                PF_N(scores_t)(qt, kr, st, rp, D);
                /* keys after a row's position, or past the tile's end, weigh exactly 0 */
                const int masked = t0 + TK - 1 > first;
                for (int r = 0; r < rp; r += VL) {
                    const VF old = PF_N(vload)(m + r);
                    VF mx = old;
                    if (masked) {
                        const VI pos = PF_N(iload)(rowpos + r);
                        const VI low = (VI)((VF){0} - 1e30f);
                        for (int t = 0; t < TK; t++) {
                            const VI hide = ((VI){0} + (t < cnt ? (int32_t)(t0 + t) : INT32_MAX)) > pos;
                            const VF s = (VF)((hide & low) | (~hide & (VI)PF_N(vload)(st + t * rp + r)));
                            PF_N(vstore)(st + t * rp + r, s);
                            mx = PF_N(vmax)(mx, s);
                        }
                    } else {
                        for (int t = 0; t < TK; t++) mx = PF_N(vmax)(mx, PF_N(vload)(st + t * rp + r));
                    }
                    PF_N(vstore)(alpha + r, PF_N(vexp)(old - mx));
                    PF_N(vstore)(m + r, mx);
                    VF sum = PF_N(vload)(l + r) * PF_N(vload)(alpha + r);
                    for (int t = 0; t < TK; t++) {
                        const VF s = PF_N(vload)(st + t * rp + r);
                        VF e = PF_N(vexp)(s - mx);
                        if (masked)  /* a masked key weighs exactly 0, not e^-87 */
                            e = (VF)((s > -1e29f) & (VI)e);
                        PF_N(vstore)(st + t * rp + r, e);
                        sum += e;
                    }
                    PF_N(vstore)(l + r, sum);
                }
                PF_N(weighted_values)(st, vr, alpha, ob, rp, D);
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
    return PF_OK;
}

#undef VF
#undef VI
#undef PF_N
