/* The softmax loss of a batch side and its gradient in one C call (pbg_ray.model.losses.
 * SoftmaxLoss), PBG's violators count of a side's score blocks in one pass
 * (losses.count_violators), and per row the scores at or above the row's positive
 * (losses.count_at_least, for filtered ranking): for the CPU kernel on any CPU. And the
 * dot comparator's whole scoring step of a batch (losses.dot_softmax_step): per chunk its
 * products through BLAS's sgemm, the masks, the same softmax loop (counting the violators
 * in its pass for the maximum), and the products of the rows' gradients, while the
 * chunk's rows are in the cache.
 *
 * torch runs the softmax as ~12 passes over the score blocks (max, subtract, exp, sum,
 * scale, ...), each a separate op. Here each chunk's rows go through max, exp (and their
 * sum), scale, block by block while they are in the cache. The exponential is Cephes'
 * expf polynomial (relative error ~2e-7), written as plain C on one float.
 *
 * Why plain C: one source for every CPU, where the AVX-512 intrinsics it replaced left
 * every other CPU to torch's ops (on an AVX2 CPU torch's ops took 1.15-1.24x the C loop's
 * CPU time for a batch of kernel_bench's setting A: docs/benchmarks.md, "The CPU
 * kernel"). The compiler vectorizes each loop (tests/model/test_c_build.py reads
 * its vectorization report, for x86-64 and for aarch64), and _simd.h builds the functions
 * that hold them for AVX-512, AVX2 and the baseline, the best picked when the module
 * loads (NEON or SVE on ARM). A per-ISA layer of intrinsics would be one source per
 * instruction set to keep equal; torch.compile's CPU backend (not measured) would need a
 * C++ compiler in every worker at run time and a compilation per batch shape.
 *
 * A block is [chunks, C, N] with strides whose innermost is 1 along N (row order) or
 * along C (a transposed block, the lhs side's share of the batch negatives): both orders
 * are walked in memory order, so each inner loop runs over contiguous floats. Its gradient
 * goes to `out`, laid out like the block (the block itself when the caller no longer
 * needs the scores).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_simd.h"

#define MAX_BLOCKS 4

typedef struct {
    const float *in;
    float *out;
    int64_t n_cols, s_chunk, s_row, s_col;
} Block;

/* e^x for x <= 0 (scores minus their row's maximum); 0 below -87, NaN stays NaN. The
 * rounding to an integer adds and subtracts 1.5 * 2^23, whose sum's low bits then hold
 * that integer: the power of two is made from them, without a float-to-int conversion. */
static inline float exp_nonpositive(float x) {
    const float magic = 12582912.f; /* 1.5 * 2^23 */
    float xc = x < -87.f ? -87.f : x;
    float shifted = xc * 1.44269504088896341f + magic;
    float n = shifted - magic;
    float r = xc - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = (p * r) * r + (r + 1.f);
    union { float f; uint32_t u; } power;
    power.f = shifted;
    power.u = (power.u - 0x4B400000u + 127u) << 23; /* 2^n */
    float e = p * power.f;
    return x < -87.f ? 0.f : e;
}

/* top[c] = max(top[c], the block's row c) for a chunk's rows; where `above` is given,
 * above[c] += the row's scores above p[c] (PBG's violators, counted in the same pass). */
static inline void block_max(const Block *b, int64_t chunk, int64_t rows,
                             const float *restrict p, float *restrict top,
                             int32_t *restrict above) {
    const float *x = b->in + chunk * b->s_chunk;
    const int64_t n = b->n_cols;
    if (b->s_col == 1) {
        for (int64_t c = 0; c < rows; c++) {
            const float *restrict row = x + c * b->s_row;
            const float t = p[c];
            float m = top[c];
            int32_t a = 0;
#pragma omp simd reduction(max : m) reduction(+ : a)
            for (int64_t j = 0; j < n; j++) {
                m = row[j] > m ? row[j] : m;
                a += row[j] > t;
            }
            top[c] = m;
            if (above != NULL)
                above[c] += a;
        }
    } else if (above != NULL) {
        for (int64_t j = 0; j < n; j++) {
            const float *restrict col = x + j * b->s_col;
#pragma omp simd
            for (int64_t c = 0; c < rows; c++) {
                top[c] = col[c] > top[c] ? col[c] : top[c];
                above[c] += col[c] > p[c];
            }
        }
    } else {
        for (int64_t j = 0; j < n; j++) {
            const float *restrict col = x + j * b->s_col;
#pragma omp simd
            for (int64_t c = 0; c < rows; c++)
                top[c] = col[c] > top[c] ? col[c] : top[c];
        }
    }
}

