/* A single-threaded bf16 GEMM with float32 accumulation on AVX-512 BF16 (VDPBF16PS), for the
 * CPU kernels' bf16 products where the compiler targets a CPU that has the instruction.
 *
 * Why not MKL's gemm_bf16bf16f32, which the kernels called before: on AMD EPYC (AVX-512 BF16,
 * no AMX) MKL does not dispatch its AVX-512 BF16 code and multiplies at its float32 speed,
 * about 90 GFLOP/s a thread, where oneDNN's bf16 `torch.mm` reached 350-400 on the same core
 * (d_model 512 expert shapes; measured in the fifty-eighth session, docs/performance.md).
 *
 * Row-major float32 C[M, N] = alpha · op(A)[M, K] · op(B)[K, N] + beta · C, with A and B
 * bf16. The usual blocking: K in blocks of KP pairs of elements; B packed a block of NC
 * columns at a time as [pairs][NR] 32-bit lanes (element 2p of the lane's column in the low
 * half, 2p + 1 in the high half: VDPBF16PS's operand layout), A packed MR rows at a time as
 * [pairs][MR] (or, MR whole rows with K contiguous, read in place as pairs); an MR x NR
 * register tile of float32 sums (8 x 32: 16 zmm accumulators) adds a pair of K per
 * instruction. Rows, columns and an odd K past the edges are packed as zeros;
 * beta = 0 never reads C (which may hold anything). VDPBF16PS rounds to nearest even and
 * treats denormal inputs and results as zero. */
#ifndef SPARSEFFN_BF16_GEMM_H
#define SPARSEFFN_BF16_GEMM_H

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define SF_HAVE_BF16_GEMM 1

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

enum { BG_MR = 8, BG_NR = 32, BG_KP = 128, BG_NC = 256 };

/* A row-major bf16 matrix: element (i, j) of op(M) at p[i * ld + j], or p[j * ld + i] if trans */
typedef struct { const bf16 *p; int64_t ld; int trans; } bf16_matrix;

static inline uint32_t bg_pair(bf16 lo, bf16 hi) { return (uint32_t)lo | ((uint32_t)hi << 16); }

static inline uint32_t bg_load_pair(const bf16 *p) {   /* two adjacent elements, any alignment */
    uint32_t u;
    memcpy(&u, p, sizeof u);
    return u;
}

/* op(X)[i][k] and op(X)[i][k + 1] as one lane; zero past K (kmax elements) */
static inline uint32_t bg_pair_at(bf16_matrix X, int64_t i, int64_t k, int64_t kmax) {
    if (!X.trans) {
        const bf16 *row = X.p + i * X.ld + k;
        return k + 1 < kmax ? bg_load_pair(row) : bg_pair(row[0], 0);
    }
    bf16 lo = X.p[k * X.ld + i], hi = k + 1 < kmax ? X.p[(k + 1) * X.ld + i] : 0;
    return bg_pair(lo, hi);
}

/* A's rows [i0, i0 + MR) and K elements [k0, k0 + 2 kp) as [kp][MR] lanes (op(A) is M x K) */
static void bg_pack_a(bf16_matrix A, int64_t i0, int rows, int64_t k0, int kp, int64_t K,
                      uint32_t *dst) {
    for (int p = 0; p < kp; p++) {
        uint32_t *d = dst + (int64_t)p * BG_MR;
        int64_t k = k0 + 2 * (int64_t)p;
        if (A.trans && rows == BG_MR && k + 1 < K) {   /* rows k and k + 1, 8 columns each */
            __m128i lo = _mm_loadu_si128((const __m128i *)(A.p + k * A.ld + i0));
            __m128i hi = _mm_loadu_si128((const __m128i *)(A.p + (k + 1) * A.ld + i0));
            _mm_storeu_si128((__m128i *)d, _mm_unpacklo_epi16(lo, hi));
            _mm_storeu_si128((__m128i *)(d + 4), _mm_unpackhi_epi16(lo, hi));
            continue;
        }
        int r = 0;
        for (; r < rows; r++) d[r] = bg_pair_at(A, i0 + r, k, K);
        for (; r < BG_MR; r++) d[r] = 0;
    }
}

/* op(B)'s columns [j0, j0 + cols) and K elements [k0, k0 + 2 kp) as [kp][NR] lanes per
 * panel of NR columns, panels one after another (op(B) is K x N) */
