/* Ragged attention over quantized records on the CPU, dequantizing each entry as it is read.
 *
 * The fused form of kvpress_ada/kernels/quantized.py's torch reference (quantized_attention_ref): same
 * record layout, same anchor / residual slots, same bottom-right causal rule, float32 arithmetic. Built
 * and loaded by quantized_cpu.py (ctypes); one thread, no allocation but one score buffer per call.
 *
 *   q      float32 [B, H_kv, G, Q, D]  rotated queries (q @ R), not scaled
 *   k_rec, v_rec  uint8 [N, width]     records: elements | scales [| zeros] (in sdtype); enc 0: integers
 *                                       with scales and zero points, 1: float8 e4m3 with scales only
 *   offs, lens    int64 [rows]         row r = b * H_kv + h at k_rec[offs[r] : offs[r] + lens[r]]
 *   side   float32 [2 (1 + R), rows, D] each row's keys then values read in full precision, keys in the
 *                                       records' space: index 0 the anchor (rank 0), 1 + j ring slot j
 *                                       (the newest R ranks k >= 1 read from slot k % R)
 *   softcap                            0: off; else each logit l becomes softcap * tanh(l / softcap) (Gemma 2)
 *   bias   float32 [B, H_kv, G, Q]     NULL, or q . c of each query with its row's key centre, added to its
 *                                       (unscaled) logits: soft-capping and sinks need q . k itself
 *   sinks  float32 [H_kv * G]          NULL, or one logit per query head in each softmax denominator (GPT-OSS)
 *   out    float32 [B, H_kv, G, Q, D]  written (0 for a query that sees nothing)
 *
 * kvq_sparse_attention: the same over the entries of each row's selected pages only (Quest reads), the fused form
 * of kvpress_ada/kernels/ragged/sparse.py's sparse_quantized_attention_ref: each selected page's records read and
 * dequantized where they lie (no gather, no padding to the longest row's list), the anchor and ring slots from side
 * as above. Instead of offs:
 *   table     int64 [rows, W]  flat page of page j of row r (-1: none): its ranks j * P .. at slots table * P ..
 *   selected  uint8 [rows, W]  the pages row r reads (a page of table -1 never)
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvpress_half.h" /* from_bits, half_to_float, sixteen_to_float, INLINE */
#include "kvpress_pages.h" /* next_listed, most_listed, softmax_numerators, add_weighted, divide_by_sums */

/* sdtype: 0 float32, 1 float16, 2 bfloat16 */
static inline float read_scale(const uint8_t *p, int sdtype) {
    if (sdtype == 0) {
        float f;
        memcpy(&f, p, sizeof f);
        return f;
    }
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return sixteen_to_float(h, sdtype);
}

/* the 256 values of a float8 e4m3 (fn) byte: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is
 * subnormal (m * 2^-9); 0x7f / 0xff (NaN) are never stored */
static void e4m3_table(float *lut) {
    for (uint32_t b = 0; b < 256; b++) {
        const uint32_t e = (b >> 3) & 15u, m = b & 7u;
        const float f = e ? from_bits(((e + 120u) << 23) | (m << 20)) : (float)m * 0.001953125f;
        lut[b] = (b & 0x80u) ? -f : f;
    }
}

/* out[D] = what a record holds: q * scale + zero per group of channels (e4m3: e * scale) */
INLINE void dequantize(const uint8_t *restrict rec, int D, int enc, int bits, int group, int sdtype,
                       const float *restrict lut, float *restrict out) {
    const int n_int = D * bits / 8, groups = D / group, ssz = sdtype == 0 ? 4 : 2;
    if (enc == 1) {
        for (int c = 0; c < D; c++) out[c] = lut[rec[c]];
        for (int g = 0; g < groups; g++) {
            const float s = read_scale(rec + n_int + g * ssz, sdtype);
            float *restrict o = out + g * group;
            for (int c = 0; c < group; c++) o[c] *= s;
        }
        return;
    }
    if (bits == 8) {
        for (int c = 0; c < D; c++) out[c] = (float)rec[c];
    } else {
        const int half = D / 2;
        for (int j = 0; j < half; j++) {
            out[j] = (float)(rec[j] & 15);
            out[j + half] = (float)(rec[j] >> 4);
        }
    }
    for (int g = 0; g < groups; g++) {
        const float s = read_scale(rec + n_int + g * ssz, sdtype);
        const float z = read_scale(rec + n_int + (groups + g) * ssz, sdtype);
        float *restrict o = out + g * group;
        for (int c = 0; c < group; c++) o[c] = o[c] * s + z;
    }
}

