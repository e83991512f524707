/* The softmax loss of a batch side and its gradient in one C call (pbg_ray.model.losses.
 * SoftmaxLoss) and PBG's violators count of a side's score blocks in one pass
 * (losses.count_violators), for the CPU kernel on processors with AVX-512 (`supported()`;
 * elsewhere the kernel keeps torch's ops); and on any x86-64 processor, per row the
 * scores at or above the row's positive (losses.count_at_least, for filtered ranking).
 *
 * torch runs it as ~12 passes over the score blocks (max, subtract, exp, sum, scale, ...),
 * each a separate op. Here each chunk's rows go through three passes per block while they
 * are in the cache: max, exp and sum, scale. The exponential is Cephes' expf polynomial
 * (relative error ~2e-7) on 16 lanes.
 *
 * A block is [chunks, C, N] with strides whose innermost is 1 along N (row order) or
 * along C (a transposed block, the lhs side's share of the batch negatives): both orders
 * are walked in memory order. Its gradient goes to `out`, laid out like the block (the
 * block itself when the caller no longer needs the scores).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_BLOCKS 4
#define AVX512 __attribute__((target("avx512f")))

typedef struct {
    const float *in;
    float *out;
    int64_t n_cols, s_chunk, s_row, s_col;
} Block;

/* Lanes [0, n) of 16 (n may exceed 16). */
AVX512 static inline __mmask16 lanes(int64_t n) {
    return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
}

/* e^x for x <= 0 (scores minus their row's maximum); 0 below -87, NaN stays NaN. */
AVX512 static inline __m512 exp_nonpositive(__m512 x) {
    __m512 xc = _mm512_max_ps(_mm512_set1_ps(-87.f), x); /* a NaN x is returned as is */
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    __m512i bits = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    __m512 e = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
    __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_LT_OQ);
    return _mm512_mask_mov_ps(e, under, _mm512_setzero_ps());
}

/* top[c] = max(top[c], the block's row c) for a chunk's rows. */
AVX512 static void block_max(const Block *b, int64_t chunk, int64_t rows, float *top) {
    const float *x = b->in + chunk * b->s_chunk;
    const __m512 low = _mm512_set1_ps(-INFINITY);
    if (b->s_col == 1) {
        for (int64_t c = 0; c < rows; c++) {
            const float *row = x + c * b->s_row;
            __m512 m = _mm512_set1_ps(top[c]);
            for (int64_t j = 0; j < b->n_cols; j += 16)
                m = _mm512_max_ps(m, _mm512_mask_loadu_ps(low, lanes(b->n_cols - j), row + j));
            top[c] = _mm512_reduce_max_ps(m);
        }
    } else {
        for (int64_t j = 0; j < b->n_cols; j++)
            for (int64_t c = 0; c < rows; c += 16) {
                __mmask16 k = lanes(rows - c);
                __m512 t = _mm512_maskz_loadu_ps(k, top + c);
                __m512 v = _mm512_mask_loadu_ps(low, k, x + j * b->s_col + c);
                _mm512_mask_storeu_ps(top + c, k, _mm512_max_ps(t, v));
            }
    }
}

/* out = e^(x - top[c]) for a chunk's rows; their sums are added to total[c]. */
AVX512 static void block_exp(const Block *b, int64_t chunk, int64_t rows, const float *top,
                             float *total) {
    const float *x = b->in + chunk * b->s_chunk;
    float *o = b->out + chunk * b->s_chunk;
    if (b->s_col == 1) {
        for (int64_t c = 0; c < rows; c++) {
            const float *row = x + c * b->s_row;
            float *orow = o + c * b->s_row;
            __m512 t = _mm512_set1_ps(top[c]), s = _mm512_setzero_ps();
            for (int64_t j = 0; j < b->n_cols; j += 16) {
                __mmask16 k = lanes(b->n_cols - j);
                __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, row + j), t));
                _mm512_mask_storeu_ps(orow + j, k, e);
                s = _mm512_mask_add_ps(s, k, s, e);
            }
            total[c] += _mm512_reduce_add_ps(s);
        }
    } else {
        for (int64_t j = 0; j < b->n_cols; j++)
            for (int64_t c = 0; c < rows; c += 16) {
                __mmask16 k = lanes(rows - c);
                __m512 e = exp_nonpositive(_mm512_sub_ps(
                    _mm512_maskz_loadu_ps(k, x + j * b->s_col + c), _mm512_maskz_loadu_ps(k, top + c)));
                _mm512_mask_storeu_ps(o + j * b->s_col + c, k, e);
                _mm512_mask_storeu_ps(total + c, k,
                                      _mm512_add_ps(_mm512_maskz_loadu_ps(k, total + c), e));
            }
    }
}

/* out *= scale[c] for a chunk's rows. */
AVX512 static void block_scale(const Block *b, int64_t chunk, int64_t rows, const float *scale) {
    float *o = b->out + chunk * b->s_chunk;
    if (b->s_col == 1) {
        for (int64_t c = 0; c < rows; c++) {
            float *orow = o + c * b->s_row;
            __m512 s = _mm512_set1_ps(scale[c]);
            for (int64_t j = 0; j < b->n_cols; j += 16) {
                __mmask16 k = lanes(b->n_cols - j);
                _mm512_mask_storeu_ps(orow + j, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, orow + j), s));
            }
        }
    } else {
        for (int64_t j = 0; j < b->n_cols; j++)
            for (int64_t c = 0; c < rows; c += 16) {
                __mmask16 k = lanes(rows - c);
                float *col = o + j * b->s_col + c;
                _mm512_mask_storeu_ps(col, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, col),
                                                            _mm512_maskz_loadu_ps(k, scale + c)));
            }
    }
}

