/* Random-row access to an embedding table [N, D] (float32, row-major): the gather of a
 * batch's rows and the RowAdagrad step on them, for the CPU kernel.
 *
 * On a table far larger than the cache nearly every row is a miss, and torch's
 * index_select / index_add_ wait for one row at a time. These loops prefetch the row
 * PREFETCH positions ahead, so several misses are in flight and less time is spent
 * waiting on memory (the RowAdagrad step fetches its rows' accumulators further ahead).
 * The prefetches are reads into the second-level cache, the rows to be written too: on
 * AMD Zen 4, against non-temporal prefetches 8 rows ahead and write prefetches for the
 * rows the step updates, the gather of 6,000 rows of a 40 MB table took about 0.75x the
 * time and the step 0.85x (docs/benchmarks-log.md). The RowAdagrad step also folds
 * duplicates, accumulators and the row update into one pass where torch makes several
 * over the rows, the squared gradient summed in vector lanes. The arithmetic is that of
 * pbg_ray.model.optim.row_adagrad_, operation for operation, except the order of the
 * squared-gradient sum. The dense Adagrad step of the relations' parameters is here too
 * (optim.adagrad_).
 *
 * Arguments are addresses of contiguous tensors (checked by the Python caller) and
 * sizes; the loops run without the GIL, so Hogwild threads overlap here too. The RowAdagrad
 * step is built for each vector unit as _simd.h says.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "_simd.h"

#define PREFETCH 16
#define EPS 1e-10f /* torch.optim.Adagrad's default eps, as in optim.py */

static void prefetch_row(const float *row, int64_t d) {
    for (int64_t j = 0; j < d; j += 16) /* one 64-byte line per 16 floats, into L2 */
        __builtin_prefetch(row + j, 0, 1);
}

/* The index of the first id outside [0, n_rows), or -1. */
static int64_t first_bad_id(const int64_t *ids, int64_t n, int64_t n_rows) {
    for (int64_t i = 0; i < n; i++)
        if ((uint64_t)ids[i] >= (uint64_t)n_rows)
            return i;
    return -1;
}

static PyObject *index_error(const int64_t *ids, int64_t i, int64_t n_rows) {
    return PyErr_Format(PyExc_IndexError, "row id %lld out of range for a table of %lld rows",
                        (long long)ids[i], (long long)n_rows);
}

/* gather(table, n_rows, d, ids, n, out): out[i] = table[ids[i]]. */
static PyObject *gather(PyObject *self, PyObject *args) {
    unsigned long long table_p, ids_p, out_p;
    long long n_rows, d, n;
    if (!PyArg_ParseTuple(args, "KLLKLK", &table_p, &n_rows, &d, &ids_p, &n, &out_p))
        return NULL;
    const float *table = (const float *)table_p;
    const int64_t *ids = (const int64_t *)ids_p;
    float *out = (float *)out_p;
    int64_t bad;
    Py_BEGIN_ALLOW_THREADS
    bad = first_bad_id(ids, n, n_rows);
    if (bad < 0)
        for (int64_t i = 0; i < n; i++) {
            if (i + PREFETCH < n)
                prefetch_row(table + ids[i + PREFETCH] * d, d);
            memcpy(out + i * d, table + ids[i] * d, d * sizeof(float));
        }
    Py_END_ALLOW_THREADS
    if (bad >= 0)
        return index_error(ids, bad, n_rows);
    Py_RETURN_NONE;
}