/* the entry of rank t of a row of length n: its full-precision slot in side (keys: base = side,
 * values: base = side + (1 + R) * rows * D), or its record dequantized into buf */
INLINE const float *entry(int64_t t, int64_t n, int64_t R, int64_t r, int64_t rows, int D,
                                 const float *base, const uint8_t *rec, int enc, int bits, int group, int sdtype,
                                 const float *lut, float *buf) {
    if (t == 0) return base + r * D;
    if (R > 0 && t >= n - R) return base + ((1 + t % R) * rows + r) * D;
    dequantize(rec, D, enc, bits, group, sdtype, lut, buf);
    return buf;
}

/* the first query (of Q) that sees the entry of rank t: query i sees the first n - (Q - 1 - i) entries */
static inline int64_t first_seeing(int64_t t, int64_t n, int64_t Q) {
    const int64_t i = t - n + Q;
    return i > 0 ? i : 0;
}

/* the kernel body; inlined into specialisations where D, enc, bits and group are compile-time constants */
INLINE int attend(const float *q, const uint8_t *k_rec, const uint8_t *v_rec, int64_t width, const int64_t *offs,
                  const int64_t *lens, const float *side, int64_t R, int64_t B, int64_t H_kv, int64_t G, int64_t Q,
                  const int64_t D, const int enc, const int bits, const int group, int64_t sdtype,
                  const float *lut, float scale, float softcap, const float *bias, const float *sinks, float *out) {
    const int64_t rows = B * H_kv, M = G * Q;
    const float *v_side = side + (1 + R) * rows * D;
    int64_t longest = 0;
    for (int64_t r = 0; r < rows; r++) longest = lens[r] > longest ? lens[r] : longest;
    float *scores = malloc(sizeof(float) * (size_t)(M * (longest > 0 ? longest : 1) + D));
    if (!scores) return 1;
    float *buf = scores + M * longest;
    memset(out, 0, sizeof(float) * (size_t)(rows * M * D));
    for (int64_t r = 0; r < rows; r++) {
        const int64_t n = lens[r], off = offs[r];
        if (n <= 0) continue;
        const float *qr = q + r * M * D;
        float *o = out + r * M * D;
        for (int64_t t = 0; t < n; t++) {
            const float *k = entry(t, n, R, r, rows, (int)D, side, k_rec + (off + t) * width, enc, bits, group,
                                   (int)sdtype, lut, buf);
            for (int64_t i = first_seeing(t, n, Q); i < Q; i++) {
                for (int64_t m = i; m < M; m += Q) {
                    const float *qm = qr + m * D;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t c = 0; c < D; c++) dot += qm[c] * k[c];
                    scores[m * n + t] = dot * scale;
                }
            }
        }
        for (int64_t m = 0, i = 0; m < M; m++, i = i + 1 == Q ? 0 : i + 1) {
            const int64_t seen = n - (Q - 1 - i);
            float *s = scores + m * n, top = -INFINITY, total = 0.0f;
            if (bias) { /* the logits' missing q . c (scaled), before any soft-cap */
                const float shift = bias[r * M + m] * scale;
                for (int64_t t = 0; t < seen; t++) s[t] += shift;
            }
            if (softcap > 0.0f)
                for (int64_t t = 0; t < seen; t++) s[t] = softcap * tanhf(s[t] / softcap);
            if (sinks) top = sinks[(r % H_kv) * G + m / Q];
            for (int64_t t = 0; t < seen; t++) top = s[t] > top ? s[t] : top;
            if (sinks) total = expf(sinks[(r % H_kv) * G + m / Q] - top);
            for (int64_t t = 0; t < seen; t++) {
                s[t] = expf(s[t] - top);
                total += s[t];
            }
            for (int64_t t = 0; t < seen; t++) s[t] /= total;
        }
        for (int64_t t = 0; t < n; t++) {
            const float *v = entry(t, n, R, r, rows, (int)D, v_side, v_rec + (off + t) * width, enc, bits, group,
                                   (int)sdtype, lut, buf);
            for (int64_t i = first_seeing(t, n, Q); i < Q; i++) {
                for (int64_t m = i; m < M; m += Q) {
                    const float p = scores[m * n + t];
                    float *restrict om = o + m * D;
#pragma omp simd
                    for (int64_t c = 0; c < D; c++) om[c] += p * v[c];
                }
            }
        }
    }
    free(scores);
    return 0;
}

