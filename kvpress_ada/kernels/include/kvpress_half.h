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

#endif