/* out = e^(x - top[c]) for a chunk's rows; their sums are added to total[c]. */
static inline void block_exp(const Block *b, int64_t chunk, int64_t rows,
                             const float *restrict top, float *restrict total) {
    const float *x = b->in + chunk * b->s_chunk;
    float *o = b->out + chunk * b->s_chunk;
    const int64_t n = b->n_cols;
    if (b->s_col == 1) {
        for (int64_t c = 0; c < rows; c++) {
            const float *row = x + c * b->s_row;
            float *orow = o + c * b->s_row;
            const float t = top[c];
#pragma omp simd
            for (int64_t j = 0; j < n; j++)
                orow[j] = exp_nonpositive(row[j] - t);
            float s = 0.f; /* (a second pass, in the cache: NEON keeps the fused one scalar) */
#pragma omp simd reduction(+ : s)
            for (int64_t j = 0; j < n; j++)
                s += orow[j];
            total[c] += s;
        }
    } else {
        for (int64_t j = 0; j < n; j++) {
            const float *col = x + j * b->s_col;
            float *ocol = o + j * b->s_col;
#pragma omp simd
            for (int64_t c = 0; c < rows; c++) {
                float e = exp_nonpositive(col[c] - top[c]);
                ocol[c] = e;
                total[c] += e;
            }
        }
    }
}

/* out *= scale[c] for a chunk's rows. */
static inline void block_scale(const Block *b, int64_t chunk, int64_t rows,
                               const float *restrict scale) {
    float *o = b->out + chunk * b->s_chunk;
    const int64_t n = b->n_cols;
    if (b->s_col == 1) {
        for (int64_t c = 0; c < rows; c++) {
            float *orow = o + c * b->s_row;
            const float s = scale[c];
#pragma omp simd
            for (int64_t j = 0; j < n; j++)
                orow[j] *= s;
        }
    } else {
        for (int64_t j = 0; j < n; j++) {
            float *ocol = o + j * b->s_col;
#pragma omp simd
            for (int64_t c = 0; c < rows; c++)
                ocol[c] *= scale[c];
        }
    }
}

/* loss = sum_rows w (top + log(total) - pos); dpos = softmax(pos) w - w; out = softmax(x) w,
 * where total = e^(pos - top) + sum e^(x - top) over the row's negatives. Where `above`
 * [chunks * rows] is given, each row's count of scores above its positive is added to it. */
CLONED static double softmax_chunks(const float *pos, const float *weight, float *dpos,
                                    int64_t chunks, int64_t rows, const Block *blocks,
                                    int n_blocks, float *restrict top, float *restrict total,
                                    int32_t *above) {
    double loss = 0.;
    for (int64_t i = 0; i < chunks; i++) {
        const float *p = pos + i * rows, *w = weight + i * rows;
        for (int64_t c = 0; c < rows; c++)
            top[c] = p[c];
        for (int k = 0; k < n_blocks; k++)
            block_max(&blocks[k], i, rows, p, top, above == NULL ? NULL : above + i * rows);
        float *dp = dpos + i * rows; /* e^(pos - top), until scaled below */
#pragma omp simd
        for (int64_t c = 0; c < rows; c++)
            total[c] = dp[c] = exp_nonpositive(p[c] - top[c]);
        for (int k = 0; k < n_blocks; k++)
            block_exp(&blocks[k], i, rows, top, total);
        for (int64_t c = 0; c < rows; c++) {
            loss += (double)(w[c] * (top[c] + logf(total[c]) - p[c]));
            float scale = w[c] / total[c];
            dp[c] = dp[c] * scale - w[c];
            total[c] = scale;
        }
        for (int k = 0; k < n_blocks; k++)
            block_scale(&blocks[k], i, rows, total);
    }
    return loss;
}

