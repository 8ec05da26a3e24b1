/* CPU kernel for a mixture of MLP experts applied to a few tokens (inference: decoding one
 * token at a time, or a fast feed-forward tree's hard descent to one leaf), see
 * sparseffn/ops/expert_mlp.py.
 *
 * sf_mlp_pairs   y[t] = sum_j g[t, j] * f_{e[t, j]}(x[t])   over each token's k (token, expert)
 *                pairs, with f_e(x) = W2_e^T h + b2_e and h = act(W1_e x + b1_e), or for gated
 *                experts h = act(Wg_e x) * (W1_e x + b1_e) (Csordas et al. 2023 Eq. 25;
 *                Shazeer 2020 for the gated form). Pairs with keep[p] == 0 are never computed
 *                and contribute exactly zero.
 *
 * The grouped products of cvmm_cpu.c need the pairs sorted by expert and a plan around them;
 * for a handful of pairs that bookkeeping costs more than the products. Here the pairs are
 * sorted in C (qsort of at most a few hundred) and each expert's weights are read once, in
 * blocks of HB hidden units, for all of its pairs, straight from the weight tensors (no
 * gathered copies). Every block of every pair writes its own partial output row, and the
 * partial rows are added in a fixed order (slot, then block), so the result does not depend
 * on the number of threads.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#define HB 64   /* hidden units per work item */

/* Activations by code, as sparseffn/activations.py names them. */
enum { ACT_RELU = 0, ACT_GELU = 1, ACT_GELU_TANH = 2, ACT_SILU = 3, ACT_QUICK_GELU = 4 };

static inline float activate(float a, int act) {
    switch (act) {
    case ACT_RELU: return a <= 0.0f ? 0.0f : a;   /* max(a, 0) that keeps NaN, as torch.relu */
    case ACT_GELU: return 0.5f * a * (1.0f + erff(a * 0.70710678118654752f));
    case ACT_GELU_TANH:
        return 0.5f * a * (1.0f + tanhf(0.79788456080286536f * (a + 0.044715f * a * a * a)));
    case ACT_QUICK_GELU: return a / (1.0f + expf(-1.702f * a));   /* a * sigmoid(1.702 a) */
    default: return a / (1.0f + expf(-a));           /* silu */
    }
}

