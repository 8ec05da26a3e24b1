/* Fused CPU kernels for CVMM (Csordás et al. 2023 App. B.1): gather -> GEMM -> scatter without ever
 * materialising the [pairs, d_model] copies of the input or the output.
 *
 * Rows are sorted by expert: rows [off_e, off_e + count_e) belong to expert e. Work is split
 * into (expert, chunk of rows) items that OpenMP threads take dynamically. Each item gathers
 * its rows into a thread-private buffer small enough to stay in L2, multiplies it with one
 * single-threaded BLAS call, and writes or adds the result where it belongs.
 *
 * Plain C with no PyTorch headers: the BLAS routines (Fortran `sgemm_` and MKL's
 * `gemm_bf16bf16f32`, column-major) are the ones PyTorch itself links, handed over as function
 * pointers by sparseffn/ops/native. Matrices here are row-major; a row-major C = op(A) op(B)
 * is the column-major C^T = op(B)^T op(A)^T, which is how `gemm_rm` calls the Fortran routine.
 *
 * Element types: `bf` = 0 reads and writes float32; `bf` = 1 reads bfloat16 rows and matrices
 * (uint16 storage), multiplies them with a GEMM that accumulates in float32 (bf16_gemm.h's
 * AVX-512 BF16 kernel where the compiler targets that instruction and the CPU is AMD, else
 * MKL's bf16 GEMM), applies every epilogue in float32 and rounds once, to nearest even, where
 * it writes bf16. Scales and dots are float32 in both.
 *
 * Index arrays are int64 (torch.long). A NULL index means "row r reads/writes row r".
 * The matrix of expert e is passed as (base, stride between experts, leading dimension,
 * transposed): row-major [m, n] with row stride ld, or (transposed) the row-major [n, m]
 * whose transpose it is.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "bf16.h"
#include "bf16_gemm.h"

typedef void (*sgemm_fn)(const char *ta, const char *tb, const int *m, const int *n,
                         const int *k, const float *alpha, const float *a, const int *lda,
                         const float *b, const int *ldb, const float *beta, float *c,
                         const int *ldc);
/* MKL: C (float32) = alpha op(A) op(B) + beta C with A, B bfloat16, column-major */
typedef void (*gemm_bf16_fn)(const char *ta, const char *tb, const int *m, const int *n,
                             const int *k, const float *alpha, const bf16 *a, const int *lda,
                             const bf16 *b, const int *ldb, const float *beta, float *c,
                             const int *ldc);
typedef int (*set_threads_fn)(int);

static sgemm_fn g_sgemm = 0;
static gemm_bf16_fn g_gemm_bf16 = 0;
static set_threads_fn g_blas_threads_local = 0;

/* Whether the bf16 products take bf16_gemm.h's kernel rather than MKL's: built for AVX-512 BF16
 * and running on an AMD CPU, where MKL multiplies bf16 at its float32 speed. On Intel CPUs MKL
 * dispatches its own AVX-512 BF16 and AMX code, which this kernel does not beat. */
static int g_own_bf16 = 0;

void sf_init(void *sgemm, void *blas_threads_local, void *gemm_bf16) {
    g_sgemm = (sgemm_fn)sgemm;
    g_blas_threads_local = (set_threads_fn)blas_threads_local;
    g_gemm_bf16 = (gemm_bf16_fn)gemm_bf16;
#ifdef SF_HAVE_BF16_GEMM
    __builtin_cpu_init();
    g_own_bf16 = __builtin_cpu_is("amd");
#endif
}

/* 1 where the bf16 products take bf16_gemm.h's kernel, for the tests and benchmarks */
int sf_own_bf16_gemm(void) { return g_own_bf16; }

static inline size_t elem(int bf) { return bf ? sizeof(bf16) : sizeof(float); }

/* A row-major matrix operand: element (i, j) of op(M) is at p[i * ld + j] unless trans; p
 * points at float32 or bf16 elements. */
typedef struct { const void *p; int ld; int trans; } operand;