/* The scores of a block above their row's positive (ordered: a NaN is above nothing), over
 * the rows of its first `valid` of chunks x rows (row c of chunk i is row i * rows + c; the
 * rest are padding). */
CLONED static int64_t block_violators(const Block *b, const float *pos, int64_t chunks,
                                      int64_t rows, int64_t valid) {
    int64_t count = 0;
    for (int64_t i = 0; i < chunks && i * rows < valid; i++) {
        const float *x = b->in + i * b->s_chunk, *p = pos + i * rows;
        int64_t n = valid - i * rows < rows ? valid - i * rows : rows;
        int32_t above = 0;
        if (b->s_col == 1) {
            for (int64_t c = 0; c < n; c++) {
                const float *row = x + c * b->s_row;
                const float t = p[c];
#pragma omp simd reduction(+ : above)
                for (int64_t j = 0; j < b->n_cols; j++)
                    above += row[j] > t;
            }
        } else {
            for (int64_t j = 0; j < b->n_cols; j++) {
                const float *col = x + j * b->s_col;
#pragma omp simd reduction(+ : above)
                for (int64_t c = 0; c < n; c++)
                    above += col[c] > p[c];
            }
        }
        count += above;
    }
    return count;
}

/* counts[c] += the scores of row c of a row-contiguous block [rows, n_cols] (rows s_row
 * apart) at or above pos[c]; a NaN is at or above nothing, as in torch.ge. */
CLONED static void block_at_least(const float *x, int64_t s_row, int64_t rows, int64_t n_cols,
                                  const float *pos, int64_t *counts) {
    for (int64_t c = 0; c < rows; c++) {
        const float *row = x + c * s_row;
        const float t = pos[c];
        int32_t n = 0;
#pragma omp simd reduction(+ : n)
        for (int64_t j = 0; j < n_cols; j++)
            n += row[j] >= t;
        counts[c] += n;
    }
}

/* cblas_sgemm of an ILP64 BLAS (64-bit sizes), found by the Python caller in numpy's
 * OpenBLAS (blas.sgemm_address). */
typedef void (*sgemm_fn)(int order, int trans_a, int trans_b, int64_t m, int64_t n, int64_t k,
                         float alpha, const float *a, int64_t lda, const float *b, int64_t ldb,
                         float beta, float *c, int64_t ldc);
enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };
#define MASKED_SCORE -1e9f /* negatives.MASKED_SCORE */

/* out [cols, rows] = x [rows, cols] transposed (x's rows `stride` apart). */
static void transpose(const float *restrict x, int64_t rows, int64_t cols, int64_t stride,
                      float *restrict out) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++)
            out[c * rows + r] = x[r * stride + c];
}

typedef struct {
    double loss;
    int64_t violators_lhs, violators_rhs;
} StepTotals;

/* The complex_diagonal operator's row loops in _operators.c (its row_functions), for the
 * rhs rows of dot_softmax_step: forward_rows(x, n, d, real, imag, out), backward_rows(x,
 * dy, n, d, real, imag, dx, t, s), which adds the parameters' sums into t and s [d] each,
 * and param_grads(t, s, d, d_real, d_imag). */
typedef void (*op_forward_fn)(const float *, int64_t, int64_t, const float *, const float *,
                              float *);
typedef void (*op_backward_fn)(const float *, const float *, int64_t, int64_t, const float *,
                               const float *, float *, double *, double *);
typedef void (*op_param_grads_fn)(const double *, const double *, int64_t, float *, float *);

typedef struct {
    op_forward_fn forward;
    op_backward_fn backward;
    const float *real, *imag;
    double *t, *s;   /* backward_rows' sums over the batch's rows */
    float *v, *dv;   /* [C + U, D]: the chunk's rhs rows through the operator, their gradient */
} RhsOperator;

