/* CPU kernels for tables of single rows: product-key retrieval (PKM, Lample et al. 2019;
 * Csordás et al. 2023 §3.2) and single-neuron experts (PEER, He 2024 §3), see sparseffn/ops/rows.py and
 * sparseffn/ops/product_keys.py.
 *
 * A "pair" (t, j) names row idx[t, j] of a table [N, d] for row t of a batch; pairs are never
 * materialised as [pairs, d] copies, each kernel reads the table rows in place.
 *
 * sf_gather_dot    out[t, j] = <x[t], table[idx[t, j]]>
 * sf_gather_sum    out[t]    = sum_j w[t, j] * table[idx[t, j]]          (an embedding bag)
 * sf_scatter_rows  out[i]    = sum_{(t, j): idx[t, j] = i} w[t, j] * src[t]   for every row i
 *                  (zero where no pair lands): the gradient of both kernels above with respect
 *                  to the table. Pairs are grouped by row with a stable counting sort and each
 *                  row is summed by one thread in pair order, so the result does not depend on
 *                  the number of threads.
 * sf_scatter_rows_dot  sf_scatter_rows and, for each pair, <src[t], table[idx[t, j]]>: both
 *                  gradients of sf_gather_sum, from one read of each pair's src row.
 * sf_topk_rows     the k largest entries of each row, ordered by (value desc, index asc): ties
 *                  go to the lower index, deterministically.
 * sf_pk_topk       product-key top-k (Csordás et al. 2023 Eq. 15): the top ka of row a, the top kb of row
 *                  b, and the top k of the ka * kb sums, with full index ia + na * ib, ordered
 *                  by (sum desc, index asc). Scores are ranked as sparseffn.ops.kernels.rankable
 *                  maps them (NaN and -inf below every finite score, +inf above) and the values
 *                  returned are the sums of the original scores, so a selected NaN stays NaN.
 *
 * The tables of sf_gather_dot and sf_gather_sum, the output of sf_gather_sum and both src and
 * output of sf_scatter_rows may be bfloat16 (flag `bf`): their rows are read and summed in
 * float32 and each output element is rounded once (bf16.h). At PKM's table sizes (3,844 rows
 * of 256) the halved bytes made gather_dot 1.2x and gather_sum 1.4x faster; tables of a
 * million rows gain nothing (the reads are latency-bound). x and the weights are float32.
 *
 * Rows are independent; OpenMP threads take blocks of rows.
 */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "bf16.h"

/* --- row sums in registers ------------------------------------------------------------------
 * GCC/Clang vector extensions at the machine's vector width: a vf is LANES float32 lanes (16
 * with AVX-512, 8 with AVX, 4 otherwise: SSE, NEON). A "step" is STEP = 2 * LANES columns of a
 * row read as two vf: columns c .. c + LANES - 1 and the next LANES of a float32 row, or the
 * even and the odd columns of a bf16 row (each 32-bit lane holds two bf16, so one load, a
 * shift and a mask widen STEP of them).
 *
 * The sums keep SUM_STEPS steps of the output row in registers while they run over the pairs,
 * instead of reading and writing the output row once per pair, and prefetch the row
 * PREFETCH_PAIRS pairs ahead. Each column is still summed in pair order with separate
 * multiplies and adds (the build's -ffp-contract=off fuses no FMA), so the results are the
 * bits of the column-at-a-time loops they replaced. The dot products read x's step once for
 * DOT_GROUP rows and prefetch the next group's rows. At PKM's shapes (2,048 tokens x 128
 * pairs into 3,844 rows of 256, bf16, 2 AVX-512 cores) this took gather_dot from 3.4 to 2.0
 * ms, gather_sum from 3.1 to 1.6 and scatter_rows (with its sort on both threads) from 4.5 to
 * 2.8.
 */
#if defined(__AVX512F__)
#define VECTOR_BYTES 64
#elif defined(__AVX__)
#define VECTOR_BYTES 32
#else
#define VECTOR_BYTES 16
#endif
typedef float vf __attribute__((vector_size(VECTOR_BYTES)));
typedef float vf_in __attribute__((vector_size(VECTOR_BYTES), aligned(4), may_alias));
typedef uint32_t vu __attribute__((vector_size(VECTOR_BYTES)));
typedef uint32_t vu_in __attribute__((vector_size(VECTOR_BYTES), aligned(2), may_alias));
#define LANES (VECTOR_BYTES / 4)
#define STEP (2 * LANES)
#define SUM_STEPS 4     /* 8 accumulators: 16 vector registers suffice */
#define DOT_GROUP 4
#define PREFETCH_PAIRS 4
#define CACHE_LINE 64

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#define BF16_EVEN(u) ((u) & 0xffff0000u)
#define BF16_ODD(u) ((u) << 16)
#else
#define BF16_EVEN(u) ((u) << 16)
#define BF16_ODD(u) ((u) & 0xffff0000u)
#endif