static void bg_pack_b(bf16_matrix B, int64_t j0, int cols, int64_t k0, int kp, int64_t K,
                      uint32_t *dst) {
    bf16_matrix bt = { B.p, B.ld, !B.trans };   /* op(bt) = op(B)ᵀ, N x K: pairs along its rows */
    for (int c0 = 0; c0 < cols; c0 += BG_NR) {
        uint32_t *panel = dst + (int64_t)(c0 / BG_NR) * kp * BG_NR;
        int width = cols - c0 < BG_NR ? cols - c0 : BG_NR;
        for (int p = 0; p < kp; p++) {
            uint32_t *d = panel + (int64_t)p * BG_NR;
            int64_t k = k0 + 2 * (int64_t)p;
            if (!B.trans && width == BG_NR && k + 1 < K) {   /* rows k and k + 1, 16 at a time */
                const bf16 *lo = B.p + k * B.ld + j0 + c0, *hi = lo + B.ld;
                for (int h = 0; h < BG_NR; h += 16) {
                    __m256i l16 = _mm256_loadu_si256((const __m256i *)(lo + h));
                    __m256i u16 = _mm256_loadu_si256((const __m256i *)(hi + h));
                    __m512i l = _mm512_cvtepu16_epi32(l16), u = _mm512_cvtepu16_epi32(u16);
                    _mm512_storeu_si512(d + h, _mm512_or_si512(l, _mm512_slli_epi32(u, 16)));
                }
                continue;
            }
            int c = 0;
            for (; c < width; c++) d[c] = bg_pair_at(bt, j0 + c0 + c, k, K);
            for (; c < BG_NR; c++) d[c] = 0;
        }
    }
}

/* C[rows, cols] (row stride ldc) = alpha · (a · b) + (first ? beta · C : C), the product of
 * kp pairs of K: row r's pair p of A is the 32 bits at a + p · pair_step + r · row_step
 * (bytes: packed [kp][MR] lanes, or A's own rows), b [kp][NR] */
static void bg_tile(int kp, const char *a, int64_t pair_step, int64_t row_step,
                    const uint32_t *b, float *C, int64_t ldc, int rows, int cols, float alpha,
                    float beta, int first) {
    __m512 acc[BG_MR][2];
    for (int r = 0; r < BG_MR; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int p = 0; p < kp; p++) {
        __m512bh b0 = (__m512bh)_mm512_loadu_si512(b + (int64_t)p * BG_NR);
        __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + (int64_t)p * BG_NR + 16);
        const char *ap = a + p * pair_step;
        for (int r = 0; r < BG_MR; r++) {
            uint32_t pair;
            memcpy(&pair, ap + r * row_step, sizeof pair);
            __m512bh av = (__m512bh)_mm512_set1_epi32((int)pair);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], av, b0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], av, b1);
        }
    }
    __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
    for (int r = 0; r < rows; r++) {
        float *c = C + (int64_t)r * ldc;
        for (int h = 0; h < 2; h++) {
            int left = cols - 16 * h;
            if (left <= 0) break;
            __mmask16 m = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
            __m512 v = _mm512_mul_ps(va, acc[r][h]);
            if (!first)
                v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, c + 16 * h), v);
            else if (beta != 0.0f)
                v = _mm512_add_ps(_mm512_mul_ps(vb, _mm512_maskz_loadu_ps(m, c + 16 * h)), v);
            _mm512_mask_storeu_ps(c + 16 * h, m, v);
        }
    }
}

/* Thread-private packing buffers, kept between calls (OpenMP threads live on) */
static __thread uint32_t *bg_buf_a = 0, *bg_buf_b = 0;

/* A whole packed op(B), kept by each thread for its next product with the same B in the same
 * kernel call (`reuse`, a number no other call shares): the CVMM kernels multiply each
 * expert's weight with its rows a chunk at a time, and packing it anew for every chunk took
 * about an eighth of a product of 128 rows. The packed blocks lie k block by k block, each
 * [kp][Npad] lanes (Npad: N rounded up to whole panels), column block j0's at lane kp · j0. */
enum { BG_CACHE_MAX = 1 << 22 };   /* lanes (16 MB): a larger B is packed block by block */
static __thread uint32_t *bg_cache = 0;
static __thread int64_t bg_cache_lanes = 0;
static __thread struct { uint64_t reuse; const bf16 *p; int64_t ld; int trans, K, N; } bg_key;