/* loss = sum_rows w (top + log(total) - pos); dpos = softmax(pos) w - w; out = softmax(x) w,
 * where total = e^(pos - top) + sum e^(x - top) over the row's negatives. */
AVX512 static double softmax_chunks(const float *pos, const float *weight, float *dpos,
                                    int64_t chunks, int64_t rows, const Block *blocks,
                                    int n_blocks, float *top, float *total) {
    double loss = 0.;
    for (int64_t i = 0; i < chunks; i++) {
        const float *p = pos + i * rows, *w = weight + i * rows;
        for (int64_t c = 0; c < rows; c++)
            top[c] = p[c];
        for (int k = 0; k < n_blocks; k++)
            block_max(&blocks[k], i, rows, top);
        for (int64_t c = 0; c < rows; c += 16) { /* total = e^(pos - top) */
            __mmask16 k = lanes(rows - c);
            _mm512_mask_storeu_ps(total + c, k, exp_nonpositive(_mm512_sub_ps(
                _mm512_maskz_loadu_ps(k, p + c), _mm512_maskz_loadu_ps(k, top + c))));
        }
        float *dp = dpos + i * rows; /* e^(pos - top), until scaled below */
        for (int64_t c = 0; c < rows; c++)
            dp[c] = total[c];
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
AVX512 static int64_t block_violators(const Block *b, const float *pos, int64_t chunks,
                                      int64_t rows, int64_t valid) {
    int64_t count = 0;
    for (int64_t i = 0; i < chunks && i * rows < valid; i++) {
        const float *x = b->in + i * b->s_chunk, *p = pos + i * rows;
        int64_t n = valid - i * rows < rows ? valid - i * rows : rows;
        if (b->s_col == 1) {
            for (int64_t c = 0; c < n; c++) {
                const float *row = x + c * b->s_row;
                __m512 t = _mm512_set1_ps(p[c]);
                for (int64_t j = 0; j < b->n_cols; j += 16) {
                    __mmask16 k = lanes(b->n_cols - j);
                    count += __builtin_popcount(_mm512_mask_cmp_ps_mask(
                        k, _mm512_maskz_loadu_ps(k, row + j), t, _CMP_GT_OQ));
                }
            }
        } else {
            for (int64_t j = 0; j < b->n_cols; j++)
                for (int64_t c = 0; c < n; c += 16) {
                    __mmask16 k = lanes(n - c);
                    count += __builtin_popcount(_mm512_mask_cmp_ps_mask(
                        k, _mm512_maskz_loadu_ps(k, x + j * b->s_col + c),
                        _mm512_maskz_loadu_ps(k, p + c), _CMP_GT_OQ));
                }
        }
    }
    return count;
}

/* counts[c] += the scores of row c of a row-contiguous block [rows, n_cols] (rows s_row
 * apart) at or above pos[c]; a NaN is at or above nothing, as in torch.ge. Plain C that
 * the compiler vectorizes, built for AVX-512, AVX2 and the baseline, the best taken when
 * the module loads. */
__attribute__((target_clones("avx512f", "avx2", "default")))
static void block_at_least(const float *x, int64_t s_row, int64_t rows, int64_t n_cols,
                           const float *pos, int64_t *counts) {
    for (int64_t c = 0; c < rows; c++) {
        const float *row = x + c * s_row;
        const float t = pos[c];
        int32_t n = 0;
        for (int64_t j = 0; j < n_cols; j++)
            n += row[j] >= t;
        counts[c] += n;
    }
}

/* Blocks from a sequence of (in, out, n_cols, stride_chunk, stride_row, stride_col), with
 * addresses as integers and strides in elements, for the loops of `caller`: their count,
 * or -1 with an exception set (also on a CPU without AVX-512, see supported()). */
static Py_ssize_t parse_blocks(const char *caller, PyObject *seq, Block *blocks) {
    if (!__builtin_cpu_supports("avx512f")) {
        PyErr_Format(PyExc_RuntimeError, "%s needs AVX-512 (see supported())", caller);
        return -1;
    }
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
    Py_ssize_t n_blocks = parse_blocks("violators", seq, blocks);
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
    Py_ssize_t n_blocks = parse_blocks("softmax", seq, blocks);
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

static PyObject *supported(PyObject *self, PyObject *args) {
    return PyBool_FromLong(__builtin_cpu_supports("avx512f"));
}

static PyMethodDef methods[] = {
    {"softmax", softmax, METH_VARARGS, "Softmax loss and gradients of one batch side."},
    {"violators", violators, METH_VARARGS, "Scores above their row's positive, counted."},
    {"at_least", at_least, METH_VARARGS, "Per row, the scores at or above its positive."},
    {"supported", supported, METH_NOARGS, "Whether this CPU runs softmax (AVX-512)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_loss", .m_size = -1, .m_methods = methods};

PyMODINIT_FUNC PyInit__loss(void) { return PyModule_Create(&module); }