/* Columns c .. c + STEP of a float32 (bf = 0) or bf16 row as two vf, see above. */
static inline void load_step(const void *row, int bf, int64_t c, vf *a, vf *b) {
    if (bf) {
        const vu u = *(const vu_in *)((const bf16 *)row + c);
        *a = (vf)BF16_EVEN(u);
        *b = (vf)BF16_ODD(u);
    } else {
        *a = *(const vf_in *)((const float *)row + c);
        *b = *(const vf_in *)((const float *)row + c + LANES);
    }
}

/* Write a step's two vf to out[c .. c + STEP) in column order. */
static inline void store_step(float *out, int bf, int64_t c, vf a, vf b) {
    if (bf) {
        for (int l = 0; l < LANES; l++) {
            out[c + 2 * l] = a[l];
            out[c + 2 * l + 1] = b[l];
        }
    } else {
        *(vf_in *)(out + c) = a;
        *(vf_in *)(out + c + LANES) = b;
    }
}

static inline float element(const void *row, int bf, int64_t c) {
    return bf ? bf16_to_f32(((const bf16 *)row)[c]) : ((const float *)row)[c];
}

static inline void prefetch_span(const char *p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += CACHE_LINE) __builtin_prefetch(p + b);
}

/* The pairs summed into one output row: the q-th (0 <= q < n) is pair p = pick[q] (q where
 * pick is NULL); it reads row rows[p] (p / div where rows is NULL) with weight w[p]. */
struct pair_list {
    const int64_t *pick, *rows;
    int64_t div;
    const float *w;
    int64_t n;
};

static inline int64_t list_row(const struct pair_list *L, int64_t q) {
    const int64_t p = L->pick ? L->pick[q] : q;
    return L->rows ? L->rows[p] : p / L->div;
}

static inline float list_weight(const struct pair_list *L, int64_t q) {
    return L->w[L->pick ? L->pick[q] : q];
}

/* out[c0 .. c0 + steps * STEP) = sum_q w_q * row_q, steps <= SUM_STEPS, in registers.
 *
 * With a table row `trow` (not NULL), also the lanes of each pair's dot product with trow over
 * the same columns, added into part[q * LANES ..] (stored where `first`): each row step that
 * the sum loads is multiplied by trow's step too, so no row is read twice (sf_scatter_rows_dot).
 * trow's steps are read again for each pair, from L1 (held in registers, they spilled the
 * accumulators on AVX2's 16: 1.1x slower at PKM's shapes). The sum's arithmetic is the same
 * either way: the same bits. Both callers inline this with trow a constant NULL or not, so
 * the plain sum keeps no dot code in its loop. */
static inline __attribute__((always_inline)) void sum_steps(
        const struct pair_list *L, const void *base, int64_t ld, const void *trow, int bf,
        int64_t c0, int steps, int first, float *out, float *part) {
    const size_t size = bf ? sizeof(bf16) : sizeof(float);
    vf acc[2 * SUM_STEPS];
    for (int s = 0; s < 2 * SUM_STEPS; s++) acc[s] = (vf){0};
    for (int64_t q = 0; q < L->n; q++) {
        const vf w = (vf){0} + list_weight(L, q);
        const char *row = (const char *)base + list_row(L, q) * ld * size;
        if (q + PREFETCH_PAIRS < L->n)
            prefetch_span((const char *)base + (list_row(L, q + PREFETCH_PAIRS) * ld + c0) * size,
                          steps * STEP * (int64_t)size);
        vf da = (vf){0}, db = (vf){0};
        for (int s = 0; s < SUM_STEPS && s < steps; s++) {
            vf a, b;
            load_step(row, bf, c0 + s * STEP, &a, &b);
            acc[2 * s] += w * a;
            acc[2 * s + 1] += w * b;
            if (trow) {
                vf ta, tb;
                load_step(trow, bf, c0 + s * STEP, &ta, &tb);
                da += a * ta;
                db += b * tb;
            }
        }
        if (trow) {
            vf_in *lanes = (vf_in *)(part + q * LANES);
            if (first)
                *lanes = da + db;
            else
                *lanes += da + db;
        }
    }
    for (int s = 0; s < SUM_STEPS && s < steps; s++)
        store_step(out, bf, c0 + s * STEP, acc[2 * s], acc[2 * s + 1]);
}

