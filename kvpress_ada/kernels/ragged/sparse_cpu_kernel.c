/* Quest page bounds and attention over the selected pages of a full-precision ragged cache, on the CPU.
 *
 * The fused forms of kvpress_ada/kernels/ragged/sparse.py's torch code (page_bounds, sparse_attention_ref):
 * same pages, same bottom-right causal rule, same soft-cap and sinks, float32 arithmetic. Each selected page is
 * read where it lies (no gathered copy, no padding to the longest row's list). Built and loaded by
 * sparse_cpu_kernel.py (ctypes); one thread, no allocation but one buffer per call.
 *
 * Rows r = b * H_kv + h; page j of row r is flat page table[r, j] (-1: none), slots table[r, j] * P ..
 * dtype (keys, values, summaries): 0 float32, 1 float16, 2 bfloat16.
 *
 *   kvs_page_bounds:     qs float32 [R, GQ, D] (queries times the scale), kmin, kmax [pages, D];
 *                        out float32 [R, GQ, W]: max(q, 0) . kmax + min(q, 0) . kmin, summaries clamped to
 *                        float32's range, NaN -> +inf, then soft-capped; -inf for a page that is none or empty
 *                        (kmin[0] > kmax[0])
 *   kvs_sparse_attention: qs float32 [R, GQ, D] (G query heads times Q queries, scaled), k, v [N, D],
 *                        selected uint8 [R, W], lens int64 [R]; query i of Q sees the entries of rank
 *                        t < lens[r] - (Q - 1 - i) of the selected pages; sinks float32 [H_kv * G] or NULL;
 *                        out float32 [R, GQ, D] (0 for a query that sees nothing)
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "kvpress_half.h" /* from_bits, half_to_float, sixteen_to_float, INLINE */
#include "kvpress_pages.h" /* next_listed, most_listed, softmax_numerators, add_weighted, divide_by_sums */

/* row i of a [*, D] tensor of dtype, as float32: the row itself (float32), or converted into buf */
INLINE const float *row_of(const void *base, int64_t i, int dtype, int64_t D, float *restrict buf) {
    if (dtype == 0) return (const float *)base + i * D;
    const uint16_t *restrict h = (const uint16_t *)base + i * D;
    if (dtype == 2) {
#pragma omp simd
        for (int64_t c = 0; c < D; c++) buf[c] = from_bits((uint32_t)h[c] << 16);
        return buf;
    }
    int64_t c = 0;
#if defined(__F16C__)
    for (; c + 8 <= D; c += 8) _mm256_storeu_ps(buf + c, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + c))));
#endif
    for (; c < D; c++) buf[c] = half_to_float(h[c]);
    return buf;
}

INLINE float dot_any(const float *restrict a, const float *restrict b, const int64_t D) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t c = 0; c < D; c++) s += a[c] * b[c];
    return s;
}

/* a . b and a . b + c . d: lane-wise partial sums summed as a tree (a vectorised reduction of a sum of D terms
 * otherwise ends in D / lanes sequential scalar adds, the bottleneck of both kernels); one body over the widest
 * vector unit there is (VEC lanes of float32), the scalar loop where D is not a multiple of VEC */