static const void *offset(const void *base, int64_t elements, int bf) {
    return (const char *)base + elements * (int64_t)elem(bf);
}

static operand expert_matrix(const void *base, int64_t se, int ld, int trans, int e, int bf) {
    operand o = { offset(base, (int64_t)e * se, bf), ld, trans };
    return o;
}

/* Row-major float32 C[M, N] = alpha * op(A)[M, K] @ op(B)[K, N] + beta * C, with A and B of
 * element type bf. `reuse`: 0, or a number of this kernel call's own, under which bf16_gemm
 * keeps B packed between products (B must not change during the call). */
static void gemm_rm(int bf, int M, int N, int K, float alpha, operand A, operand B, float beta,
                    float *C, int ldc, uint64_t reuse) {
    if (M <= 0 || N <= 0) return;
    if (K <= 0) {   /* BLAS may skip beta scaling for K = 0; do it here */
        for (int i = 0; i < M; i++) {
            float *c = C + (int64_t)i * ldc;
            if (beta == 0.0f) memset(c, 0, sizeof(float) * N);
            else for (int j = 0; j < N; j++) c[j] *= beta;
        }
        return;
    }
#ifdef SF_HAVE_BF16_GEMM
    if (bf && g_own_bf16) {
        bf16_matrix a = { (const bf16 *)A.p, A.ld, A.trans };
        bf16_matrix b = { (const bf16 *)B.p, B.ld, B.trans };
        if (bf16_gemm(M, N, K, alpha, a, b, beta, C, ldc, reuse) == 0) return;
    }
#endif
    (void)reuse;
    const char tb = B.trans ? 'T' : 'N', ta = A.trans ? 'T' : 'N';
    if (bf)
        g_gemm_bf16(&tb, &ta, &N, &M, &K, &alpha, (const bf16 *)B.p, &B.ld, (const bf16 *)A.p,
                    &A.ld, &beta, C, &ldc);
    else
        g_sgemm(&tb, &ta, &N, &M, &K, &alpha, (const float *)B.p, &B.ld, (const float *)A.p,
                &A.ld, &beta, C, &ldc);
}

typedef struct { int64_t start; int rows; int expert; } item;

/* The number of pieces of at most `chunk` rows that `rows` rows are cut into */
static int64_t pieces_of(int64_t rows, int chunk) { return (rows + chunk - 1) / chunk; }

/* Split each block of rows into chunks of at most `chunk` rows, in row order (threads take
 * them one at a time, so uneven experts still balance). counts[b] is the size of block b, the
 * blocks lie one after the other, and block b belongs to expert b % E. With `first` given
 * ([blocks / E + 1]), first[j] is the first item of blocks j E .. j E + E - 1 and the last
 * entry the item count. Returns the count; caller frees. */
static int make_items(const int64_t *counts, int blocks, int E, int chunk, item **out,
                      int *first) {
    int64_t n = 0;
    for (int b = 0; b < blocks; b++) n += pieces_of(counts[b], chunk);
    item *items = (item *)malloc(sizeof(item) * (n ? n : 1));
    if (!items) { *out = 0; return -1; }
    int64_t start = 0, i = 0;
    if (first) first[0] = 0;
    for (int b = 0; b < blocks; b++) {
        if (first && b % E == 0) first[b / E] = (int)i;
        /* pieces of equal size (within a row): no short last piece of a few rows */
        int64_t pieces = pieces_of(counts[b], chunk), r = 0;
        for (int64_t q = 0; q < pieces; q++) {
            int64_t rows = counts[b] / pieces + (q < counts[b] % pieces);
            items[i].start = start + r; items[i].rows = (int)rows; items[i].expert = b % E; i++;
            r += rows;
        }
        start += counts[b];
    }
    if (first && E) first[blocks / E] = (int)n;
    *out = items;
    return (int)n;
}

