/* The softmax loss of a batch side and its gradient in one C call (pbg_ray.model.losses.
 * SoftmaxLoss), PBG's violators count of a side's score blocks in one pass
 * (losses.count_violators), and per row the scores at or above the row's positive
 * (losses.count_at_least, for filtered ranking): for the CPU kernel on any CPU.
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

/* top[c] = max(top[c], the block's row c) for a chunk's rows. */
static inline void block_max(const Block *b, int64_t chunk, int64_t rows, float *restrict top) {
    const float *x = b->in + chunk * b->s_chunk;
    const int64_t n = b->n_cols;
    if (b->s_col == 1) {
        for (int64_t c = 0; c < rows; c++) {
            const float *restrict row = x + c * b->s_row;
            float m = top[c];
#pragma omp simd reduction(max : m)
            for (int64_t j = 0; j < n; j++)
                m = row[j] > m ? row[j] : m;
            top[c] = m;
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
 * where total = e^(pos - top) + sum e^(x - top) over the row's negatives. */
CLONED static double softmax_chunks(const float *pos, const float *weight, float *dpos,
                                    int64_t chunks, int64_t rows, const Block *blocks,
                                    int n_blocks, float *restrict top, float *restrict total) {
    double loss = 0.;
    for (int64_t i = 0; i < chunks; i++) {
        const float *p = pos + i * rows, *w = weight + i * rows;
        for (int64_t c = 0; c < rows; c++)
            top[c] = p[c];
        for (int k = 0; k < n_blocks; k++)
            block_max(&blocks[k], i, rows, top);
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
                          rows, blocks, (int)n_blocks, scratch, scratch + rows);
    Py_END_ALLOW_THREADS
    free(scratch);
    return PyFloat_FromDouble(loss);
}

static PyMethodDef methods[] = {
    {"softmax", softmax, METH_VARARGS, "Softmax loss and gradients of one batch side."},
    {"violators", violators, METH_VARARGS, "Scores above their row's positive, counted."},
    {"at_least", at_least, METH_VARARGS, "Per row, the scores at or above its positive."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_loss", .m_size = -1, .m_methods = methods};

PyMODINIT_FUNC PyInit__loss(void) { return PyModule_Create(&module); }