#if defined(__AVX512F__)
#define VEC 16
typedef __m512 vec_t;
#define VZERO _mm512_setzero_ps
#define VLOAD _mm512_loadu_ps
#define VFMA _mm512_fmadd_ps
#define VADD _mm512_add_ps
#define VSUM _mm512_reduce_add_ps
#elif defined(__AVX2__) && defined(__FMA__)
#define VEC 8
typedef __m256 vec_t;
#define VZERO _mm256_setzero_ps
#define VLOAD _mm256_loadu_ps
#define VFMA _mm256_fmadd_ps
#define VADD _mm256_add_ps
static inline float VSUM(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
#endif

INLINE float dot(const float *restrict a, const float *restrict b, const int64_t D) {
#ifdef VEC
    if (D % VEC == 0) {
        vec_t s = VZERO();
        for (int64_t c = 0; c < D; c += VEC) s = VFMA(VLOAD(a + c), VLOAD(b + c), s);
        return VSUM(s);
    }
#endif
    return dot_any(a, b, D);
}

INLINE float dot2(const float *restrict a, const float *restrict b, const float *restrict c_,
                  const float *restrict d, const int64_t D) {
#ifdef VEC
    if (D % VEC == 0) {
        vec_t s = VZERO(), t = VZERO();
        for (int64_t c = 0; c < D; c += VEC) {
            s = VFMA(VLOAD(a + c), VLOAD(b + c), s);
            t = VFMA(VLOAD(c_ + c), VLOAD(d + c), t);
        }
        return VSUM(VADD(s, t));
    }
#endif
    return dot_any(a, b, D) + dot_any(c_, d, D);
}

/* ------------------------------------------------------------------------------------------ page bounds */
/* element 0 of row i (the empty-page test reads only it) */
static inline float first_of(const void *base, int64_t i, int dtype, int64_t D) {
    if (dtype == 0) return ((const float *)base)[i * D];
    return sixteen_to_float(((const uint16_t *)base)[i * D], dtype);
}

/* row i as float32 into dst, +-inf clamped to float32's extreme on one side (up: +inf to FLT_MAX, else -inf to
 * -FLT_MAX; 0 * inf would be NaN); NaN stays NaN */
INLINE void clamped_row(const void *base, int64_t i, int dtype, const int64_t D, int up, float *restrict dst) {
#if defined(__AVX512F__)
    if (D % 16 == 0) {
        const __m512 edge = _mm512_set1_ps(up ? FLT_MAX : -FLT_MAX);
        for (int64_t c = 0; c < D; c += 16) {
            __m512 x;
            if (dtype == 0) {
                x = _mm512_loadu_ps((const float *)base + i * D + c);
            } else {
                const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i * D + c));
                x = dtype == 1 ? _mm512_cvtph_ps(h) : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
            }
            /* min / max return their second operand when one is NaN: x, so NaN stays */
            _mm512_storeu_ps(dst + c, up ? _mm512_min_ps(edge, x) : _mm512_max_ps(edge, x));
        }
        return;
    }
#endif
    const float *x = row_of(base, i, dtype, D, dst);
    for (int64_t c = 0; c < D; c++) {
        const float e = x[c];
        dst[c] = up ? (e > FLT_MAX ? FLT_MAX : e) : (e < -FLT_MAX ? -FLT_MAX : e);
    }
}

/* row r's bounds o [GQ, W] for its queries q [GQ, D] (scratch: qp, qn [GQ, D], lo, hi [D]) */
INLINE void row_bounds(const float *q, const void *kmin, const void *kmax, int dtype, const int64_t *tab, int64_t W,
                       int64_t GQ, const int64_t D, float softcap, float *restrict qp, float *restrict qn,
                       float *restrict lo, float *restrict hi, float *restrict o) {
    for (int64_t i = 0; i < GQ * D; i++) {
        qp[i] = q[i] > 0.0f ? q[i] : 0.0f;
        qn[i] = q[i] < 0.0f ? q[i] : 0.0f;
    }
    for (int64_t j = 0; j < W; j++) {
        const int64_t page = tab[j];
        if (page < 0 || first_of(kmin, page, dtype, D) > first_of(kmax, page, dtype, D)) {
            for (int64_t m = 0; m < GQ; m++) o[m * W + j] = -INFINITY; /* none, or holding nothing */
            continue;
        }
        clamped_row(kmin, page, dtype, D, 0, lo);
        clamped_row(kmax, page, dtype, D, 1, hi);
        for (int64_t m = 0; m < GQ; m++) {
            float b = dot2(qp + m * D, hi, qn + m * D, lo, D);
            if (isnan(b)) b = INFINITY; /* overflowing terms of both signs: no bound */
            if (softcap > 0.0f) b = softcap * tanhf(b / softcap);
            o[m * W + j] = b;
        }
    }
}