/* The sorted rows of a scatter regrouped by pass: pass j holds the rows whose slot is j modulo
 * `group` (at most one row per output row when the slots are distinct). On return order[] lists
 * the rows pass by pass, within a pass expert by expert, within an expert in sorted order, and
 * block_counts[j * E + e] counts the rows of expert e in pass j (order NULL: only the counts
 * and the range check). Returns 0, -3 when out of memory, -4 when a slot is outside
 * [0, out_rows * group). */
static int pass_order(const int64_t *counts, int E, const int64_t *slots, int group,
                      int64_t out_rows, int64_t *order, int64_t *block_counts) {
    int64_t blocks = (int64_t)group * E, rows = 0, limit = out_rows * group;
    int64_t *cursor = (int64_t *)calloc(blocks ? blocks : 1, sizeof(int64_t));
    if (!cursor) return -3;
    memset(block_counts, 0, sizeof(int64_t) * blocks);
    for (int e = 0; e < E; e++) {
        for (int64_t r = rows; r < rows + counts[e]; r++) {
            if (slots[r] < 0 || slots[r] >= limit) { free(cursor); return -4; }
            block_counts[(slots[r] % group) * E + e]++;
        }
        rows += counts[e];
    }
    if (!order) { free(cursor); return 0; }
    for (int64_t b = 1; b < blocks; b++) cursor[b] = cursor[b - 1] + block_counts[b - 1];
    rows = 0;
    for (int e = 0; e < E; e++) {
        for (int64_t r = rows; r < rows + counts[e]; r++)
            order[cursor[(slots[r] % group) * E + e]++] = r;
        rows += counts[e];
    }
    free(cursor);
    return 0;
}

/* Copy rows [start, start + rows) of the item into dst: sorted row q = order[start + r] (or
 * start + r without order) reads src row idx[q] (or q without idx). */
static void gather_rows(void *dst, const void *src, int64_t src_ld, const int64_t *idx,
                        const int64_t *order, int64_t start, int rows, int width, int bf) {
    for (int r = 0; r < rows; r++) {
        int64_t q = order ? order[start + r] : start + r;
        int64_t s = idx ? idx[q] : q;
        memcpy((char *)dst + (int64_t)r * width * elem(bf), offset(src, s * src_ld, bf),
               elem(bf) * width);
    }
}

/* Each thread's BLAS call runs single-threaded (the threads already split the work). The
 * setting is per thread and the calling thread is one of them, so it is restored after. */
#define THREAD_SETUP() int blas_prev = g_blas_threads_local ? g_blas_threads_local(1) : 0
#define THREAD_DONE() do { if (g_blas_threads_local) g_blas_threads_local(blas_prev); } while (0)

/* One CVMM over expert-sorted rows r (Csordás et al. 2023 Eq. 40):
 *
 *   z_r = src[in_idx[r], :] @ W[e(r)],   y_r = scale[r] * z_r      src: [*, m], W[e]: [m, n]
 *
 * With out_idx NULL, y_r is written to out[r] (out: [P, n], element type bf). Otherwise
 * out_idx holds distinct slots s_r < out_rows * group, out is float32 [out_rows, n] whatever
 * bf is, and out[i] is the sum of the y_r with s_r / group = i, added in slot order (fully
 * overwritten: rows no pair lands on are zero).
 * The k pairs of one token belong to different experts and threads, so the rows run in
 * `group` passes, pass j taking the slots j modulo group: within a pass each output row
 * receives at most one row, stored by the first pass that reaches it and added by later ones.
 * No locks, and the same sum for any thread count and schedule.
 * If dot_with is given ([P, n], sorted, element type bf), dots[r] = <z_r, dot_with[r]> in
 * float32 (the gate gradient <dy W^T, x>). in_idx NULL reads src row r; scale NULL means 1.
 * Epilogues on y (sorted output only): relu != 0 applies max(y, 0); mask_with ([P, n], type
 * bf) zeroes y where mask_with <= 0 (the ReLU derivative, given the ReLU's output).
 * Returns -4 when a slot is out of range or group < 1 (nothing written). */