/* The RowAdagrad step of row_adagrad below, on ids checked to be in range. */
CLONED static void row_adagrad_rows(float *table, float *sums, int64_t d, const int64_t *ids,
                                    float *grads, int64_t n, int64_t *owner, float lr,
                                    int64_t known, float known_scale) {
    for (int64_t i = 0; i < n; i++) {
        if (i + PREFETCH < n)
            __builtin_prefetch(owner + ids[i + PREFETCH], 1, 0);
        owner[ids[i]] = i;
    }
    for (int64_t i = 0; i < n; i++) {
        if (i + 3 * PREFETCH < n) { /* a row's accumulator and owner: one line each, so
                                      * fetched further ahead than its row's lines */
            int64_t ahead = ids[i + 3 * PREFETCH];
            __builtin_prefetch(sums + ahead, 1, 1);
            __builtin_prefetch(owner + ahead, 0, 1);
        }
        if (i + PREFETCH < n)
            prefetch_row(table + ids[i + PREFETCH] * d, d);
        int64_t id = ids[i];
        float scale = id < known ? known_scale : 1.f;
        if (scale == 0.f)
            continue; /* frozen: row and accumulator untouched */
        float *g = grads + i * d;
        int64_t rep = owner[id];
        if (rep != i) { /* fold into the last occurrence, which comes later */
            float *restrict g_rep = grads + rep * d;
#pragma omp simd
            for (int64_t j = 0; j < d; j++)
                g_rep[j] += g[j];
            continue;
        }
        float squares = 0.f;
#pragma omp simd reduction(+ : squares)
        for (int64_t j = 0; j < d; j++)
            squares += g[j] * g[j];
        float sum = sums[id] + squares / (float)d;
        sums[id] = sum;
        float step = 1.f / (sqrtf(sum) + EPS) * -lr;
        if (scale != 1.f)
            step *= scale;
        float *restrict row = table + id * d;
#pragma omp simd
        for (int64_t j = 0; j < d; j++)
            row[j] += g[j] * step;
    }
}

/* row_adagrad(table, sums, n_rows, d, ids, grads, n, owner, lr, known, known_scale):
 * see pbg_ray.model.optim.row_adagrad_. Duplicates of a row fold into its last
 * occurrence (in order), which then takes the step; rows below `known` step at
 * lr * known_scale, or not at all when known_scale is 0. */
static PyObject *row_adagrad(PyObject *self, PyObject *args) {
    unsigned long long table_p, sums_p, ids_p, grads_p, owner_p;
    long long n_rows, d, n, known;
    float lr, known_scale;
    if (!PyArg_ParseTuple(args, "KKLLKKLKfLf", &table_p, &sums_p, &n_rows, &d, &ids_p,
                          &grads_p, &n, &owner_p, &lr, &known, &known_scale))
        return NULL;
    const int64_t *ids = (const int64_t *)ids_p;
    int64_t bad;
    Py_BEGIN_ALLOW_THREADS
    bad = first_bad_id(ids, n, n_rows);
    if (bad < 0)
        row_adagrad_rows((float *)table_p, (float *)sums_p, d, ids, (float *)grads_p, n,
                         (int64_t *)owner_p, lr, known, known_scale);
    Py_END_ALLOW_THREADS
    if (bad >= 0)
        return index_error(ids, bad, n_rows);
    Py_RETURN_NONE;
}

/* adagrad(param, sums, grad, n, lr): torch.optim.Adagrad's step (eps 1e-10, as optim.adagrad_)
 * on n contiguous floats, in the order of torch's CPU ops (addcmul_ fuses its multiply-add,
 * addcdiv_ divides the scaled gradient): sums += grad * grad, then
 * param += -lr * grad / (sqrt(sums) + eps). The square root is IEEE's, which torch's
 * vectorized one can miss by a unit in the last place. One call where torch runs four
 * ops, each of which costs more in dispatch than the arithmetic of a relation's parameters. */
CLONED static void adagrad_elements(float *param, float *sums, const float *grad, int64_t n,
                                    float lr) {
    for (int64_t i = 0; i < n; i++) {
        float sum = fmaf(grad[i], grad[i], sums[i]);
        sums[i] = sum;
        param[i] = param[i] + -lr * grad[i] / (sqrtf(sum) + EPS);
    }
}

static PyObject *adagrad(PyObject *self, PyObject *args) {
    unsigned long long param_p, sums_p, grad_p;
    long long n;
    float lr;
    if (!PyArg_ParseTuple(args, "KKKLf", &param_p, &sums_p, &grad_p, &n, &lr))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    adagrad_elements((float *)param_p, (float *)sums_p, (const float *)grad_p, n, lr);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"gather", gather, METH_VARARGS, "out[i] = table[ids[i]] (addresses and sizes)."},
    {"row_adagrad", row_adagrad, METH_VARARGS, "RowAdagrad step on table rows ids."},
    {"adagrad", adagrad, METH_VARARGS, "Adagrad step on n contiguous floats."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_rows", .m_size = -1, .m_methods = methods};

PyMODINIT_FUNC PyInit__rows(void) { return PyModule_Create(&module); }