INLINE int bounds(const float *qs, const void *kmin, const void *kmax, int dtype, const int64_t *table, int64_t R,
                  int64_t W, int64_t GQ, const int64_t D, float softcap, float *out) {
    float *buf = malloc(sizeof(float) * (size_t)(2 * GQ * D + 2 * D));
    if (!buf) return 1;
    float *qp = buf, *qn = buf + GQ * D, *lo = buf + 2 * GQ * D, *hi = lo + D;
    for (int64_t r = 0; r < R; r++)
        row_bounds(qs + r * GQ * D, kmin, kmax, dtype, table + r * W, W, GQ, D, softcap, qp, qn, lo, hi,
                   out + r * GQ * W);
    free(buf);
    return 0;
}

int kvs_page_bounds(const float *qs, const void *kmin, const void *kmax, int64_t dtype, const int64_t *table,
                    int64_t R, int64_t W, int64_t GQ, int64_t D, float softcap, float *out) {
    if (D == 64) return bounds(qs, kmin, kmax, (int)dtype, table, R, W, GQ, 64, softcap, out);
    if (D == 128) return bounds(qs, kmin, kmax, (int)dtype, table, R, W, GQ, 128, softcap, out);
    return bounds(qs, kmin, kmax, (int)dtype, table, R, W, GQ, D, softcap, out);
}

/* ------------------------------------------------------------------------------ attention over selected pages */
#define PREFETCH 8 /* value rows read ahead */

INLINE int attend(const float *qs, const void *k, const void *v, int dtype, const int64_t *table,
                  const uint8_t *selected, const int64_t *lens, int64_t R, int64_t W, int64_t H_kv, int64_t G,
                  const int64_t Q, int64_t P, const int64_t D, float softcap, const float *sinks, float *out) {
    const int64_t most = most_listed(table, selected, R, W); /* the most pages a row reads */
    const int64_t GQ = G * Q, cap = (most > 0 ? most : 1) * P, size = dtype == 0 ? 4 : 2;
    /* scores [GQ, cap], the slot of each listed entry [cap], the row maxima and sums [2 GQ], a converted row [D] */
    float *scores = malloc(sizeof(float) * (size_t)(GQ * cap + 2 * GQ + D) + sizeof(int64_t) * (size_t)cap);
    if (!scores) return 1;
    float *top = scores + GQ * cap, *total = top + GQ, *buf = total + GQ;
    int64_t *slot = (int64_t *)(buf + D);
    memset(out, 0, sizeof(float) * (size_t)(R * GQ * D));
    for (int64_t r = 0; r < R; r++) {
        const int64_t n = lens[r];
        const float *q = qs + r * GQ * D;
        float *o = out + r * GQ * D;
        int64_t count = 0; /* entries listed: those of the selected pages that some query sees */
        int64_t j = next_listed(table, selected, r, W, 0);
        while (j < W) {
            const int64_t page = table[r * W + j], after = next_listed(table, selected, r, W, j + 1);
            const int64_t start = j * P, held = n - start < P ? n - start : P;
            const char *ahead = after < W ? (const char *)k + table[r * W + after] * P * D * size : NULL;
            j = after;
            for (int64_t e = 0; e < held; e++) {
                const int64_t t = start + e, s = page * P + e;
                if (ahead) /* the next listed page's keys, one row per entry read here */
                    for (int64_t b = 0; b < D * size; b += 64) __builtin_prefetch(ahead + e * D * size + b);
                for (int64_t b = 0; b < D * size; b += 64) __builtin_prefetch((const char *)v + s * D * size + b);
                const float *key = row_of(k, s, dtype, D, buf);
                for (int64_t m = 0; m < GQ; m++) { /* query i = m % Q sees ranks t < n - (Q - 1 - i) */
                    float x = -INFINITY;
                    if (t < n - (Q - 1 - m % Q)) {
                        x = dot(q + m * D, key, D);
                        if (softcap > 0.0f) x = softcap * tanhf(x / softcap);
                    }
                    scores[m * cap + count] = x;
                }
                slot[count++] = s;
            }
        }
        softmax_numerators(scores, GQ, cap, count, sinks ? sinks + (r % H_kv) * G : NULL, Q, top, total);
        for (int64_t i = 0; i < count; i++) {
            if (i + PREFETCH < count)
                for (int64_t b = 0; b < D * size; b += 64)
                    __builtin_prefetch((const char *)v + slot[i + PREFETCH] * D * size + b);
            const float *val = row_of(v, slot[i], dtype, D, buf);
            add_weighted(o, scores, cap, i, GQ, D, val);
        }
        divide_by_sums(o, total, GQ, D);
    }
    free(scores);
    return 0;
}