/* out[0 .. d) = sum_q w_q * row_q in float32, each column summed in pair order.
 *
 * With a table row `trow` (not NULL; the list has `pick`), also dots[pick[q]] = <row_q, trow>
 * over all d columns: summed block by block in the lanes of part[0 .. n * LANES) (the list's
 * order: the blocks' passes read and write it in sequence), added up and written to dots once. */
static inline __attribute__((always_inline)) void sum_rows(
        const struct pair_list *L, const void *base, int64_t ld, const void *trow, int bf,
        int64_t d, float *out, float *part, float *dots) {
    int64_t c = 0;
    for (; c + SUM_STEPS * STEP <= d; c += SUM_STEPS * STEP)
        sum_steps(L, base, ld, trow, bf, c, SUM_STEPS, c == 0, out, part);
    for (; c + STEP <= d; c += STEP) sum_steps(L, base, ld, trow, bf, c, 1, c == 0, out, part);
    if (c == d && !trow) return;
    const int64_t tail = c;                             /* the last d % STEP columns */
    for (c = tail; c < d; c++) out[c] = 0.0f;
    for (int64_t q = 0; q < L->n; q++) {
        const float w = list_weight(L, q);
        const char *row = (const char *)base + list_row(L, q) * ld * (bf ? sizeof(bf16)
                                                                          : sizeof(float));
        float dot = 0.0f;
        for (c = tail; c < d; c++) {
            const float e = element(row, bf, c);
            out[c] += w * e;
            if (trow) dot += e * element(trow, bf, c);
        }
        if (!trow) continue;
        if (tail > 0)
            for (int l = 0; l < LANES; l++) dot += part[q * LANES + l];
        dots[L->pick[q]] = dot;
    }
}

/* A thread's float32 row of d columns (at least one) when `bf` is set, else NULL: where a bf16
 * kernel splits x or sums a row in float32 before it rounds once. NULL with `bf` set means
 * malloc failed; each caller turns that into its error flag. */
static float *float_row_if(int bf, int64_t d) {
    return bf ? malloc((size_t)(d > 0 ? d : 1) * sizeof(float)) : NULL;
}

/* x as the dot products' steps read it: split into the even and odd columns of each step for a
 * bf16 table (its steps are read so), as it is for a float32 one. */
static void split_steps(const float *x, int64_t d, float *xs) {
    int64_t c = 0;
    for (; c + STEP <= d; c += STEP)
        for (int l = 0; l < LANES; l++) {
            xs[c + l] = x[c + 2 * l];
            xs[c + LANES + l] = x[c + 2 * l + 1];
        }
    for (; c < d; c++) xs[c] = x[c];
}

/* out[j] = <x, table[ids[j]]> for j < g <= DOT_GROUP: x's steps are read once for the group.
 * xs is x as split_steps leaves it (x itself for a float32 table); the rows of next[0 ..
 * DOT_GROUP), if not NULL, are prefetched step by step. */
static inline void dot_group(const float *x, const float *xs, const void *table, int64_t ldt,
                             int bf, const int64_t *ids, int g, const int64_t *next, int64_t d,
                             float *out) {
    const size_t size = bf ? sizeof(bf16) : sizeof(float);
    const char *row[DOT_GROUP];
    vf acc[2 * DOT_GROUP];
    for (int j = 0; j < DOT_GROUP && j < g; j++) {
        row[j] = (const char *)table + ids[j] * ldt * size;
        acc[2 * j] = acc[2 * j + 1] = (vf){0};
    }
    int64_t c = 0;
    for (; c + STEP <= d; c += STEP) {
        const vf xa = *(const vf_in *)(xs + c), xb = *(const vf_in *)(xs + c + LANES);
        if (next)
            for (int j = 0; j < DOT_GROUP; j++)
                prefetch_span((const char *)table + (next[j] * ldt + c) * size, STEP * size);
        for (int j = 0; j < DOT_GROUP && j < g; j++) {
            vf a, b;
            load_step(row[j], bf, c, &a, &b);
            acc[2 * j] += xa * a;
            acc[2 * j + 1] += xb * b;
        }
    }
    for (int j = 0; j < DOT_GROUP && j < g; j++) {
        const vf both = acc[2 * j] + acc[2 * j + 1];
        float s = 0.0f;
        for (int l = 0; l < LANES; l++) s += both[l];
        for (int64_t cc = c; cc < d; cc++) s += x[cc] * element(row[j], bf, cc);
        out[j] = s;
    }
}