int sf_cvmm(const void *src, int64_t src_ld, const int64_t *in_idx,
            const void *w, int64_t wse, int w_ld, int w_trans,
            const int64_t *counts, int E, int m, int n,
            void *out, int64_t out_rows, const int64_t *out_idx, int group, const float *scale,
            const void *dot_with, float *dots, int relu, const void *mask_with,
            int bf, int nthreads, int chunk) {
    if (bf ? !g_gemm_bf16 : !g_sgemm) return -1;
    if (out_idx && (relu || mask_with)) return -2;
    if (group < 1) return -4;
    int passes = out_idx ? group : 1;
    /* A pass holds about 1/group of an expert's rows: pieces of up to twice the chunk keep its
     * products about as tall as a single pass's (fewer, taller GEMM calls) */
    if (passes > 1) chunk *= 2;
    int64_t rows_total = 0;
    for (int e = 0; e < E; e++) rows_total += counts[e];
    /* the scatter's rows regrouped by pass (order), and the rows of each (pass, expert) */
    int64_t *order = 0, *block_counts = 0;
    if (out_idx) {   /* one pass (group 1) runs the rows as sorted: no order */
        order = group > 1 ? (int64_t *)malloc(sizeof(int64_t) * (rows_total ? rows_total : 1))
                          : 0;
        block_counts = (int64_t *)malloc(sizeof(int64_t) * passes * (E ? E : 1));
        int status = (order || group == 1) && block_counts
            ? pass_order(counts, E, out_idx, group, out_rows, order, block_counts) : -3;
        if (status) { free(order); free(block_counts); return status; }
    }
    /* pass j runs items [pass_first[j], pass_first[j + 1]) (all zero without experts) */
    int *pass_first = (int *)calloc(passes + 1, sizeof(int));
    item *items = 0;
    int n_items = pass_first ? make_items(out_idx ? block_counts : counts, passes * E, E, chunk,
                                          &items, pass_first) : -1;
    /* written[i] says whether out row i holds a value yet */
    char *written = out_idx ? (char *)calloc(out_rows ? out_rows : 1, 1) : 0;
    if (n_items < 0 || (out_idx && !written)) {
        free(order); free(block_counts); free(items); free(pass_first); free(written);
        return -3;
    }
    /* the float32 products go to a buffer before a scatter or a rounding to bf16 */
    int rounded = bf && !out_idx, buffered = out_idx || rounded;
    int gathered = in_idx || order;
    int failed = 0;
    /* the expert weights stay as they are during the call: each thread packs one once */
    static uint64_t calls = 0;
    uint64_t reuse = __atomic_add_fetch(&calls, 1, __ATOMIC_RELAXED);
    #pragma omp parallel num_threads(nthreads)
    {
        THREAD_SETUP();
        void *in_buf = gathered ? malloc(elem(bf) * (int64_t)chunk * m) : 0;
        float *c_buf = buffered ? (float *)malloc(sizeof(float) * (int64_t)chunk * n) : 0;
        if ((gathered && !in_buf) || (buffered && !c_buf)) {
            #pragma omp atomic write
            failed = 1;
        }
        for (int j = 0; j < passes; j++) {
            /* the loop's implicit barrier ends each pass before the next adds to its rows */
            #pragma omp for schedule(dynamic, 1)
            for (int i = pass_first[j]; i < pass_first[j + 1]; i++) {
                if (failed) continue;
                item it = items[i];
                operand A;
                if (gathered) {
                    gather_rows(in_buf, src, src_ld, in_idx, order, it.start, it.rows, m, bf);
                    A.p = in_buf; A.ld = m;
                }
                else { A.p = offset(src, it.start * src_ld, bf); A.ld = (int)src_ld; }
                A.trans = 0;
                float *C = buffered ? c_buf : (float *)out + it.start * n;
                gemm_rm(bf, it.rows, n, m, 1.0f, A,
                        expert_matrix(w, wse, w_ld, w_trans, it.expert, bf), 0.0f, C, n,
                        reuse);
                for (int r = 0; r < it.rows; r++) {
                    int64_t p = order ? order[it.start + r] : it.start + r;
                    float s = scale ? scale[p] : 1.0f;
                    float *c = C + (int64_t)r * n;
                    if (dot_with) {
                        float acc = 0.0f;
                        if (bf) {
                            const bf16 *d = (const bf16 *)dot_with + p * n;
                            for (int q = 0; q < n; q++) acc += c[q] * bf16_to_f32(d[q]);
                        } else {
                            const float *d = (const float *)dot_with + p * n;
                            for (int q = 0; q < n; q++) acc += c[q] * d[q];
                        }
                        dots[p] = acc;
                    }
                    if (!out_idx) {
                        if (scale) for (int q = 0; q < n; q++) c[q] *= s;
                        /* max(y, 0) that keeps NaN, as torch.relu does */
                        if (relu) for (int q = 0; q < n; q++) c[q] = c[q] <= 0.0f ? 0.0f : c[q];
                        if (mask_with && bf) {
                            const bf16 *mk = (const bf16 *)mask_with + p * n;
                            for (int q = 0; q < n; q++)
                                c[q] = bf16_to_f32(mk[q]) > 0.0f ? c[q] : 0.0f;
                        } else if (mask_with) {
                            const float *mk = (const float *)mask_with + p * n;
                            for (int q = 0; q < n; q++) c[q] = mk[q] > 0.0f ? c[q] : 0.0f;
                        }
                        if (rounded) round_row_to_bf16(c, (bf16 *)out + p * n, n);
                        continue;
                    }
                    int64_t dst = out_idx[p] / group;
                    float *o = (float *)out + dst * n;
                    if (written[dst]) for (int q = 0; q < n; q++) o[q] += s * c[q];
                    else { for (int q = 0; q < n; q++) o[q] = s * c[q]; written[dst] = 1; }
                }
            }
        }
        free(in_buf); free(c_buf);
        THREAD_DONE();
    }
    if (out_idx && !failed)
        for (int64_t i = 0; i < out_rows; i++)
            if (!written[i]) memset((float *)out + i * n, 0, sizeof(float) * n);
    free(written);
    free(pass_first);
    free(items);
    free(order);
    free(block_counts);
    return failed ? -3 : 0;
}