int kvs_sparse_attention(const float *qs, const void *k, const void *v, int64_t dtype, const int64_t *table,
                         const uint8_t *selected, const int64_t *lens, int64_t R, int64_t W, int64_t H_kv, int64_t G,
                         int64_t Q, int64_t P, int64_t D, float softcap, const float *sinks, float *out) {
#define ATTEND(Q_, D_) attend(qs, k, v, (int)dtype, table, selected, lens, R, W, H_kv, G, Q_, P, D_, softcap, sinks, out)
    if (Q == 1 && D == 64) return ATTEND(1, 64); /* decode */
    if (Q == 1 && D == 128) return ATTEND(1, 128);
    if (D == 64) return ATTEND(Q, 64);
    if (D == 128) return ATTEND(Q, 128);
    return ATTEND(Q, D);
#undef ATTEND
}

/* ------------------------------------------------------------------------------------ top-k with position ties */
/* kvs_top_k_f32 / _f64: kvpress_ada.ranking.top_k over rows [rows, n] (contiguous) of scores with no NaN: the
 * k[r] best (k clamped to [0, n]); scores within rtol * |kth| of the k-th best (kth: the k-th largest, the largest
 * for k = 0; tol 0 for an infinite kth) tie with it, and the ties are taken by position, the later first when
 * recent_first. out uint8 [rows, n]. Returns 1 (nothing decided) when a row holds a NaN: the torch code decides. */
#define TOP_K(T, NAME, FABS)                                                                                    \
    static T NAME##_kth(T *a, int64_t n, int64_t i) { /* the element of rank i (0: largest); a reordered */   \
        int64_t lo = 0, hi = n;                                                                                \
        while (hi - lo > 1) {                                                                                  \
            T x = a[lo], y = a[lo + (hi - lo) / 2], z = a[hi - 1], p;                                          \
            p = x < y ? (y < z ? y : (x < z ? z : x)) : (x < z ? x : (y < z ? z : y)); /* median of three */ \
            int64_t gt = lo, j = lo, lt = hi; /* [lo, gt) > p, [gt, lt) == p, [lt, hi) < p */                \
            while (j < lt) {                                                                                   \
                T e = a[j];                                                                                    \
                if (e > p) { a[j++] = a[gt]; a[gt++] = e; }                                                    \
                else if (e < p) { a[j] = a[--lt]; a[lt] = e; }                                                 \
                else j++;                                                                                      \
            }                                                                                                  \
            if (i < gt) hi = gt;                                                                               \
            else if (i < lt) return p;                                                                         \
            else lo = lt;                                                                                      \
        }                                                                                                      \
        return a[lo];                                                                                          \
    }                                                                                                          \
    /* one row x [n > 0], no NaN: its kk best (kk in [0, n]) into o [n]; buf [n] scratch */                    \
    static void NAME##_row(const T *x, int64_t n, int64_t kk, T rtol, int recent_first, T *buf, uint8_t *o) { \
        memcpy(buf, x, sizeof(T) * (size_t)n);                                                                 \
        const T kth = NAME##_kth(buf, n, kk > 0 ? kk - 1 : 0);                                                 \
        const T tol = isfinite(kth) ? FABS(kth) * rtol : (T)0;                                                \
        int64_t above = 0;                                                                                     \
        for (int64_t i = 0; i < n; i++) {                                                                      \
            const int tied = x[i] == kth || FABS(x[i] - kth) <= tol;                                           \
            o[i] = !tied && x[i] > kth;                                                                        \
            above += o[i];                                                                                     \
        }                                                                                                      \
        const int64_t want = kk - above;                                                                       \
        int64_t taken = 0;                                                                                     \
        for (int64_t s = 0; s < n && taken < want; s++) {                                                      \
            const int64_t i = recent_first ? n - 1 - s : s;                                                    \
            if (x[i] == kth || FABS(x[i] - kth) <= tol) {                                                      \
                o[i] = 1;                                                                                      \
                taken++;                                                                                       \
            }                                                                                                  \
        }                                                                                                      \
    }                                                                                                          \
    int NAME(const T *scores, const int64_t *k, int64_t rows, int64_t n, T rtol, int64_t recent_first,        \
             uint8_t *out) {                                                                                   \
        if (n <= 0) return 0;                                                                                  \
        for (int64_t i = 0; i < rows * n; i++)                                                                 \
            if (scores[i] != scores[i]) return 1;                                                              \
        T *buf = malloc(sizeof(T) * (size_t)n);                                                                \
        if (!buf) return 2;                                                                                    \
        for (int64_t r = 0; r < rows; r++) {                                                                   \
            const int64_t kk = k[r] < 0 ? 0 : (k[r] > n ? n : k[r]);                                           \
            NAME##_row(scores + r * n, n, kk, rtol, (int)recent_first, buf, out + r * n);                      \
        }                                                                                                      \
        free(buf);                                                                                             \
        return 0;                                                                                              \
    }