int sf_gather_dot(const float *x, int64_t ldx, const void *table, int64_t ldt, int bf,
                  const int64_t *idx, int64_t rows, int64_t m, int64_t d, float *out,
                  int nthreads) {
    int failed = 0;
    #pragma omp parallel num_threads(nthreads) reduction(|:failed)
    {
        float *split = float_row_if(bf, d);
        failed = bf && !split;
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < rows; t++) {
            if (failed) continue;
            const float *xt = x + t * ldx, *xs = xt;
            if (bf) {
                split_steps(xt, d, split);
                xs = split;
            }
            const int64_t *it = idx + t * m;
            int64_t j = 0;
            for (; j + DOT_GROUP <= m; j += DOT_GROUP)
                dot_group(xt, xs, table, ldt, bf, it + j, DOT_GROUP,
                          j + 2 * DOT_GROUP <= m ? it + j + DOT_GROUP : NULL, d, out + t * m + j);
            for (; j < m; j++)
                dot_group(xt, xs, table, ldt, bf, it + j, 1, NULL, d, out + t * m + j);
        }
        free(split);
    }
    return failed;
}

int sf_gather_sum(const int64_t *idx, const float *w, int64_t rows, int64_t m,
                  const void *table, int64_t ldt, int bf, int64_t d, void *out, int64_t ldo,
                  int nthreads) {
    int failed = 0;
    #pragma omp parallel num_threads(nthreads) reduction(|:failed)
    {
        /* bf16: a float32 row per thread, rounded once into out */
        float *acc = float_row_if(bf, d);
        failed = bf && !acc;
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < rows; t++) {
            if (failed) continue;
            const struct pair_list pairs = {NULL, idx + t * m, 1, w + t * m, m};
            float *o = bf ? acc : (float *)out + t * ldo;
            sum_rows(&pairs, table, ldt, NULL, bf, d, o, NULL, NULL);
            if (bf) round_row_to_bf16(acc, (bf16 *)out + t * ldo, d);
        }
        free(acc);
    }
    return failed;
}

/* Stable counting sort of the pairs by table row: offsets[N + 1], order[pairs] (each row's
 * pairs in pair order). Threads count and then place contiguous chunks of the pairs, a
 * thread's pairs of a row after those of the chunks before it, so the order is the one-thread
 * sort's. A count per thread and row is only worth it where rows get several pairs each. */
static int group_pairs(const int64_t *idx, int64_t pairs, int64_t n_rows, int nthreads,
                       int64_t **offsets_out, int64_t **order_out) {
    int64_t per_row = n_rows > 0 ? pairs / (2 * n_rows) : 0;
    int teams = nthreads < per_row ? nthreads : (int)per_row;
    if (teams < 1 || pairs < 4096) teams = 1;
    int64_t *offsets = calloc((size_t)n_rows + 1, sizeof(int64_t));
    int64_t *order = malloc((size_t)(pairs > 0 ? pairs : 1) * sizeof(int64_t));
    int64_t *fill = calloc((size_t)teams * (size_t)n_rows + 1, sizeof(int64_t));
    if (!offsets || !order || !fill) {
        free(offsets);
        free(order);
        free(fill);
        return 1;
    }
    #pragma omp parallel num_threads(teams)
    {
        const int th = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t lo = pairs * th / nt, hi = pairs * (th + 1) / nt;
        int64_t *mine = fill + (size_t)th * (size_t)n_rows;
        for (int64_t p = lo; p < hi; p++) mine[idx[p]]++;
        #pragma omp barrier
        #pragma omp single
        {
            int64_t at = 0;
            for (int64_t i = 0; i < n_rows; i++) {
                for (int u = 0; u < nt; u++) {
                    const int64_t count = fill[(size_t)u * (size_t)n_rows + i];
                    fill[(size_t)u * (size_t)n_rows + i] = at;
                    at += count;
                }
                offsets[i + 1] = at;
            }
        }   /* the implied barrier */
        for (int64_t p = lo; p < hi; p++) order[mine[idx[p]]++] = p;
    }
    free(fill);
    *offsets_out = offsets;
    *order_out = order;
    return 0;
}