/* out[e] = A_e^T @ B_e for every expert: A rows scale[r] * a_src[a_idx[r]] ([P, ma]), B rows
 * b_src[b_idx[r]] ([P, nb]), both of element type bf (a scaled bf16 row is rounded once);
 * out: float32 [E, ma, nb] contiguous, overwritten (zero for empty experts).
 *
 * The sum over an expert's rows is split into slabs of whole chunks, about WG_SLABS slabs for
 * the whole problem whatever the thread count. A slab that covers its whole expert accumulates
 * straight into out[e]; otherwise it accumulates into a buffer of its own, and the buffers of
 * an expert are added in slab order after the parallel loop. So the result is the same for any
 * thread count and any schedule (deterministic), at the cost of one [ma, nb] buffer per split
 * slab. Returns -3 when a buffer cannot be allocated. */
#define WG_SLABS 16
int sf_weight_grad(const void *a_src, int64_t a_ld, const int64_t *a_idx, const float *scale,
                   const void *b_src, int64_t b_ld, const int64_t *b_idx,
                   const int64_t *counts, int E, int ma, int nb, float *out,
                   int bf, int nthreads, int chunk) {
    if (bf ? !g_gemm_bf16 : !g_sgemm) return -1;
    int64_t mat = (int64_t)ma * nb, total = 0;
    for (int e = 0; e < E; e++) total += counts[e];
    int64_t slab = (total + WG_SLABS - 1) / WG_SLABS;
    slab = (slab + chunk - 1) / chunk * chunk;
    if (slab < chunk) slab = chunk;
    if (slab > (1 << 30)) slab = 1 << 30;
    item *items; int n_items = make_items(counts, E, E, (int)slab, &items, 0);
    if (n_items < 0) return -3;
    /* part_of[i]: the buffer of split item i (-1 for an item that is its expert's whole) */
    int *part_of = (int *)malloc(sizeof(int) * (n_items ? n_items : 1));
    if (!part_of) { free(items); return -3; }
    int n_parts = 0;
    for (int i = 0; i < n_items; i++)
        part_of[i] = counts[items[i].expert] > slab ? n_parts++ : -1;
    float *parts = n_parts ? (float *)malloc(sizeof(float) * mat * n_parts) : 0;
    if (n_parts && !parts) { free(part_of); free(items); return -3; }
    for (int e = 0; e < E; e++)
        if (counts[e] == 0) memset(out + e * mat, 0, sizeof(float) * mat);
    int failed = 0;
    #pragma omp parallel num_threads(nthreads)
    {
        THREAD_SETUP();
        void *abuf = (a_idx || scale) ? malloc(elem(bf) * (int64_t)chunk * ma) : 0;
        void *bbuf = b_idx ? malloc(elem(bf) * (int64_t)chunk * nb) : 0;
        if (((a_idx || scale) && !abuf) || (b_idx && !bbuf)) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < n_items; i++) {
            if (failed) continue;
            item it = items[i];
            float *acc = part_of[i] < 0 ? out + (int64_t)it.expert * mat
                                        : parts + (int64_t)part_of[i] * mat;
            for (int c = 0; c < it.rows; c += chunk) {
                int64_t start = it.start + c;
                int rows = it.rows - c < chunk ? it.rows - c : chunk;
                operand A, B;
                if (a_idx || scale) {
                    gather_rows(abuf, a_src, a_ld, a_idx, 0, start, rows, ma, bf);
                    if (scale)
                        for (int r = 0; r < rows; r++) {
                            float s = scale[start + r];
                            if (bf) {
                                bf16 *a = (bf16 *)abuf + (int64_t)r * ma;
                                for (int j = 0; j < ma; j++)
                                    a[j] = f32_to_bf16(bf16_to_f32(a[j]) * s);
                            } else {
                                float *a = (float *)abuf + (int64_t)r * ma;
                                for (int j = 0; j < ma; j++) a[j] *= s;
                            }
                        }
                    A.p = abuf; A.ld = ma;
                }
                else { A.p = offset(a_src, start * a_ld, bf); A.ld = (int)a_ld; }
                if (b_idx) { gather_rows(bbuf, b_src, b_ld, b_idx, 0, start, rows, nb, bf);
                             B.p = bbuf; B.ld = nb; }
                else { B.p = offset(b_src, start * b_ld, bf); B.ld = (int)b_ld; }
                A.trans = 1; B.trans = 0;
                gemm_rm(bf, ma, nb, rows, 1.0f, A, B, c ? 1.0f : 0.0f, acc, nb, 0);
            }
        }
        free(abuf); free(bbuf);
        THREAD_DONE();
    }
    if (!failed && n_parts) {
        /* out[e] = its slabs' buffers summed in slab order, element blocks in parallel */
        #pragma omp parallel for num_threads(nthreads) schedule(static)
        for (int64_t j0 = 0; j0 < mat; j0 += 4096) {
            int64_t j1 = j0 + 4096 < mat ? j0 + 4096 : mat;
            int64_t first_item = 0;
            for (int e = 0; e < E; e++) {
                int64_t pieces = pieces_of(counts[e], (int)slab);
                if (counts[e] > slab) {
                    float *o = out + (int64_t)e * mat;
                    const float *p0 = parts + (int64_t)part_of[first_item] * mat;
                    for (int64_t j = j0; j < j1; j++) o[j] = p0[j];
                    for (int64_t q = 1; q < pieces; q++) {
                        const float *pq = parts + (int64_t)part_of[first_item + q] * mat;
                        for (int64_t j = j0; j < j1; j++) o[j] += pq[j];
                    }
                }
                first_item += pieces;
            }
        }
    }
    free(parts);
    free(part_of);
    free(items);
    return failed ? -3 : 0;
}