static inline float dot(const float *a, const float *b, int n) {
    float s = 0.0f;
    #pragma omp simd reduction(+:s)
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

typedef struct { int64_t expert; int64_t pair; } pair_key;

static int by_expert_then_pair(const void *pa, const void *pb) {
    const pair_key *a = (const pair_key *)pa, *b = (const pair_key *)pb;
    if (a->expert != b->expert) return a->expert < b->expert ? -1 : 1;
    return a->pair < b->pair ? -1 : (a->pair > b->pair);
}

/* x [T, m] (row stride ldx); idx int64 [T * k]; gates float [T * k] or NULL (all 1); keep
 * uint8 [T * k] or NULL (all kept). Weights with unit column stride: w1 and wg (or NULL)
 * [E, G, m] with expert and row strides (se, sr), w2 [E, G, n] likewise; b1 [E, G] (expert
 * stride b1_se) or NULL, b2 [E, n] (b2_se) or NULL. out float [T, n], contiguous, every element
 * written. Returns 1 when scratch memory cannot be allocated. */
int sf_mlp_pairs(const float *x, int64_t ldx, const int64_t *idx, const float *gates,
                 const uint8_t *keep, int64_t T, int k,
                 const float *w1, int64_t w1_se, int64_t w1_sr,
                 const float *wg, int64_t wg_se, int64_t wg_sr,
                 const float *b1, int64_t b1_se,
                 const float *w2, int64_t w2_se, int64_t w2_sr,
                 const float *b2, int64_t b2_se,
                 int m, int G, int n, int act, float *out, int nthreads) {
    const int64_t P = T * (int64_t)k;
    const int nb = (G + HB - 1) / HB;
    if (T <= 0 || n <= 0) return 0;
    pair_key *pairs = (pair_key *)malloc(sizeof(pair_key) * (size_t)(P > 0 ? P : 1));
    int64_t *group = (int64_t *)malloc(sizeof(int64_t) * (size_t)(P + 1));
    float *partial = (float *)malloc(sizeof(float) * (size_t)(P > 0 ? P : 1) * nb * n);
    if (!pairs || !group || !partial) { free(pairs); free(group); free(partial); return 1; }

    int64_t kept = 0;
    for (int64_t p = 0; p < P; p++)
        if (!keep || keep[p]) { pairs[kept].expert = idx[p]; pairs[kept].pair = p; kept++; }
    qsort(pairs, (size_t)kept, sizeof(pair_key), by_expert_then_pair);
    int64_t groups = 0, largest = 0;
    for (int64_t i = 0; i < kept; i++)
        if (i == 0 || pairs[i].expert != pairs[i - 1].expert) group[groups++] = i;
    group[groups] = kept;
    for (int64_t g = 0; g < groups; g++)
        if (group[g + 1] - group[g] > largest) largest = group[g + 1] - group[g];

    const int64_t items = groups * nb;
    int failed = 0;
    #pragma omp parallel num_threads(items < nthreads ? (int)(items > 0 ? items : 1) : nthreads)
    {
        float *h = (float *)malloc(sizeof(float) * (size_t)(largest > 0 ? largest : 1) * HB);
        if (!h) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            if (failed) continue;
            const int64_t g = it / nb, first = group[g], count = group[g + 1] - first;
            const int b = (int)(it % nb), u0 = b * HB, u1 = u0 + HB < G ? u0 + HB : G;
            const int64_t e = pairs[first].expert;
            /* the block's hidden units for every pair of this expert (W1 rows read once) */
            for (int u = u0; u < u1; u++) {
                const float *r1 = w1 + e * w1_se + (int64_t)u * w1_sr;
                const float *rg = wg ? wg + e * wg_se + (int64_t)u * wg_sr : 0;
                const float bias = b1 ? b1[e * b1_se + u] : 0.0f;
                for (int64_t q = 0; q < count; q++) {
                    const float *xt = x + (pairs[first + q].pair / k) * ldx;
                    const float pre = dot(r1, xt, m) + bias;
                    h[q * HB + (u - u0)] = rg ? activate(dot(rg, xt, m), act) * pre
                                              : activate(pre, act);
                }
            }
            /* their partial outputs over the block (W2 rows stay in cache across pairs) */
            for (int64_t q = 0; q < count; q++) {
                float *o = partial + (pairs[first + q].pair * nb + b) * (int64_t)n;
                memset(o, 0, sizeof(float) * (size_t)n);
                for (int u = u0; u < u1; u++) {
                    const float hv = h[q * HB + (u - u0)];
                    const float *r2 = w2 + e * w2_se + (int64_t)u * w2_sr;
                    #pragma omp simd
                    for (int c = 0; c < n; c++) o[c] += hv * r2[c];
                }
            }
        }
        free(h);
    }
    if (!failed) {
        /* out[t] = sum over kept slots j, in slot order, of g * (sum of the blocks + b2) */
        #pragma omp parallel for num_threads(T < nthreads ? (int)T : nthreads) schedule(static)
        for (int64_t t = 0; t < T; t++) {
            float *o = out + t * n;
            memset(o, 0, sizeof(float) * (size_t)n);
            for (int j = 0; j < k; j++) {
                const int64_t p = t * k + j;
                if (keep && !keep[p]) continue;
                const float gate = gates ? gates[p] : 1.0f;
                const float *z = partial + p * nb * (int64_t)n;
                const float *bias = b2 ? b2 + idx[p] * b2_se : 0;
                for (int c = 0; c < n; c++) {
                    float v = z[c];
                    for (int bb = 1; bb < nb; bb++) v += z[(int64_t)bb * n + c];
                    if (bias) v += bias[c];
                    o[c] += gate * v;
                }
            }
        }
    }
    free(pairs);
    free(group);
    free(partial);
    return failed;
}
