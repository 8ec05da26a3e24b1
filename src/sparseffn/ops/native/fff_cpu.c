/* CPU kernels for fast feed-forward (FFF) trees (Chaunin & Mikhailovskiy §1.2-2.3).
 *
 * Tree layout (sparseffn/ops/fff.py): nodes in heap order, level l holds nodes
 * [2^l - 1, 2^(l+1) - 1), node n's children are 2n + 1 (left) and 2n + 2 (right); leaves are
 * numbered left to right. A row of node values has N = 2^d - 1 entries, a row of leaf values
 * L = 2^d.
 *
 * sf_fff_expand        leaf values from node values, level by level, O(L) per token instead of
 *                      the O(d L) of the original formulation or the O(L^2) of the dense T.
 * sf_fff_expand_backward   its gradient, a bottom-up sweep of the same cost.
 * sf_fff_descend       greedy hard inference: d dot products per token.
 *
 * Every token is independent; OpenMP threads take contiguous blocks of tokens (one thread for
 * small batches, see SF_PARALLEL_MIN_WORK). Within a token each level is written out of place
 * (two buffers that alternate, the last level landing in the output row) so that the loops
 * vectorise; a row of 2^13 floats fits in L1/L2.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

/* Modes: how a node's two children get their values from the parent's value `cur`.
 *  0  product: node value p = sigmoid(z); left = cur * p, right = cur * (1 - p)
 *     (Eq. 3-6: leaf probabilities of the original FFF, already normalised);
 *  1  sum, a(-z) = a(z) - z: node value a(z), plus z; left = cur + a(z), right = left - z
 *     (Eq. 7 for log-sigmoid, softplus, ReLU and GELU, which all satisfy a(x) - a(-x) = x);
 *  2  sum, a(-z) = -a(z): node value a(z) = z (linear); left = cur + z, right = cur - z;
 *  3  the product of mode 0 given the logits z themselves, p = sigmoid(z) computed here (no
 *     [rows, N] tensor of sigmoids written and read again). */
enum { MODE_PRODUCT = 0, MODE_SUM_SHIFTED = 1, MODE_SUM_ODD = 2, MODE_PRODUCT_OF_LOGITS = 3 };

/* sigmoid(z) without a libm call, so that the loops calling it vectorise (measured against
 * float64: at most 1.8e-7 relative error, torch.sigmoid's 1.4e-7). With a = -|z|, e = exp(a)
 * in (0, 1] and sigmoid(z) = 1 / (1 + e) for z >= 0, e / (1 + e) for z < 0. exp(a) = 2^n
 * exp(r), n = round(a / ln 2) (adding and subtracting 1.5 * 2^23 rounds to the nearest
 * integer; floorf would not vectorise), r = a - n ln 2 in [-ln2/2, ln2/2] (ln 2 split in two
 * parts so that n ln 2 is exact to float precision), exp(r) by its Taylor series to r^7
 * (truncation below 1e-8 relative, under float32's 6e-8 epsilon). exp(a) for a < -87 counts
 * as 0 (sigmoid then off by less than 1.7e-38). NaN stays NaN. */