/* One chunk of dot_softmax_step (below). The chunk's lhs rows u [C + U, D] (positives, then
 * uniform negatives) and rhs rows v [C + U, D]; `valid` of its C edges are real (the
 * rest padding, their rows zero and weight 0); its gradients go to du and dv. Scores are
 * kept transposed, candidates by positives (the products' fast form in BLAS):
 *   st [C + U, C]: st[j, i] = u_i . v_j, the rhs side's negatives of edge i in column i,
 *     and in rows and columns below C the batch block, whose row i holds the lhs side's
 *     batch negatives of edge i (u_j . v_i); the diagonal holds the positives;
 *   sl [U, C]: sl[j, i] = v_i . u_(C + j), the lhs side's uniform negatives, by column;
 *   lb [C, C]: the lhs batch negatives, copied out of st (the loss overwrites both).
 * Masks, losses and gradients are those of Embedder.forward and backward on such a batch.
 * With an operator `op`, v holds the rhs rows before it: the chunk's rows go through it
 * into op->v, and their gradient comes back through its backward from op->dv into dv. */
static void step_chunk(sgemm_fn sgemm, const float *u, const float *v, float *du, float *dv,
                       const float *weight, int64_t C, int64_t U, int64_t D, int64_t valid,
                       const RhsOperator *op, float *scratch, StepTotals *totals) {
    const int64_t K = C + U;
    const float *rows = v;
    float *drows = dv;
    if (op != NULL) {
        op->forward(rows, K, D, op->real, op->imag, op->v);
        v = op->v;
        dv = op->dv;
    }
    float *ut = scratch, *vt = ut + D * C, *st = vt + D * C, *sl = st + K * C, *lb = sl + U * C;
    float *pos = lb + C * C, *dpos_l = pos + C, *dpos_r = dpos_l + C, *top = dpos_r + C,
          *total = top + C;
    int32_t *above_l = (int32_t *)(total + C), *above_r = above_l + C;
    transpose(u, C, D, D, ut);
    transpose(v, C, D, D, vt);
    sgemm(ROW_MAJOR, NO_TRANS, NO_TRANS, K, C, D, 1.f, v, D, ut, C, 0.f, st, C);
    sgemm(ROW_MAJOR, NO_TRANS, NO_TRANS, U, C, D, 1.f, u + C * D, D, vt, C, 0.f, sl, C);
    for (int64_t i = 0; i < C; i++) {
        pos[i] = st[i * C + i];
        st[i * C + i] = MASKED_SCORE;
    }
    if (valid < C) /* pairs with padding, in the batch block */
        for (int64_t j = 0; j < C; j++)
            for (int64_t i = 0; i < C; i++)
                if (i >= valid || j >= valid)
                    st[j * C + i] = MASKED_SCORE;
    memcpy(lb, st, C * C * sizeof(float));
    Block rhs = {st, st, K, 0, 1, C};
    Block lhs[2] = {{lb, lb, C, 0, C, 1}, {sl, sl, U, 0, 1, C}};
    memset(above_l, 0, 2 * C * sizeof(int32_t));
    totals->loss += softmax_chunks(pos, weight, dpos_r, 1, C, &rhs, 1, top, total, above_r);
    totals->loss += softmax_chunks(pos, weight, dpos_l, 1, C, lhs, 2, top, total, above_l);
    for (int64_t i = 0; i < valid; i++) {
        totals->violators_lhs += above_l[i];
        totals->violators_rhs += above_r[i];
    }
    /* The batch block's gradient, both sides' (the lhs side's lies in st's layout), and
     * the positives' on its diagonal (the masked entries' own are 0). */
    for (int64_t k = 0; k < C * C; k++)
        st[k] += lb[k];
    for (int64_t i = 0; i < C; i++)
        st[i * C + i] = st[i * C + i] + dpos_l[i] + dpos_r[i];
    /* du[:C] = st^T v; dv = st u[:C] + (dv[:C] +=) sl^T u[C:]; du[C:] = sl v[:C]. */
    sgemm(ROW_MAJOR, TRANS, NO_TRANS, C, D, K, 1.f, st, C, v, D, 0.f, du, D);
    sgemm(ROW_MAJOR, NO_TRANS, NO_TRANS, K, D, C, 1.f, st, C, u, D, 0.f, dv, D);
    sgemm(ROW_MAJOR, TRANS, NO_TRANS, C, D, U, 1.f, sl, C, u + C * D, D, 1.f, dv, D);
    sgemm(ROW_MAJOR, NO_TRANS, NO_TRANS, U, D, C, 1.f, sl, C, v, D, 0.f, du + C * D, D);
    for (int64_t i = valid; i < C; i++) { /* padding rows: no gradient */
        memset(du + i * D, 0, D * sizeof(float));
        memset(dv + i * D, 0, D * sizeof(float));
    }
    if (op != NULL)
        op->backward(rows, dv, K, D, op->real, op->imag, drows, op->t, op->s);
}

