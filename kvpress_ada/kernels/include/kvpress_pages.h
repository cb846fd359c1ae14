/* Attention over selected pages, shared by the fused CPU kernels that read them (ragged/sparse_cpu_kernel.c over
 * full-precision entries, quantized/cpu_kernel.c over records): which pages a row reads, and the softmax of a row's
 * logits with an attention sink, the weighted values' sums.
 *
 * Built with -I <this folder> by kvpress_ada/kernels/quantized/cpu_kernel.py (build_kernel), whose cache key hashes
 * every header here: an edit rebuilds every kernel that includes it.
 */
#ifndef KVPRESS_PAGES_H
#define KVPRESS_PAGES_H

#include <float.h>
#include <math.h>
#include <stdint.h>

#include "kvpress_half.h" /* INLINE */

/* the first page at or after j that row r of table, selected [rows, W] reads (W: none) */
static inline int64_t next_listed(const int64_t *table, const uint8_t *selected, int64_t r, int64_t W, int64_t j) {
    while (j < W && !(selected[r * W + j] && table[r * W + j] >= 0)) j++;
    return j;
}

/* the most pages any of rows reads */
static inline int64_t most_listed(const int64_t *table, const uint8_t *selected, int64_t rows, int64_t W) {
    int64_t most = 0;
    for (int64_t r = 0; r < rows; r++) {
        int64_t c = 0;
        for (int64_t j = 0; j < W; j++) c += selected[r * W + j] && table[r * W + j] >= 0;
        most = c > most ? c : most;
    }
    return most;
}

/* the softmax numerators of M queries' logits over a row's count entries, in place (scores[m * cap + i] becomes
 * e^(x - top[m])), and their sums total[m], a sink's logit (row_sinks[m / Q]; NULL: none) counted in the sum and
 * the maximum; a query that sees nothing (every logit -inf, no sink) sums to 0 */
INLINE void softmax_numerators(float *scores, int64_t M, int64_t cap, int64_t count, const float *row_sinks,
                               int64_t Q, float *top, float *total) {
    for (int64_t m = 0; m < M; m++) {
        float *x = scores + m * cap, best = -INFINITY, sum = 0.0f;
        const float sink = row_sinks ? row_sinks[m / Q] : 0.0f;
        for (int64_t i = 0; i < count; i++) best = x[i] > best ? x[i] : best;
        if (row_sinks) best = sink > best ? sink : best;
        best = best < -FLT_MAX ? -FLT_MAX : best; /* exp(-inf - finite) = 0 */
        for (int64_t i = 0; i < count; i++) {
            x[i] = expf(x[i] - best);
            sum += x[i];
        }
        if (row_sinks) sum += expf(sink - best);
        top[m] = best;
        total[m] = sum;
    }
}

/* the weighted value of entry i added to each of M queries' outputs: o[m * D ..] += scores[m * cap + i] * v */
INLINE void add_weighted(float *o, const float *scores, int64_t cap, int64_t i, int64_t M, const int64_t D,
                         const float *v) {
    for (int64_t m = 0; m < M; m++) {
        const float p = scores[m * cap + i];
        float *restrict om = o + m * D;
#pragma omp simd
        for (int64_t c = 0; c < D; c++) om[c] += p * v[c];
    }
}

/* each of M queries' outputs divided by its softmax sum (a query that sees nothing keeps its zeros) */
INLINE void divide_by_sums(float *o, const float *total, int64_t M, const int64_t D) {
    for (int64_t m = 0; m < M; m++) {
        const float d = total[m] > FLT_MIN ? total[m] : FLT_MIN;
        for (int64_t c = 0; c < D; c++) o[m * D + c] /= d;
    }
}

#endif