static inline float sf_sigmoid(float z) {
    const float a = (z > 0.0f) ? -z : z;                    /* -|z|; NaN stays NaN */
    const float a_c = (a >= -87.0f) ? a : -87.0f;            /* NaN and -inf clamp too */
    const float n = (a_c * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const float r = (a_c - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { int32_t i; float f; } two_n;
    two_n.i = ((int32_t)n + 127) << 23;                      /* n in [-126, 0] */
    float e = p * two_n.f;
    e = (a >= -87.0f) ? e : 0.0f;
    const float s = ((z >= 0.0f) ? 1.0f : e) / (1.0f + e);
    return (z == z) ? s : z;
}

/* Below this many floats of work (leaf values, or multiply-adds of the descent) one thread
 * does it all: waking a second one costs about 1 us, more than it saves (measured on 2 cores:
 * 1 thread faster up to 4096 leaf values or 8192 multiply-adds, 2 faster from 16384). */
#define SF_PARALLEL_MIN_WORK 8192

static int team(int nthreads, int64_t rows, int64_t work) {
    if (work < SF_PARALLEL_MIN_WORK || rows < 2) return 1;
    return rows < nthreads ? (int)rows : nthreads;
}

static int expand_row(const float *a, const float *z, int depth, int mode, float *out,
                      float *scratch) {
    /* The level written last (depth - 1) must land in `out`. */
    float *buf[2] = { (depth % 2) ? out : scratch, (depth % 2) ? scratch : out };
    float *src = NULL;
    for (int l = 0; l < depth; l++) {
        const int64_t n = (int64_t)1 << l, base = n - 1;
        float *dst = buf[l % 2];
        const float *al = a + base;
        if (l == 0) {
            const int product = mode == MODE_PRODUCT || mode == MODE_PRODUCT_OF_LOGITS;
            const float a0 = (mode == MODE_PRODUCT_OF_LOGITS) ? sf_sigmoid(al[0]) : al[0];
            const float root = product ? 1.0f : 0.0f;
            const float left = product ? root * a0 : root + a0;
            dst[0] = left;
            dst[1] = product ? root - left
                   : (mode == MODE_SUM_SHIFTED) ? left - z[base] : root - a0;
        } else if (mode == MODE_PRODUCT_OF_LOGITS) {
            #pragma omp simd
            for (int64_t m = 0; m < n; m++) {
                const float left = src[m] * sf_sigmoid(al[m]);
                dst[2 * m] = left;
                dst[2 * m + 1] = src[m] - left;
            }
        } else if (mode == MODE_PRODUCT) {
            #pragma omp simd
            for (int64_t m = 0; m < n; m++) {
                const float left = src[m] * al[m];
                dst[2 * m] = left;
                dst[2 * m + 1] = src[m] - left;
            }
        } else if (mode == MODE_SUM_SHIFTED) {
            const float *zl = z + base;
            #pragma omp simd
            for (int64_t m = 0; m < n; m++) {
                const float left = src[m] + al[m];
                dst[2 * m] = left;
                dst[2 * m + 1] = left - zl[m];
            }
        } else {
            #pragma omp simd
            for (int64_t m = 0; m < n; m++) {
                dst[2 * m] = src[m] + al[m];
                dst[2 * m + 1] = src[m] - al[m];
            }
        }
        src = dst;
    }
    return 0;
}

/* out[t, :L] = leaf values of token t. a, z: [rows, N] with row strides lda, ldz (z is read
 * in mode 1 only); out: [rows, L] contiguous. Returns 0, or 1 when scratch memory ran out. */
int sf_fff_expand(const float *a, int64_t lda, const float *z, int64_t ldz, int64_t rows,
                  int depth, int mode, float *out, int nthreads) {
    const int64_t L = (int64_t)1 << depth;
    int failed = 0;
    #pragma omp parallel num_threads(team(nthreads, rows, rows * L)) reduction(|:failed)
    {
        float *scratch = (float *)malloc(sizeof(float) * L);
        /* every thread reaches the worksharing loop; one without scratch skips its rows */
        failed = !scratch;
        {
            #pragma omp for schedule(static)
            for (int64_t t = 0; t < rows; t++)
                if (!failed) expand_row(a + t * lda, z ? z + t * ldz : NULL, depth, mode, out + t * L,
                           scratch);
        }
        free(scratch);
    }
    return failed;
}

/* Gradient of sf_fff_expand with respect to the node logits z.
 *
 * grad_leaf: [rows, L], the gradient of the loss with respect to the leaf values of the mode:
 *   mode 0 takes the gradient w.r.t. the leaf *probabilities* and the probabilities `leaf`
 *   themselves, and forms the log-space gradient g = grad * leaf (a leaf probability is the
 *   exponential of its log-sigmoid path sum); modes 1-2 take the log-space gradient directly
 *   (`leaf` unused).
 * d: [rows, N] node derivative data: mode 0 p = sigmoid(z) (a'(z) = 1 - p for log-sigmoid),
 *   mode 1 a'(z), mode 2 unused, mode 3 the logits z (a'(z) = 1 - sigmoid(z) = sigmoid(-z)
 *   computed here); modes 0 and 3 take `leaf`.
 * Bottom-up (Eq. 7 transposed): the two children's gradients g0, g1 of node n sum to the
 * gradient of the parent's path value, and
 *   dz_n = g0 a'(z_n) - g1 a'(-z_n) = (g0 + g1) a'(z_n) - g1   (modes 0-1, a'(-z) = 1 - a'(z))
 *   dz_n = g0 - g1                                              (mode 2).
 * grad_z: [rows, N] contiguous. */
int sf_fff_expand_backward(const float *grad_leaf, int64_t ldg, const float *leaf,
                           int64_t ldl, const float *d, int64_t ldd, int64_t rows, int depth,
                           int mode, float *grad_z, int nthreads) {
    const int64_t L = (int64_t)1 << depth, N = L - 1;
    int failed = 0;
    #pragma omp parallel num_threads(team(nthreads, rows, rows * L)) reduction(|:failed)
    {
        float *buf0 = (float *)malloc(sizeof(float) * L);
        float *buf1 = (float *)malloc(sizeof(float) * L);
        failed = !buf0 || !buf1;   /* every thread reaches the loop; one without buffers skips */
        {
            #pragma omp for schedule(static)
            for (int64_t t = 0; t < rows; t++) {
                if (failed) continue;
                const float *gt = grad_leaf + t * ldg;
                const float *dt = d ? d + t * ldd : NULL;
                float *gz = grad_z + t * N;
                float *src = buf0, *dst = buf1;
                if (mode == MODE_PRODUCT || mode == MODE_PRODUCT_OF_LOGITS) {
                    const float *lt = leaf + t * ldl;
                    #pragma omp simd
                    for (int64_t i = 0; i < L; i++) src[i] = gt[i] * lt[i];
                } else {
                    memcpy(src, gt, sizeof(float) * L);
                }
                for (int l = depth - 1; l >= 0; l--) {
                    const int64_t n = (int64_t)1 << l, base = n - 1;
                    float *gzl = gz + base;
                    if (mode == MODE_SUM_ODD) {
                        #pragma omp simd
                        for (int64_t m = 0; m < n; m++) {
                            const float g0 = src[2 * m], g1 = src[2 * m + 1];
                            gzl[m] = g0 - g1;
                            dst[m] = g0 + g1;
                        }
                    } else if (mode == MODE_PRODUCT_OF_LOGITS) {
                        const float *zl = dt + base;
                        #pragma omp simd
                        for (int64_t m = 0; m < n; m++) {
                            const float g0 = src[2 * m], g1 = src[2 * m + 1], s = g0 + g1;
                            gzl[m] = s * sf_sigmoid(-zl[m]) - g1;
                            dst[m] = s;
                        }
                    } else {
                        const float *dl = dt + base;
                        const float sign = (mode == MODE_PRODUCT) ? -1.0f : 1.0f;
                        const float offset = (mode == MODE_PRODUCT) ? 1.0f : 0.0f;
                        #pragma omp simd
                        for (int64_t m = 0; m < n; m++) {
                            const float g0 = src[2 * m], g1 = src[2 * m + 1], s = g0 + g1;
                            gzl[m] = s * (offset + sign * dl[m]) - g1;
                            dst[m] = s;
                        }
                    }
                    float *tmp = src; src = dst; dst = tmp;
                }
            }
        }
        free(buf0);
        free(buf1);
    }
    return failed;
}

/* Greedy hard inference (Chaunin & Mikhailovskiy §1.2): from the root, go left where z_n = <x, w_n> + b_n > 0
 * and right otherwise, one node per level. x: [rows, dim] (row stride ldx); w: [N, dim] (row
 * stride ldw); bias: [N] or NULL; leaf_out: [rows] int64. */
int sf_fff_descend(const float *x, int64_t ldx, const float *w, int64_t ldw, const float *bias,
                   int64_t rows, int dim, int depth, int64_t *leaf_out, int nthreads) {
    const int64_t first_leaf = ((int64_t)1 << depth) - 1;
    #pragma omp parallel for num_threads(team(nthreads, rows, rows * depth * (int64_t)dim)) \
        schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        const float *xt = x + t * ldx;
        int64_t node = 0;
        for (int l = 0; l < depth; l++) {
            const float *wn = w + node * ldw;
            float s = 0.0f;
            #pragma omp simd reduction(+:s)
            for (int j = 0; j < dim; j++) s += xt[j] * wn[j];
            if (bias) s += bias[node];
            node = 2 * node + 1 + (s > 0.0f ? 0 : 1);
        }
        leaf_out[t] = node - first_leaf;
    }
    return 0;
}