int sf_scatter_rows(const int64_t *idx, const float *w, int64_t rows, int64_t m,
                    const void *src, int64_t lds, int64_t n_rows, int64_t d, void *out, int bf,
                    int nthreads) {
    int64_t *offsets, *order;
    if (group_pairs(idx, rows * m, n_rows, nthreads, &offsets, &order)) return 1;
    int failed = 0;
    /* Every output row is written exactly once (zeros included), by the thread that owns it. */
    #pragma omp parallel num_threads(nthreads) reduction(|:failed)
    {
        float *acc = float_row_if(bf, d);
        failed = bf && !acc;
        #pragma omp for schedule(dynamic, 256)
        for (int64_t i = 0; i < n_rows; i++) {
            if (failed) continue;
            const struct pair_list pairs = {order + offsets[i], NULL, m, w,
                                            offsets[i + 1] - offsets[i]};
            float *o = bf ? acc : (float *)out + i * d;
            sum_rows(&pairs, src, lds, NULL, bf, d, o, NULL, NULL);
            if (bf) round_row_to_bf16(acc, (bf16 *)out + i * d, d);
        }
        free(acc);
    }
    free(offsets);
    free(order);
    return failed;
}

/* sf_scatter_rows, and dots[t * m + j] = <src[t], table[idx[t, j]]> for every pair (the
 * gradient of sf_gather_sum's weights, where src is its output's gradient): the pair's src
 * row, read for the row sum, gives the dot too, and the thread that owns table row i reads
 * it once for all of the row's pairs. src and table are both float32 or both bf16 (`bf`);
 * dots are float32. */
int sf_scatter_rows_dot(const int64_t *idx, const float *w, int64_t rows, int64_t m,
                        const void *src, int64_t lds, const void *table, int64_t ldt,
                        int64_t n_rows, int64_t d, void *out, float *dots, int bf,
                        int nthreads) {
    int64_t *offsets, *order;
    if (group_pairs(idx, rows * m, n_rows, nthreads, &offsets, &order)) return 1;
    const size_t size = bf ? sizeof(bf16) : sizeof(float);
    int failed = 0;
    #pragma omp parallel num_threads(nthreads) reduction(|:failed)
    {
        float *acc = float_row_if(bf, d);
        float *part = NULL;                     /* a row's partial dots, LANES a pair, grown */
        int64_t room = 0;
        failed = bf && !acc;
        #pragma omp for schedule(dynamic, 256)
        for (int64_t i = 0; i < n_rows; i++) {
            if (failed) continue;
            const struct pair_list pairs = {order + offsets[i], NULL, m, w,
                                            offsets[i + 1] - offsets[i]};
            if (pairs.n > room) {
                free(part);
                room = 2 * pairs.n;
                part = malloc((size_t)room * LANES * sizeof(float));
                if (!part) {
                    failed = 1;
                    room = 0;
                    continue;
                }
            }
            float *o = bf ? acc : (float *)out + i * d;
            sum_rows(&pairs, src, lds, (const char *)table + i * ldt * size, bf, d, o, part,
                     dots);
            if (bf) round_row_to_bf16(acc, (bf16 *)out + i * d, d);
        }
        free(acc);
        free(part);
    }
    free(offsets);
    free(order);
    return failed;
}

/* Insert (v, i) into vals/ids[0..*count) kept sorted by (value desc, index asc), capacity k. */
static inline void insert_ordered(float *vals, int64_t *ids, int64_t *count, int64_t k, float v,
                                  int64_t i) {
    int64_t pos = *count < k ? *count : k - 1;
    while (pos > 0 && (vals[pos - 1] < v || (vals[pos - 1] == v && ids[pos - 1] > i))) {
        vals[pos] = vals[pos - 1];
        ids[pos] = ids[pos - 1];
        pos--;
    }
    vals[pos] = v;
    ids[pos] = i;
    if (*count < k) (*count)++;
}

/* Top k of one row scanned in index order: a later element enters only when strictly larger
 * than the current k-th (an equal one has a higher index and loses the tie). */
