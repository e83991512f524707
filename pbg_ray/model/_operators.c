/* The complex_diagonal relation operator and its backward, one pass over the vectors each
 * (pbg_ray.model.operators.ComplexDiagonalOperator), for the CPU kernel.
 *
 * A vector x [D] holds (re, im) halves; the relation's parameters are real [D/2] and
 * imag [D/2]. torch runs the forward as three passes (a roll, a product, a multiply-add)
 * and the backward as eight, each reading and writing vectors that no longer fit in the
 * cache: here each is one pass. The arithmetic is that of the torch code, operation for
 * operation (built with -ffp-contract=off), but for two roundings: torch's addcmul_ fuses
 * its multiply-add, which rounds once where the product and the sum here round each (a
 * fused multiply-add is an instruction only on some of the CPUs the loops are built for,
 * and formed in double precision it took about twice as long as the float one), and the
 * parameter gradients' sums over the rows add in double precision, in row order.
 *
 * Arguments are addresses of contiguous float32 tensors (checked by the Python caller) and
 * sizes; the loops run without the GIL, so Hogwild threads overlap here too. They are built
 * for each vector unit as _simd.h says (the double-precision steps double the vector work,
 * which AVX2 and AVX-512 builds take wider).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>

#include "_simd.h"


/* out = x * [real, real] + swap(x) * [-imag, imag] for the n rows of x [n, d]; swap
 * exchanges the halves. */
CLONED static void forward_rows(const float *restrict x, int64_t n, int64_t d,
                              const float *restrict re, const float *restrict im,
                              float *restrict out) {
    const int64_t h = d / 2;
    for (int64_t r = 0; r < n; r++) {
        const float *restrict a = x + r * d, *restrict b = a + h; /* the row's halves */
        float *restrict ya = out + r * d, *restrict yb = ya + h;
#pragma omp simd
        for (int64_t j = 0; j < h; j++) {
            ya[j] = a[j] * re[j] + b[j] * -im[j];
            yb[j] = b[j] * re[j] + a[j] * im[j];
        }
    }
}

/* The gradients of forward_rows given dy [n, d]: dx = dy * [real, real] + swap(dy) *
 * [imag, -imag] [n, d]; and per column of x the sums over rows of dy * x (t) and of
 * swap(dy) * x (s), [d] each, as torch's path forms them before adding the halves. */
CLONED static void backward_rows(const float *restrict x, const float *restrict dy, int64_t n,
                               int64_t d, const float *restrict re, const float *restrict im,
                               float *restrict dx, double *restrict t, double *restrict s) {
    const int64_t h = d / 2;
    for (int64_t r = 0; r < n; r++) {
        const float *restrict a = x + r * d, *restrict b = a + h;
        const float *restrict ga = dy + r * d, *restrict gb = ga + h;
        float *restrict da = dx + r * d, *restrict db = da + h;
#pragma omp simd
        for (int64_t j = 0; j < h; j++) {
            t[j] += ga[j] * a[j];
            t[h + j] += gb[j] * b[j];
            s[j] += gb[j] * a[j];
            s[h + j] += ga[j] * b[j];
            da[j] = ga[j] * re[j] + gb[j] * im[j];
            db[j] = gb[j] * re[j] + ga[j] * -im[j];
        }
    }
}

/* The parameter gradients from backward_rows' sums: d_real = t[:h] + t[h:], d_imag =
 * s[:h] - s[h:] [h = d/2]. */
static void param_grads(const double *t, const double *s, int64_t d, float *d_real,
                        float *d_imag) {
    const int64_t h = d / 2;
    for (int64_t j = 0; j < h; j++) {
        d_real[j] = (float)t[j] + (float)t[h + j];
        d_imag[j] = (float)s[j] - (float)s[h + j];
    }
}

/* forward(x, n, d, real, imag, out): forward_rows on addresses. */
static PyObject *forward(PyObject *self, PyObject *args) {
    unsigned long long x_p, real_p, imag_p, out_p;
    long long n, d;
    if (!PyArg_ParseTuple(args, "KLLKKK", &x_p, &n, &d, &real_p, &imag_p, &out_p))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    forward_rows((const float *)x_p, n, d, (const float *)real_p, (const float *)imag_p,
                 (float *)out_p);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* backward(x, dy, n, d, real, imag, dx, d_real, d_imag): backward_rows on addresses, then
 * the parameter gradients d_real = t[:h] + t[h:], d_imag = s[:h] - s[h:] [d/2]. */
static PyObject *backward(PyObject *self, PyObject *args) {
    unsigned long long x_p, dy_p, real_p, imag_p, dx_p, dre_p, dim_p;
    long long n, d;
    if (!PyArg_ParseTuple(args, "KKLLKKKKK", &x_p, &dy_p, &n, &d, &real_p, &imag_p, &dx_p,
                          &dre_p, &dim_p))
        return NULL;
    double *sums = calloc(2 * (size_t)d, sizeof(double));
    if (sums == NULL)
        return PyErr_NoMemory();
    double *t = sums, *s = sums + d;
    Py_BEGIN_ALLOW_THREADS
    backward_rows((const float *)x_p, (const float *)dy_p, n, d, (const float *)real_p,
                  (const float *)imag_p, (float *)dx_p, t, s);
    param_grads(t, s, d, (float *)dre_p, (float *)dim_p);
    Py_END_ALLOW_THREADS
    free(sums);
    Py_RETURN_NONE;
}

/* row_functions(): the addresses of forward_rows, backward_rows and param_grads, for C
 * code that applies the operator to rows of its own as it goes (_loss.c's
 * dot_softmax_step, chunk by chunk). One build of the loops serves both modules, with
 * this one's arithmetic (no fused multiply-adds). */
static PyObject *row_functions(PyObject *self, PyObject *args) {
    return Py_BuildValue("KKK", (unsigned long long)(uintptr_t)forward_rows,
                         (unsigned long long)(uintptr_t)backward_rows,
                         (unsigned long long)(uintptr_t)param_grads);
}

static PyMethodDef methods[] = {
    {"forward", forward, METH_VARARGS, "complex_diagonal of x's rows (addresses and sizes)."},
    {"backward", backward, METH_VARARGS, "Its input and parameter gradients."},
    {"row_functions", row_functions, METH_NOARGS,
     "Addresses of the row loops and the parameter gradients' sum, for _loss.c."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_operators", .m_size = -1, .m_methods = methods};

PyMODINIT_FUNC PyInit__operators(void) { return PyModule_Create(&module); }