/* Blocks from a sequence of (in, out, n_cols, stride_chunk, stride_row, stride_col), with
 * addresses as integers and strides in elements: their count, or -1 with an exception set. */
static Py_ssize_t parse_blocks(PyObject *seq, Block *blocks) {
    PyObject *fast = PySequence_Fast(seq, "blocks must be a sequence");
    if (fast == NULL)
        return -1;
    Py_ssize_t n_blocks = PySequence_Fast_GET_SIZE(fast);
    if (n_blocks > MAX_BLOCKS) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "at most %d blocks", MAX_BLOCKS);
        return -1;
    }
    for (Py_ssize_t k = 0; k < n_blocks; k++) {
        unsigned long long in_p, out_p;
        long long n_cols, s_chunk, s_row, s_col;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, k), "KKLLLL", &in_p, &out_p, &n_cols,
                              &s_chunk, &s_row, &s_col)) {
            Py_DECREF(fast);
            return -1;
        }
        if (s_col != 1 && s_row != 1) {
            Py_DECREF(fast);
            PyErr_Format(PyExc_ValueError, "block %zd is contiguous along neither its rows "
                         "nor its columns", k);
            return -1;
        }
        blocks[k] = (Block){(const float *)in_p, (float *)out_p, n_cols, s_chunk, s_row, s_col};
    }
    Py_DECREF(fast);
    return n_blocks;
}

/* violators(pos, chunks, rows, valid, blocks): blocks as softmax takes them (their `out`
 * unused); pos contiguous [chunks, rows]. Returns the count of block_violators. */
static PyObject *violators(PyObject *self, PyObject *args) {
    unsigned long long pos_p;
    long long chunks, rows, valid;
    PyObject *seq;
    if (!PyArg_ParseTuple(args, "KLLLO", &pos_p, &chunks, &rows, &valid, &seq))
        return NULL;
    Block blocks[MAX_BLOCKS];
    Py_ssize_t n_blocks = parse_blocks(seq, blocks);
    if (n_blocks < 0)
        return NULL;
    int64_t count = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 0; k < n_blocks; k++)
        count += block_violators(&blocks[k], (const float *)pos_p, chunks, rows, valid);
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(count);
}

/* at_least(block, s_row, rows, n_cols, pos, counts): block_at_least with addresses as
 * integers; pos float32 [rows] and counts int64 [rows], contiguous. */