TOP_K(float, kvs_top_k_f32, fabsf)
TOP_K(double, kvs_top_k_f64, fabs)

/* ------------------------------------------------------------------------------ page selection (TopPages) */
/* kvs_select_pages: what kvpress_ada.readers.TopPages selects over the Quest bounds of kvs_page_bounds (the same
 * pages as its torch code given these bounds: its float64 shares rounded once, every other step exact), for rows
 * r = b * H + h (H kv heads per batch row) holding lens[r] entries, in pages of P:
 *  - the pages of a row that hold an entry (j < ceil(lens[r] / P)) compete with the largest over its GQ queries of
 *    their softmax weight over the row's W pages (the others at float32's lowest logit), its first and newest page
 *    always read (+inf), the others never (-inf);
 *  - each kv head reads per_head pages, or (fraction > 0) the more of that and ceil(fraction * the mean over the
 *    batch row's heads of the pages they hold) (alpha < 0: uniform), or Ada-KV's split of its batch row's H * that:
 *    the top-k over the scores flattened by (page, head), mixed with per_head by alpha, rounded by largest remainder
 *    (ties: the larger adaptive count, then the lower head), at most W;
 *  - counts over what a head holds go to the best unread pages of its batch row's other heads (fit_to_valid);
 *  - each head reads its count of best pages, ties the newer first (top_k with rtol).
 * out uint8 [R, W]. Returns 1 (nothing decided: the torch code decides) on a NaN score, 2 out of memory. */

/* counts [H]: how many of the k best of sc [H, W], flattened by (page, head), ties the lower first, each head has
 * (flat, buf [H * W], mask [H * W] scratch) */
static void flat_counts(const float *sc, int64_t H, int64_t W, int64_t k, float rtol, float *flat, float *buf,
                        uint8_t *mask, int64_t *counts) {
    const int64_t n = H * W;
    for (int64_t h = 0; h < H; h++)
        for (int64_t j = 0; j < W; j++) flat[j * H + h] = sc[h * W + j];
    kvs_top_k_f32_row(flat, n, k < 0 ? 0 : (k > n ? n : k), rtol, 0, buf, mask);
    for (int64_t h = 0; h < H; h++) {
        counts[h] = 0;
        for (int64_t j = 0; j < W; j++) counts[h] += mask[j * H + h];
    }
}

/* out [H]: values v [H] (non-negative) rounded to integers summing to total (allocators.rounding: floors, the
 * remaining units to the largest fractional parts, ties to the larger tie[h], then the lower h), each at most upper
 * (frac [H], order [H] scratch) */
