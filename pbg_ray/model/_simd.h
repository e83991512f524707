/* How pbg_ray's C loops vectorize, shared by _loss.c, _rows.c and _operators.c: plain C
 * loops that the compiler vectorizes for the CPU's vector unit, the function that holds
 * them built once per instruction set where the compiler can pick the best one when the
 * module loads.
 *
 * x86-64 with GCC: CLONED builds a function for x86-64-v4 (AVX-512), x86-64-v3
 * (AVX2 with FMA) and the baseline (SSE2), and the loader runs the best the CPU has.
 * Elsewhere (and with Clang, untried here) the function is built once for the target's
 * baseline: on aarch64 that is NEON (every ARMv8 CPU has it), and SVE where the build
 * says so (-march=armv8.2-a+sve in CFLAGS). Loops with `#pragma omp simd` are vectorized
 * as written, their sums and maxima in lanes (setup.py's flags say how);
 * tests/model/test_c_build.py reads the compiler's vectorization report to see that each
 * of them is, for x86-64 and for aarch64.
 */
#ifndef PBG_RAY_SIMD_H
#define PBG_RAY_SIMD_H

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONED __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONED
#endif

#endif