static void topk_row_scan(const float *s, int64_t n, int64_t k, float *vals, int64_t *ids) {
    int64_t count = 0;
    for (int64_t c = 0; c < n; c++)
        if (count < k || s[c] > vals[k - 1]) insert_ordered(vals, ids, &count, k, s[c], c);
}

#define RANK_ROW_MAX 128
#define RANK_BLOCK 16

/* Ranks of a short row (n <= RANK_ROW_MAX) in the order (value desc, index asc): element c
 * is preceded by the earlier elements >= it and the later ones > it. RANK_BLOCK elements c
 * at a time in vector lanes, with no branch. */
static void ranks_with_ties(const float *row, int64_t n, int *rank) {
    for (int64_t b = 0; b < n; b += RANK_BLOCK) {
        const float *c = row + b;
        int r[RANK_BLOCK] = {0};
        const int64_t block_end = b + RANK_BLOCK < n ? b + RANK_BLOCK : n;
        for (int64_t j = 0; j < b; j++) {              /* earlier than every lane */
            const float w = row[j];
            #pragma omp simd
            for (int l = 0; l < RANK_BLOCK; l++) r[l] += w >= c[l];
        }
        for (int64_t j = b; j < block_end; j++) {      /* within the block */
            const float w = row[j];
            #pragma omp simd
            for (int l = 0; l < RANK_BLOCK; l++) r[l] += (w > c[l]) | ((w == c[l]) & (j < b + l));
        }
        for (int64_t j = block_end; j < n; j++) {      /* later than every lane */
            const float w = row[j];
            #pragma omp simd
            for (int l = 0; l < RANK_BLOCK; l++) r[l] += w > c[l];
        }
        memcpy(rank + b, r, sizeof r);
    }
}

/* rank[c] = the number of elements of row larger than row[c], for c < n; row holds whole
 * RANK_BLOCKs (the lanes past n are compared, their counts unused). RANK_BLOCK elements c at
 * a time in vector lanes, one comparison per pair, no branch. These counts are the ranks in
 * the order (value desc, index asc) exactly when no two values are equal; then they add up
 * to n(n-1)/2, and each equal pair makes the sum one less. Returns whether no two values are
 * equal. */
static int count_larger(const float *row, int64_t n, int *rank) {
    for (int64_t b = 0; b < n; b += RANK_BLOCK) {
        const float *c = row + b;
        int r[RANK_BLOCK] = {0};
        for (int64_t j = 0; j < n; j++) {
            const float w = row[j];
            #pragma omp simd
            for (int l = 0; l < RANK_BLOCK; l++) r[l] += w > c[l];
        }
        memcpy(rank + b, r, sizeof r);
    }
    int64_t rank_sum = 0;
    #pragma omp simd reduction(+:rank_sum)
    for (int64_t c = 0; c < n; c++) rank_sum += rank[c];
    return rank_sum == n * (n - 1) / 2;
}

/* The top k of a short row (n <= RANK_ROW_MAX) by counting ranks, with ties ordered by index
 * only when the row has any. The ranks are a permutation of 0..n-1, so each element goes
 * straight to its slot. The scan's inserts branch unpredictably and took twice the time at
 * n 62, k 32. NaN has no rank: a row holding one is left to the scan (returns 0). */
static int topk_row_ranks(const float *s, int64_t n, int64_t k, float *vals, int64_t *ids) {
    float row[RANK_ROW_MAX] = {0};       /* whole blocks; lanes past n are computed, unused */
    int rank[RANK_ROW_MAX];
    int nan = 0;
    #pragma omp simd reduction(|:nan)
    for (int64_t c = 0; c < n; c++) {
        row[c] = s[c];
        nan |= s[c] != s[c];
    }
    if (nan) return 0;
    if (!count_larger(row, n, rank)) ranks_with_ties(row, n, rank);
    /* the whole permutation without a branch (whether rank < k is a coin toss), then the
     * first k */
    float sorted_vals[RANK_ROW_MAX];
    int64_t sorted_ids[RANK_ROW_MAX];
    for (int64_t c = 0; c < n; c++) {
        sorted_vals[rank[c]] = row[c];
        sorted_ids[rank[c]] = c;
    }
    memcpy(vals, sorted_vals, (size_t)k * sizeof(float));
    memcpy(ids, sorted_ids, (size_t)k * sizeof(int64_t));
    return 1;
}

/* The top-k's block of interleaved groups: a fixed 16, whatever the vector width. */
#define TOPK_BLOCK 16