static void round_to_total(const double *v, int64_t H, int64_t total, int64_t upper, const int64_t *tie,
                           double *frac, int64_t *order, int64_t *out) {
    double floors = 0.0;
    for (int64_t h = 0; h < H; h++) {
        const double near = nearbyint(v[h]), x = fabs(v[h] - near) < 1e-9 ? near : v[h]; /* snapped */
        out[h] = (int64_t)floor(x);
        frac[h] = x - floor(x);
        floors += floor(x);
    }
    const double remaining = total - floors > 0.0 ? total - floors : 0.0;
    for (int64_t i = 0; i < H; i++) { /* insertion sort: fraction down, tie down, head up */
        int64_t a = i, j = i;
        for (; j > 0; j--) {
            const int64_t b = order[j - 1];
            if (frac[b] > frac[a] || (frac[b] == frac[a] && (tie[b] > tie[a] || (tie[b] == tie[a] && b < a)))) break;
            order[j] = b;
        }
        order[j] = a;
    }
    for (int64_t rank = 0; rank < H; rank++) {
        const int64_t h = order[rank];
        out[h] += (double)rank < remaining;
        out[h] = out[h] < upper ? out[h] : upper;
    }
}

/* e^x for x <= 0 (NaN stays NaN) within a few ulps of double, branch-free (the loop over a row vectorises):
 * x = k ln2 + r (|r| <= ln2 / 2, ln2 in two parts, k ln2_hi exact), e^r by its Taylor series to r^13 (the rest
 * below 1e-17), times 2^k built in the exponent bits; below -708 (where 2^k leaves the normal range) 0: a share
 * of it rounds to 0 in float32 as torch's does */
static inline double exp_nonpositive(double x) {
    const double shifter = 6755399441055744.0; /* 1.5 * 2^52: y / ln2 + shifter holds round(y / ln2) in its bits */
    const double y = x < -708.0 ? -708.0 : x;
    const double t = y * 1.4426950408889634 + shifter, k = t - shifter;
    const double r = (y - k * 6.93147180369123816490e-01) - k * 1.90821492927058770002e-10;
    double p = 1.0 / 6227020800.0; /* 1 / 13! */
    p = p * r + 1.0 / 479001600.0;
    p = p * r + 1.0 / 39916800.0;
    p = p * r + 1.0 / 3628800.0;
    p = p * r + 1.0 / 362880.0;
    p = p * r + 1.0 / 40320.0;
    p = p * r + 1.0 / 5040.0;
    p = p * r + 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    int64_t bits;
    memcpy(&bits, &t, sizeof bits);
    const uint64_t e = (uint64_t)(bits - (int64_t)0x4338000000000000LL + 1023) << 52; /* 2^k */
    double scale;
    memcpy(&scale, &e, sizeof scale);
    return x < -708.0 ? 0.0 : p * scale;
}

/* sc [W]: a row's scores from its bounds b [GQ, W], pages (ceil(lens / P)) of its pages holding an entry; the
 * softmax in float64 (dbuf [W] scratch), its largest over the queries rounded once to float32, as TopPages computes
 * it (so the sums' order and exp's last bits do not decide); 1 when a score that decides is NaN (a bound of +inf:
 * the softmax over it is NaN, as torch's) */
static int row_scores(const float *b, int64_t GQ, int64_t W, int64_t pages, double *restrict dbuf,
                      float *restrict sc) {
    for (int64_t m = 0; m < GQ; m++) {
        const float *l = b + m * W;
        double top = -INFINITY, sum = 0.0;
        for (int64_t j = 0; j < W; j++) {
            dbuf[j] = j < pages ? (double)l[j] : (double)-FLT_MAX; /* never NaN (row_bounds) */
            top = dbuf[j] > top ? dbuf[j] : top;
        }
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < W; j++) {
            dbuf[j] = exp_nonpositive(dbuf[j] - top); /* NaN where top is +inf: inf - inf */
            sum += dbuf[j];
        }
        const double inv = 1.0 / sum;
        for (int64_t j = 0; j < W; j++) { /* the largest over the queries; NaN wins (torch's amax) */
            const float s = (float)(dbuf[j] * inv);
            if (m == 0 || (!isnan(sc[j]) && (isnan(s) || s > sc[j]))) sc[j] = s;
        }
    }
    for (int64_t j = 0; j < W; j++) {
        if (j >= pages) sc[j] = -INFINITY;
        else if (j == 0 || j == pages - 1) sc[j] = INFINITY; /* the first (sinks) and newest pages */
        else if (isnan(sc[j])) return 1;
    }
    return 0;
}

