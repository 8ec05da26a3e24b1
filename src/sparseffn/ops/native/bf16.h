/* bfloat16 storage for the CPU kernels: the upper 16 bits of a float32. Arithmetic runs in
 * float32; a result is rounded to bf16 once, to nearest even, as PyTorch rounds. */
#ifndef SPARSEFFN_BF16_H
#define SPARSEFFN_BF16_H

#include <stdint.h>
#include <string.h>

typedef uint16_t bf16;

static inline float bf16_to_f32(bf16 h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even, as PyTorch's float -> bfloat16 conversion does; NaN stays NaN. */
static inline bf16 f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

/* Round the float32 row src to the bf16 row dst (n elements). */
static inline void round_row_to_bf16(const float *src, bf16 *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i]);
}

#endif