/* The same result, faster on long rows: a first vectorised pass takes the maximum of each of
 * G >= k interleaved groups (lane g of every G-wide block); at least k elements (one per
 * group) are >= the smallest of these maxima, so the k-th largest is too, and the second
 * pass inserts only elements >= that threshold, still in index order. */
static void topk_row(const float *s, int64_t n, int64_t k, float *vals, int64_t *ids) {
    if (n <= RANK_ROW_MAX && topk_row_ranks(s, n, k, vals, ids)) return;
    const int64_t groups = TOPK_BLOCK * ((k + TOPK_BLOCK - 1) / TOPK_BLOCK);
    if (groups > 256 || n < 4 * groups) {
        topk_row_scan(s, n, k, vals, ids);
        return;
    }
    float group_max[256];
    const int64_t full = (n / groups) * groups;
    memcpy(group_max, s, (size_t)groups * sizeof(float));
    for (int64_t b = groups; b < full; b += groups) {
        #pragma omp simd
        for (int64_t g = 0; g < groups; g++)
            group_max[g] = s[b + g] > group_max[g] ? s[b + g] : group_max[g];
    }
    float thr = group_max[0];
    for (int64_t g = 1; g < groups; g++) thr = group_max[g] < thr ? group_max[g] : thr;
    int64_t count = 0;
    for (int64_t c = 0; c < full; c += TOPK_BLOCK) {
        uint32_t mask = 0;
        #pragma omp simd reduction(|:mask)
        for (int j = 0; j < TOPK_BLOCK; j++) mask |= (uint32_t)(s[c + j] >= thr) << j;
        while (mask) {
            const int j = __builtin_ctz(mask);
            mask &= mask - 1;
            const float v = s[c + j];
            if (count < k || v > vals[k - 1]) insert_ordered(vals, ids, &count, k, v, c + j);
        }
    }
    for (int64_t c = full; c < n; c++)
        if (s[c] >= thr && (count < k || s[c] > vals[k - 1]))
            insert_ordered(vals, ids, &count, k, s[c], c);
}

int sf_topk_rows(const float *s, int64_t lds, int64_t rows, int64_t n, int64_t k,
                 float *out_vals, int64_t *out_idx, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        topk_row(s + r * lds, n, k, out_vals + r * k, out_idx + r * k);
    return 0;
}

/* A score as kernels.rankable maps it: NaN and -inf to -FLT_MAX/4, +inf to FLT_MAX/4, finite
 * scores clamped to that range (so that a sum of two cannot overflow). */
static inline float rankable(float v) {
    const float big = FLT_MAX / 4;
    return v != v ? -big : (v > big ? big : (v < -big ? -big : v));
}

#define MERGE_MAX 256

/* The product-key merge: the top k of the sums va[i] + vb[j] (i < ka, j < kb; va and vb
 * sorted descending, their sub-key indices ia and ib) by (sum desc, full index asc), full
 * index ia[i] + na * ib[j]. vals gets the sums of the original scores a[ia[i]] + b[ib[j]].
 *
 * By ranks: every sum of the corner i < x, j < ceil(k / x) (corner[x - 1]) is at least its last
 * (float addition is monotone), so the k-th largest sum is at least the largest such bound.
 * Only the sums at or above it are candidates, a prefix of each row; about 2k of the k² for
 * random scores. Their ranks are counted; returns 0 (and the inserts merge) when more than
 * MERGE_MAX sums are candidates or two are equal (their order needs the full indices). At
 * 8192 rows of 62 sub-keys, k 32, on 2 threads, the merge took 3.1 ms by inserts and takes
 * about 1.8 by ranks. */