INLINE int select_pages(const float *qs, const void *kmin, const void *kmax, int dtype, const int64_t *table,
                        const int64_t *lens, int64_t R, int64_t H, int64_t W, int64_t GQ, const int64_t D,
                        float softcap, int64_t P, int64_t per_head, double fraction, double alpha, float rtol,
                        uint8_t *out) {
    const int64_t HW = H * W;
    /* floats: qp, qn [GQ, D], lo, hi [D], bounds [GQ, W], scores, rest, flat, buf [H, W]; double: mixed, frac [H],
     * dbuf [W]; int64: pages, counts, adaptive, extra, order [H]; bytes: mask, chosen [H, W] */
    const size_t floats = (size_t)(2 * GQ * D + 2 * D + GQ * W + 4 * HW);
    char *mem = malloc(sizeof(float) * floats + 2 * (size_t)HW + sizeof(int64_t) * 5 * (size_t)H
                       + sizeof(double) * (2 * (size_t)H + (size_t)W) + 16);
    if (!mem) return 2;
    float *qp = (float *)mem, *qn = qp + GQ * D, *lo = qn + GQ * D, *hi = lo + D, *bnd = hi + D, *sc = bnd + GQ * W;
    float *rest = sc + HW, *flat = rest + HW, *buf = flat + HW;
    double *mixed = (double *)(mem + (sizeof(float) * floats + 7) / 8 * 8), *frac = mixed + H, *dbuf = frac + H;
    int64_t *pages = (int64_t *)(dbuf + W), *counts = pages + H, *adaptive = counts + H, *extra = adaptive + H;
    int64_t *order = extra + H;
    uint8_t *mask = (uint8_t *)(order + H), *chosen = mask + HW;
    int status = 0;
    for (int64_t b = 0; b < R / H && !status; b++) {
        for (int64_t h = 0; h < H && !status; h++) {
            const int64_t r = b * H + h, n = lens[r] > 0 ? lens[r] : 0, held = (n + P - 1) / P;
            pages[h] = held < W ? held : W;
            row_bounds(qs + r * GQ * D, kmin, kmax, dtype, table + r * W, W, GQ, D, softcap, qp, qn, lo, hi, bnd);
            status = row_scores(bnd, GQ, W, held, dbuf, sc + h * W);
        }
        if (status) break;
        int64_t per_row = per_head;
        if (fraction > 0.0) { /* the heads' mean pages held (sum, then one division, as torch's mean), times fraction */
            int64_t held_sum = 0;
            for (int64_t h = 0; h < H; h++) held_sum += pages[h];
            const double mean = (double)held_sum / (double)H, grown = ceil(mean * fraction);
            per_row = grown > (double)per_row ? (int64_t)grown : per_row;
        }
        if (alpha < 0.0) {
            for (int64_t h = 0; h < H; h++) counts[h] = per_row;
        } else { /* Ada-KV */
            flat_counts(sc, H, W, H * per_row, rtol, flat, buf, mask, adaptive);
            for (int64_t h = 0; h < H; h++) { /* two statements: no fused multiply-add (torch rounds each step) */
                const double uniform = alpha * (double)per_row, own = (1.0 - alpha) * (double)adaptive[h];
                mixed[h] = uniform + own;
            }
            round_to_total(mixed, H, H * per_row, W, adaptive, frac, order, counts);
        }
        int64_t over = 0, room = 0; /* fit_to_valid: counts a head cannot fill go to the others' best pages */
        for (int64_t h = 0; h < H; h++) {
            const int64_t clipped = counts[h] < pages[h] ? counts[h] : pages[h];
            over += counts[h] - clipped;
            room += pages[h] - clipped;
            counts[h] = clipped;
        }
        if (over > 0) {
            for (int64_t h = 0; h < H; h++) {
                kvs_top_k_f32_row(sc + h * W, W, counts[h] > 0 ? counts[h] : 0, rtol, 1, buf, chosen + h * W);
                for (int64_t j = 0; j < W; j++)
                    rest[h * W + j] = j < pages[h] && !chosen[h * W + j] ? sc[h * W + j] : -INFINITY;
            }
            flat_counts(rest, H, W, over < room ? over : room, rtol, flat, buf, mask, extra);
            for (int64_t h = 0; h < H; h++) counts[h] += extra[h];
        }
        for (int64_t h = 0; h < H; h++) {
            uint8_t *o = out + (b * H + h) * W;
            const int64_t k = counts[h] < 0 ? 0 : (counts[h] > W ? W : counts[h]);
            kvs_top_k_f32_row(sc + h * W, W, k, rtol, 1, buf, o);
            for (int64_t j = pages[h]; j < W; j++) o[j] = 0;
        }
    }
    free(mem);
    return status;
}