static PyObject *at_least(PyObject *self, PyObject *args) {
    unsigned long long block_p, pos_p, counts_p;
    long long s_row, rows, n_cols;
    if (!PyArg_ParseTuple(args, "KLLLKK", &block_p, &s_row, &rows, &n_cols, &pos_p, &counts_p))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    block_at_least((const float *)block_p, s_row, rows, n_cols, (const float *)pos_p,
                   (int64_t *)counts_p);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* softmax(pos, weight, dpos, chunks, rows, blocks): blocks is a sequence of
 * (in, out, n_cols, stride_chunk, stride_row, stride_col) with addresses as integers and
 * strides in elements; pos, weight and dpos are contiguous [chunks, rows]. Returns the loss. */
static PyObject *softmax(PyObject *self, PyObject *args) {
    unsigned long long pos_p, weight_p, dpos_p;
    long long chunks, rows;
    PyObject *seq;
    if (!PyArg_ParseTuple(args, "KKKLLO", &pos_p, &weight_p, &dpos_p, &chunks, &rows, &seq))
        return NULL;
    Block blocks[MAX_BLOCKS];
    Py_ssize_t n_blocks = parse_blocks(seq, blocks);
    if (n_blocks < 0)
        return NULL;
    float *scratch = malloc(2 * (rows > 0 ? rows : 1) * sizeof(float));
    if (scratch == NULL)
        return PyErr_NoMemory();
    double loss;
    Py_BEGIN_ALLOW_THREADS
    loss = softmax_chunks((const float *)pos_p, (const float *)weight_p, (float *)dpos_p, chunks,
                          rows, blocks, (int)n_blocks, scratch, scratch + rows, NULL);
    Py_END_ALLOW_THREADS
    free(scratch);
    return PyFloat_FromDouble(loss);
}

/* dot_softmax_step(sgemm, u, v, du, dv, weight, chunks, C, U, D, num_pos, op): the scores,
 * softmax losses and score gradients of a batch of one relation under the dot comparator,
 * both sides with batch and U uniform negatives, chunk by chunk while its rows are in the
 * cache (pbg_ray.model.embedder, Embedder._fused_backward). u, v, du, dv are contiguous
 * [chunks, C + U, D]; weight [chunks, C]. op: None, or the rhs rows' complex_diagonal
 * operator as (forward_rows, backward_rows, param_grads, real, imag, d_real, d_imag), the
 * functions' addresses from _operators.row_functions(): v is then the rows before it, dv
 * their gradient, and its parameters' gradients are written to d_real and d_imag [D/2].
 * Returns (loss, violators lhs, violators rhs). */
static PyObject *dot_softmax_step(PyObject *self, PyObject *args) {
    unsigned long long sgemm_p, u_p, v_p, du_p, dv_p, weight_p;
    unsigned long long fwd_p, bwd_p, grads_p, re_p, im_p, dre_p, dim_p;
    long long chunks, C, U, D, num_pos;
    PyObject *op_args;
    if (!PyArg_ParseTuple(args, "KKKKKKLLLLLO", &sgemm_p, &u_p, &v_p, &du_p, &dv_p, &weight_p,
                          &chunks, &C, &U, &D, &num_pos, &op_args))
        return NULL;
    int with_op = op_args != Py_None;
    if (with_op && !PyArg_ParseTuple(op_args, "KKKKKKK", &fwd_p, &bwd_p, &grads_p, &re_p, &im_p,
                                     &dre_p, &dim_p))
        return NULL;
    const int64_t K = C + U;
    size_t step_floats = 2 * D * C + K * C + U * C + C * C + 7 * C;
    float *scratch = malloc((step_floats + (with_op ? 2 * K * D : 0)) * sizeof(float));
    double *sums = with_op ? calloc(2 * (size_t)D, sizeof(double)) : NULL;
    if (scratch == NULL || (with_op && sums == NULL)) {
        free(scratch);
        free(sums);
        return PyErr_NoMemory();
    }
    RhsOperator op = {(op_forward_fn)fwd_p, (op_backward_fn)bwd_p, (const float *)re_p,
                      (const float *)im_p, sums, sums + D, scratch + step_floats,
                      scratch + step_floats + K * D};
    StepTotals totals = {0., 0, 0};
    Py_BEGIN_ALLOW_THREADS
    for (int64_t i = 0; i < chunks; i++) {
        int64_t offset = i * K * D, valid = num_pos - i * C < C ? num_pos - i * C : C;
        step_chunk((sgemm_fn)sgemm_p, (const float *)u_p + offset, (const float *)v_p + offset,
                   (float *)du_p + offset, (float *)dv_p + offset,
                   (const float *)weight_p + i * C, C, U, D, valid, with_op ? &op : NULL,
                   scratch, &totals);
    }
    if (with_op)
        ((op_param_grads_fn)grads_p)(op.t, op.s, D, (float *)dre_p, (float *)dim_p);
    Py_END_ALLOW_THREADS
    free(scratch);
    free(sums);
    return Py_BuildValue("dLL", totals.loss, (long long)totals.violators_lhs,
                         (long long)totals.violators_rhs);
}

static PyMethodDef methods[] = {
    {"softmax", softmax, METH_VARARGS, "Softmax loss and gradients of one batch side."},
    {"violators", violators, METH_VARARGS, "Scores above their row's positive, counted."},
    {"at_least", at_least, METH_VARARGS, "Per row, the scores at or above its positive."},
    {"dot_softmax_step", dot_softmax_step, METH_VARARGS,
     "Scores, softmax loss and score gradients of a dot-comparator batch, chunk by chunk."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_loss", .m_size = -1, .m_methods = methods};

PyMODINIT_FUNC PyInit__loss(void) { return PyModule_Create(&module); }