/* The buffer of this call's whole packed op(B), or 0 where it is not to be kept (no `reuse`,
 * too large, no memory); *filled says whether this thread packed it already. Unfilled, it is
 * unkeyed until bf16_gemm has packed every block into it as it goes. */
static uint32_t *bg_whole_b(bf16_matrix B, int N, int K, uint64_t reuse, int *filled) {
    int64_t npad = ((int64_t)N + BG_NR - 1) / BG_NR * BG_NR, lanes = (K + 1) / 2 * npad;
    *filled = 0;
    if (!reuse || lanes > BG_CACHE_MAX) return 0;
    if (bg_cache && bg_key.reuse == reuse && bg_key.p == B.p && bg_key.ld == B.ld &&
            bg_key.trans == B.trans && bg_key.K == K && bg_key.N == N) {
        *filled = 1;
        return bg_cache;
    }
    if (lanes > bg_cache_lanes) {
        free(bg_cache);
        bg_cache = (uint32_t *)malloc(sizeof(uint32_t) * lanes);
        bg_cache_lanes = bg_cache ? lanes : 0;
    }
    bg_key.reuse = 0;
    return bg_cache;
}

/* Returns 0, or -1 where the buffers could not be allocated (nothing written). `reuse`: 0, or
 * the kernel call's number, under which B is packed whole once per thread (bg_whole_b). */
static int bf16_gemm(int M, int N, int K, float alpha, bf16_matrix A, bf16_matrix B, float beta,
                     float *C, int64_t ldc, uint64_t reuse) {
    if (!bg_buf_a) bg_buf_a = (uint32_t *)malloc(sizeof(uint32_t) * BG_KP * BG_MR);
    if (!bg_buf_b) bg_buf_b = (uint32_t *)malloc(sizeof(uint32_t) * BG_KP * BG_NC);
    if (!bg_buf_a || !bg_buf_b) return -1;
    int filled;
    uint32_t *whole = bg_whole_b(B, N, K, reuse, &filled);
    int64_t npad = ((int64_t)N + BG_NR - 1) / BG_NR * BG_NR;
    for (int64_t k0 = 0; k0 < K; k0 += 2 * BG_KP) {
        int64_t left = (K - k0 + 1) / 2;
        int kp = left < BG_KP ? (int)left : BG_KP;
        int first = k0 == 0;
        for (int64_t j0 = 0; j0 < N; j0 += BG_NC) {
            int cols = N - j0 < BG_NC ? (int)(N - j0) : BG_NC;
            uint32_t *packed = whole ? whole + k0 / 2 * npad + kp * j0 : bg_buf_b;
            if (!filled) bg_pack_b(B, j0, cols, k0, kp, K, packed);
            for (int64_t i0 = 0; i0 < M; i0 += BG_MR) {
                int rows = M - i0 < BG_MR ? (int)(M - i0) : BG_MR;
                /* whole rows of A with K contiguous and no half pair: read in place */
                int in_place = !A.trans && rows == BG_MR && k0 + 2 * (int64_t)kp <= K;
                const char *a = (const char *)bg_buf_a;
                int64_t pair_step = BG_MR * sizeof(uint32_t), row_step = sizeof(uint32_t);
                if (in_place) {
                    a = (const char *)(A.p + i0 * A.ld + k0);
                    pair_step = 2 * sizeof(bf16);
                    row_step = A.ld * (int64_t)sizeof(bf16);
                } else {
                    bg_pack_a(A, i0, rows, k0, kp, K, bg_buf_a);
                }
                for (int c0 = 0; c0 < cols; c0 += BG_NR) {
                    int width = cols - c0 < BG_NR ? cols - c0 : BG_NR;
                    bg_tile(kp, a, pair_step, row_step,
                            packed + (int64_t)(c0 / BG_NR) * kp * BG_NR,
                            C + i0 * ldc + j0 + c0, ldc, rows, width, alpha, beta, first);
                }
            }
        }
    }
    if (whole && !filled) {
        bg_key.reuse = reuse; bg_key.p = B.p; bg_key.ld = B.ld; bg_key.trans = B.trans;
        bg_key.K = K; bg_key.N = N;
    }
    return 0;
}

#endif
#endif