int kvs_select_pages(const float *qs, const void *kmin, const void *kmax, int64_t dtype, const int64_t *table,
                     const int64_t *lens, int64_t R, int64_t H, int64_t W, int64_t GQ, int64_t D, float softcap,
                     int64_t P, int64_t per_head, double fraction, double alpha, float rtol, uint8_t *out) {
#define SELECT(D_) select_pages(qs, kmin, kmax, (int)dtype, table, lens, R, H, W, GQ, D_, softcap, P, per_head, \
                                fraction, alpha, rtol, out)
    if (R % H || W <= 0 || P <= 0) return 3;
    if (D == 64) return SELECT(64);
    if (D == 128) return SELECT(128);
    return SELECT(D);
#undef SELECT
}

/* ------------------------------------------------------------------------------------------ summary appends */
/* kvs_append_summaries: the Q keys [R, Q, D] (kdtype) just appended to each row (row r's entry i at slot offs[r] +
 * lens[r] - Q + i, lens counting them) reduced into their pages' kmin, kmax [pages, D] (sdtype): float32 keys
 * rounded outward to float16 summaries (kmin down, kmax up), 16-bit keys into summaries of their dtype as they are;
 * a NaN stays (min / max propagate it). int32 offs, lens (the ragged cache's). Returns 1 (nothing written) for a
 * slot outside the summaries, 3 for a pair of dtypes it does not read (float32 -> 1, 1 -> 1, 2 -> 2). */
int kvs_append_summaries(const void *keys, int64_t kdtype, uint16_t *kmin, uint16_t *kmax, int64_t sdtype,
                         const int32_t *offs, const int32_t *lens, int64_t R, int64_t Q, int64_t D, int64_t P,
                         int64_t n_pages) {
    if (!((kdtype == 0 && sdtype == 1) || (kdtype == 1 && sdtype == 1) || (kdtype == 2 && sdtype == 2))) return 3;
    for (int64_t r = 0; r < R; r++) {
        const int64_t first = (int64_t)offs[r] + lens[r] - Q;
        if (first < 0 || (first + Q - 1) / P >= n_pages) return 1;
    }
    for (int64_t r = 0; r < R; r++)
        for (int64_t i = 0; i < Q; i++) {
            const int64_t page = ((int64_t)offs[r] + lens[r] - Q + i) / P, e = r * Q + i;
            uint16_t *lo = kmin + page * D, *hi = kmax + page * D;
            for (int64_t c = 0; c < D; c++) {
                uint16_t down, up;
                if (kdtype == 0) {
                    const float x = ((const float *)keys)[e * D + c];
                    down = half_outward(x, 0);
                    up = half_outward(x, 1);
                } else {
                    down = up = ((const uint16_t *)keys)[e * D + c];
                }
                const float d = sixteen_to_float(down, (int)sdtype), u = sixteen_to_float(up, (int)sdtype);
                const float l = sixteen_to_float(lo[c], (int)sdtype), h = sixteen_to_float(hi[c], (int)sdtype);
                if (!isnan(l) && (isnan(d) || d < l)) lo[c] = down;
                if (!isnan(h) && (isnan(u) || u > h)) hi[c] = up;
            }
        }
    return 0;
}