/* ------------------------------------------------------------------------ attention over selected pages */

/* the body of kvq_sparse_attention (attend's entries, logits and softmax, over the listed pages' entries only: each
 * entry's rank and slot kept for the values' pass); inlined into the same specialisations */
INLINE int attend_pages(const float *q, const uint8_t *k_rec, const uint8_t *v_rec, int64_t width,
                        const int64_t *table, const uint8_t *selected, int64_t W, int64_t P, const int64_t *lens,
                        const float *side, int64_t R, int64_t B, int64_t H_kv, int64_t G, int64_t Q, const int64_t D,
                        const int enc, const int bits, const int group, int64_t sdtype, const float *lut, float scale,
                        float softcap, const float *bias, const float *sinks, float *out) {
    const int64_t rows = B * H_kv, M = G * Q;
    const float *v_side = side + (1 + R) * rows * D;
    const int64_t most = most_listed(table, selected, rows, W); /* the most pages a row reads */
    const int64_t cap = (most > 0 ? most : 1) * P;
    /* scores [M, cap], the row maxima and sums [2 M], a dequantized entry [D]; the slot and rank of each listed
     * entry [2 cap] */
    float *scores = malloc(sizeof(float) * (size_t)(M * cap + 2 * M + D) + sizeof(int64_t) * (size_t)(2 * cap));
    if (!scores) return 1;
    float *top = scores + M * cap, *total = top + M, *buf = total + M;
    int64_t *slot = (int64_t *)(buf + D), *rank = slot + cap;
    memset(out, 0, sizeof(float) * (size_t)(rows * M * D));
    for (int64_t r = 0; r < rows; r++) {
        const int64_t n = lens[r];
        if (n <= 0) continue;
        const float *qr = q + r * M * D;
        float *o = out + r * M * D;
        int64_t count = 0; /* entries listed: those the row holds in its selected pages */
        for (int64_t j = next_listed(table, selected, r, W, 0); j < W; j = next_listed(table, selected, r, W, j + 1)) {
            const int64_t start = j * P, page = table[r * W + j], held = n - start < P ? n - start : P;
            for (int64_t e = 0; e < held; e++) {
                const int64_t t = start + e, s = page * P + e;
                const float *k = entry(t, n, R, r, rows, (int)D, side, k_rec + s * width, enc, bits, group,
                                       (int)sdtype, lut, buf);
                for (int64_t m = 0; m < M; m++) { /* query i = m % Q sees ranks t < n - (Q - 1 - i) */
                    float x = -INFINITY;
                    if (t < n - (Q - 1 - m % Q)) {
                        const float *qm = qr + m * D;
                        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                        for (int64_t c = 0; c < D; c++) dot += qm[c] * k[c];
                        x = dot * scale;
                        if (bias) x += bias[r * M + m] * scale; /* the logit's missing q . c, before any soft-cap */
                        if (softcap > 0.0f) x = softcap * tanhf(x / softcap);
                    }
                    scores[m * cap + count] = x;
                }
                slot[count] = s;
                rank[count++] = t;
            }
        }
        softmax_numerators(scores, M, cap, count, sinks ? sinks + (r % H_kv) * G : NULL, Q, top, total);
        for (int64_t i = 0; i < count; i++) {
            const float *v = entry(rank[i], n, R, r, rows, (int)D, v_side, v_rec + slot[i] * width, enc, bits, group,
                                   (int)sdtype, lut, buf);
            add_weighted(o, scores, cap, i, M, D, v);
        }
        divide_by_sums(o, total, M, D);
    }
    free(scores);
    return 0;
}

