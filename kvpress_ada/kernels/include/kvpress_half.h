/* 16-bit floats as float32, shared by the fused CPU kernels (quantized/cpu_kernel.c, ragged/sparse_cpu_kernel.c).
 *
 * Built with -I <this folder> by kvpress_ada/kernels/quantized/cpu_kernel.py (build_kernel), whose cache key hashes
 * every header here: an edit rebuilds every kernel that includes it.
 */
#ifndef KVPRESS_HALF_H
#define KVPRESS_HALF_H

#include <stdint.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

/* the float32 of bit pattern u */
static inline float from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* an IEEE float16 as float32 (exact: every float16 is a float32), subnormals, infinities and NaN included */
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0x1f) return from_bits(sign | 0x7f800000u | (man << 13));       /* inf, nan */
    if (exp) return from_bits(sign | ((exp + 112u) << 23) | (man << 13));      /* normal */
    if (!man) return from_bits(sign);                                          /* zero */
    float f = (float)man * 5.9604644775390625e-08f;                            /* subnormal: man * 2^-24 */
    return sign ? -f : f;
}

/* a 16-bit float of dtype (1 float16, 2 bfloat16: its float32's upper half) as float32 */
static inline float sixteen_to_float(uint16_t h, int dtype) {
    return dtype == 2 ? from_bits((uint32_t)h << 16) : half_to_float(h);
}

/* float32 as the nearest float16 (ties to even; past float16's range: +-inf; NaN stays NaN), as its bits */
static inline uint16_t half_of(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    x &= 0x7fffffffu;
    if (x > 0x7f800000u) return sign | 0x7e00u | (uint16_t)((x >> 13) & 0x3ffu); /* NaN (quiet) */
    if (x >= 0x477ff000u) return sign | 0x7c00u;                                /* >= 65520: inf */
    if (x < 0x38800000u) { /* below 2^-14: a subnormal (or zero) of float16, man * 2^-24, ties to even */
        const uint32_t e = x >> 23, man = (x & 0x7fffffu) | (e ? 0x800000u : 0u);
        const uint32_t shift = e ? 126u - e : 125u; /* man * 2^(e - 150) = (man >> (126 - e)) * 2^-24 */
        if (shift >= 32u) return sign;
        const uint32_t q = man >> shift, rest = man & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        return sign | (uint16_t)(q + (rest > half || (rest == half && (q & 1u))));
    }
    uint32_t h = (x - 0x38000000u) >> 13; /* exponent rebiased (127 -> 15), mantissa truncated */
    const uint32_t rest = x & 0x1fffu;
    h += rest > 0x1000u || (rest == 0x1000u && (h & 1u)); /* a carry moves into the exponent, as it should */
    return sign | (uint16_t)h;
}

/* the float16 nearest x on one side (up: the least at or above x, else the greatest at or below), as its bits;
 * NaN stays NaN */
static inline uint16_t half_outward(float x, int up) {
    uint16_t h = half_of(x);
    const float y = half_to_float(h);
    if (up ? y < x : y > x) h = ((h & 0x8000u) != 0) == (up != 0) ? (uint16_t)(h - 1u) : (uint16_t)(h + 1u);
    return h;
}

#endif