static int merge_by_ranks(const float *va, const int64_t *ia, int64_t ka, const float *vb,
                          const int64_t *ib, int64_t kb, int64_t k, const int64_t *corner,
                          const float *a, const float *b, int64_t na, float *vals,
                          int64_t *ids) {
    float bound = va[ka - 1] + vb[kb - 1];
    for (int64_t x = 0; x < ka; x++) {
        const int64_t y = corner[x];
        if (y <= kb && va[x] + vb[y - 1] > bound) bound = va[x] + vb[y - 1];
    }
    float sums[MERGE_MAX];
    int rank[MERGE_MAX];
    int32_t pi[MERGE_MAX], pj[MERGE_MAX];
    int64_t m = 0;
    for (int64_t i = 0; i < ka && va[i] + vb[0] >= bound; i++) {
        int64_t len = 0;
        #pragma omp simd reduction(+:len)
        for (int64_t j = 0; j < kb; j++) len += va[i] + vb[j] >= bound;
        if (m + len > MERGE_MAX) return 0;
        for (int64_t j = 0; j < len; j++) {
            sums[m + j] = va[i] + vb[j];
            pi[m + j] = (int32_t)i;
            pj[m + j] = (int32_t)j;
        }
        m += len;
    }
    if (m < k) return 0;                  /* cannot happen (the bound's corner has k sums) */
    for (int64_t c = m; c % RANK_BLOCK; c++) sums[c] = 0;    /* the last block's spare lanes */
    if (!count_larger(sums, m, rank)) return 0;
    uint16_t by_rank[MERGE_MAX];      /* candidate of each rank: the permutation, no branch */
    for (int64_t c = 0; c < m; c++) by_rank[rank[c]] = (uint16_t)c;
    for (int64_t r = 0; r < k; r++) {
        const int64_t c = by_rank[r];
        vals[r] = a[ia[pi[c]]] + b[ib[pj[c]]];
        ids[r] = ia[pi[c]] + na * ib[pj[c]];
    }
    return 1;
}

/* The same merge by inserting the sums row by row into the sorted top k: a and b are sorted
 * descending and float addition is monotone, so once a sum falls strictly below the k-th,
 * the rest of the row (or column) cannot enter. */
static void merge_by_inserts(const float *va, const int64_t *ia, int64_t ka, const float *vb,
                             const int64_t *ib, int64_t kb, int64_t k, const float *a,
                             const float *b, int64_t na, float *vals, int64_t *ids) {
    int64_t count = 0;
    for (int64_t i = 0; i < ka; i++) {
        if (count == k && va[i] + vb[0] < vals[k - 1]) break;
        for (int64_t j = 0; j < kb; j++) {
            const float s = va[i] + vb[j];
            const int64_t full = ia[i] + na * ib[j];
            if (count == k && (s < vals[k - 1] ||
                               (s == vals[k - 1] && full > ids[k - 1]))) {
                if (s < vals[k - 1]) break;
                continue;
            }
            insert_ordered(vals, ids, &count, k, s, full);
        }
    }
    for (int64_t j = 0; j < k; j++)      /* the sums of the original scores */
        vals[j] = a[ids[j] % na] + b[ids[j] / na];
}

int sf_pk_topk(const float *sa, int64_t lda, const float *sb, int64_t ldb, int64_t rows,
               int64_t na, int64_t nb, int64_t k, float *out_vals, int64_t *out_idx,
               int nthreads) {
    const int64_t ka = k < na ? k : na, kb = k < nb ? k : nb;
    int64_t *corner = malloc((size_t)ka * sizeof(int64_t));     /* see merge_by_ranks */
    if (!corner) return 1;
    for (int64_t x = 1; x <= ka; x++) corner[x - 1] = (k + x - 1) / x;
    int failed = 0;
    #pragma omp parallel num_threads(nthreads) reduction(|:failed)
    {
        /* per thread: the two rows as ranked, then their top ka and kb */
        float *ra = malloc((size_t)(na + nb + ka + kb) * sizeof(float));
        int64_t *ia = malloc((size_t)(ka + kb) * sizeof(int64_t));
        failed = !ra || !ia;   /* every thread reaches the loop; one without buffers skips */
        {
            float *rb = ra ? ra + na : NULL, *va = ra ? ra + na + nb : NULL;
            float *vb = ra ? va + ka : NULL;
            int64_t *ib = ia ? ia + ka : NULL;
            #pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++) {
                if (failed) continue;
                const float *a = sa + r * lda, *b = sb + r * ldb;
                for (int64_t i = 0; i < na; i++) ra[i] = rankable(a[i]);
                for (int64_t j = 0; j < nb; j++) rb[j] = rankable(b[j]);
                topk_row(ra, na, ka, va, ia);
                topk_row(rb, nb, kb, vb, ib);
                float *vals = out_vals + r * k;
                int64_t *ids = out_idx + r * k;
                if (!merge_by_ranks(va, ia, ka, vb, ib, kb, k, corner, a, b, na, vals, ids))
                    merge_by_inserts(va, ia, ka, vb, ib, kb, k, a, b, na, vals, ids);
            }
        }
        free(ra);
        free(ia);
    }
    free(corner);
    return failed;
}
