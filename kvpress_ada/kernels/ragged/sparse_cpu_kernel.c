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

INLINE int bounds(const float *qs, const void *kmin, const void *kmax, int dtype, const int64_t *table, int64_t R,
                  int64_t W, int64_t GQ, const int64_t D, float softcap, float *out) {
    float *buf = malloc(sizeof(float) * (size_t)(2 * GQ * D + 2 * D));
    if (!buf) return 1;
    float *qp = buf, *qn = buf + GQ * D, *lo = buf + 2 * GQ * D, *hi = lo + D;
    for (int64_t r = 0; r < R; r++) {
        const float *q = qs + r * GQ * D;
        for (int64_t i = 0; i < GQ * D; i++) {
            qp[i] = q[i] > 0.0f ? q[i] : 0.0f;
            qn[i] = q[i] < 0.0f ? q[i] : 0.0f;
        }
        float *o = out + r * GQ * W;
        for (int64_t j = 0; j < W; j++) {
            const int64_t page = table[r * W + j];
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

/* the first page at or after j that row r reads (W: none) */
static inline int64_t next_listed(const int64_t *table, const uint8_t *selected, int64_t r, int64_t W, int64_t j) {
    while (j < W && !(selected[r * W + j] && table[r * W + j] >= 0)) j++;
    return j;
}
INLINE int attend(const float *qs, const void *k, const void *v, int dtype, const int64_t *table,
                  const uint8_t *selected, const int64_t *lens, int64_t R, int64_t W, int64_t H_kv, int64_t G,
                  const int64_t Q, int64_t P, const int64_t D, float softcap, const float *sinks, float *out) {
    int64_t most = 0; /* the most pages a row reads */
    for (int64_t r = 0; r < R; r++) {
        int64_t c = 0;
        for (int64_t j = 0; j < W; j++) c += selected[r * W + j] && table[r * W + j] >= 0;
        most = c > most ? c : most;
    }
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
        for (int64_t m = 0; m < GQ; m++) {
            float *x = scores + m * cap, best = -INFINITY, sum = 0.0f;
            const float sink = sinks ? sinks[(r % H_kv) * G + m / Q] : 0.0f;
            for (int64_t i = 0; i < count; i++) best = x[i] > best ? x[i] : best;
            if (sinks) best = sink > best ? sink : best;
            best = best < -FLT_MAX ? -FLT_MAX : best; /* a query that sees nothing: exp(-inf - finite) = 0 */
            for (int64_t i = 0; i < count; i++) {
                x[i] = expf(x[i] - best);
                sum += x[i];
            }
            if (sinks) sum += expf(sink - best);
            top[m] = best;
            total[m] = sum;
        }
        for (int64_t i = 0; i < count; i++) {
            if (i + PREFETCH < count)
                for (int64_t b = 0; b < D * size; b += 64)
                    __builtin_prefetch((const char *)v + slot[i + PREFETCH] * D * size + b);
            const float *val = row_of(v, slot[i], dtype, D, buf);
            for (int64_t m = 0; m < GQ; m++) {
                const float p = scores[m * cap + i];
                float *restrict om = o + m * D;
#pragma omp simd
                for (int64_t c = 0; c < D; c++) om[c] += p * val[c];
            }
        }
        for (int64_t m = 0; m < GQ; m++) {
            const float d = total[m] > FLT_MIN ? total[m] : FLT_MIN;
            for (int64_t c = 0; c < D; c++) o[m * D + c] /= d;
        }
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
    int NAME(const T *scores, const int64_t *k, int64_t rows, int64_t n, T rtol, int64_t recent_first,        \
             uint8_t *out) {                                                                                   \
        if (n <= 0) return 0;                                                                                  \
        T *buf = malloc(sizeof(T) * (size_t)n);                                                                \
        if (!buf) return 2;                                                                                    \
        for (int64_t r = 0; r < rows; r++) {                                                                   \
            const T *x = scores + r * n;                                                                       \
            for (int64_t i = 0; i < n; i++)                                                                    \
                if (x[i] != x[i]) {                                                                            \
                    free(buf);                                                                                 \
                    return 1;                                                                                  \
                }                                                                                              \
        }                                                                                                      \
        for (int64_t r = 0; r < rows; r++) {                                                                   \
            const T *x = scores + r * n;                                                                       \
            uint8_t *o = out + r * n;                                                                          \
            const int64_t kk = k[r] < 0 ? 0 : (k[r] > n ? n : k[r]);                                           \
            memcpy(buf, x, sizeof(T) * (size_t)n);                                                             \
            const T kth = NAME##_kth(buf, n, kk > 0 ? kk - 1 : 0);                                             \
            const T tol = isfinite(kth) ? FABS(kth) * rtol : (T)0;                                            \
            int64_t above = 0;                                                                                 \
            for (int64_t i = 0; i < n; i++) {                                                                  \
                const int tied = x[i] == kth || FABS(x[i] - kth) <= tol;                                       \
                o[i] = !tied && x[i] > kth;                                                                    \
                above += o[i];                                                                                 \
            }                                                                                                  \
            const int64_t want = kk - above;                                                                   \
            int64_t taken = 0;                                                                                 \
            for (int64_t s = 0; s < n && taken < want; s++) {                                                  \
                const int64_t i = recent_first ? n - 1 - s : s;                                                \
                if (x[i] == kth || FABS(x[i] - kth) <= tol) {                                                  \
                    o[i] = 1;                                                                                  \
                    taken++;                                                                                   \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
        free(buf);                                                                                             \
        return 0;                                                                                              \
    }

TOP_K(float, kvs_top_k_f32, fabsf)
TOP_K(double, kvs_top_k_f64, fabs)