/* the shapes both kernels are specialised for (head dim, encoding, bits, group), each a call X(D, enc, bits, group);
 * any other shape runs the generic body */
#define SPECIALISATIONS(X)                                                                                     \
    X(64, 0, 4, 32) X(64, 0, 8, 32) X(128, 0, 4, 32) X(128, 0, 8, 32) X(64, 0, 4, 64) X(128, 0, 4, 64)        \
    X(128, 0, 4, 128) X(64, 1, 8, 64) X(128, 1, 8, 128)

/* enc 0: integers of bits 4 or 8; enc 1: float8 e4m3 (bits 8); group: channels per scale (the head dim for one) */
int kvq_attention(const float *q, const uint8_t *k_rec, const uint8_t *v_rec, int64_t width,
                  const int64_t *offs, const int64_t *lens, const float *side, int64_t R, int64_t B,
                  int64_t H_kv, int64_t G, int64_t Q, int64_t D, int64_t enc, int64_t bits, int64_t group,
                  int64_t sdtype, float scale, float softcap, const float *bias, const float *sinks, float *out) {
    float lut[256];
    e4m3_table(lut);
#define DENSE(D_, ENC_, BITS_, GROUP_)                                                                          \
    if (D == D_ && enc == ENC_ && bits == BITS_ && group == GROUP_)                                           \
        return attend(q, k_rec, v_rec, width, offs, lens, side, R, B, H_kv, G, Q, D_, ENC_, BITS_, GROUP_, sdtype, \
                      lut, scale, softcap, bias, sinks, out);
    SPECIALISATIONS(DENSE)
#undef DENSE
    return attend(q, k_rec, v_rec, width, offs, lens, side, R, B, H_kv, G, Q, D, (int)enc, (int)bits, (int)group,
                  sdtype, lut, scale, softcap, bias, sinks, out);
}

/* the arguments of kvq_attention with table, selected [rows, W] and the page size P for offs; n_pages: the pages the
 * records hold (a listed page past them: 3, nothing read) */
int kvq_sparse_attention(const float *q, const uint8_t *k_rec, const uint8_t *v_rec, int64_t width,
                         const int64_t *table, const uint8_t *selected, int64_t W, int64_t P, int64_t n_pages,
                         const int64_t *lens, const float *side, int64_t R, int64_t B, int64_t H_kv, int64_t G,
                         int64_t Q, int64_t D, int64_t enc, int64_t bits, int64_t group, int64_t sdtype, float scale,
                         float softcap, const float *bias, const float *sinks, float *out) {
    for (int64_t i = 0; i < B * H_kv * W; i++)
        if (selected[i] && table[i] >= n_pages) return 3;
    float lut[256];
    e4m3_table(lut);
#define SPARSE(D_, ENC_, BITS_, GROUP_)                                                                         \
    if (D == D_ && enc == ENC_ && bits == BITS_ && group == GROUP_)                                           \
        return attend_pages(q, k_rec, v_rec, width, table, selected, W, P, lens, side, R, B, H_kv, G, Q, D_, ENC_, \
                            BITS_, GROUP_, sdtype, lut, scale, softcap, bias, sinks, out);
    SPECIALISATIONS(SPARSE)
#undef SPARSE
    return attend_pages(q, k_rec, v_rec, width, table, selected, W, P, lens, side, R, B, H_kv, G, Q, D, (int)enc,
                        (int)bits, (int)group, sdtype, lut, scale, softcap, bias, sinks, out);
}
