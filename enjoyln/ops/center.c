/* Column-based weight centering, in place, with float64 arithmetic.
 *
 * A tensor is seen as [outer, N, inner] (the centered axis in the middle); a call
 * centers a slice of n entries of that axis (one block of a grouped centering) in
 * every outer index: x[o, i, j] -= mean_i(x[o, i, j]), or, with a LayerScale gain s,
 * x[o, i, j] -= mean_i(s[i] * x[o, i, j]) / s[i].
 *
 * The summation order is fixed by this code, not by the compiler or the machine, so
 * the fold and the static check, which both call it, give the same bits everywhere:
 *
 *   - along the last axis (inner == 1): eight partial sums, element i going to
 *     partial i % 8 in order of i, combined as ((p0+p1)+(p2+p3))+((p4+p5)+(p6+p7));
 *   - along any other axis: one sum per column, over i in order.
 *
 * Then mean = sum / n, and each element becomes x - mean (or x - mean / s[i]),
 * rounded to its dtype as torch rounds a float64 (bfloat16 and float16 through
 * float32, as torch does). Built with -ffp-contract=off, so that no multiply and
 * add are fused into one rounding; vectorising across columns or lanes reorders
 * nothing.
 *
 * One routine, three uses, all with that arithmetic: in place (dst == src, the fold's
 * buffer), from one memory into another (dst != src: a tensor mapped from its file
 * centered into the fold's buffer), and compared (cand != NULL: each centered element
 * is rounded into a small scratch segment and compared with the candidate's bytes, so
 * the static check reads both tensors once and writes nothing). Loads and stores go
 * through memcpy: a tensor mapped from a safetensors file need not be aligned. ``enjoyln/ops/center.py`` holds a torch version of the same order, for
 * machines without a compiler, and the tests hold the two to the same bits.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtypes.h"

int enjoyln_center_has_f16(void) { return ENJOYLN_HAS_F16; }

#define BLOCK 256 /* columns summed together: 2 KiB of float64 sums, in L1 */
#define SEG 256   /* elements of a row rounded into scratch before comparing */

/* Where the centered elements from index `at` of a row go: into dst, or into the scratch
 * segment `tmp`, compared afterwards with the candidate's bytes at the same index. */
#define OUT(at, SIZE) (cand ? (void*)tmp : (void*)((char*)dst + (at) * SIZE))
#define COMPARE(at, count, SIZE) \
    if (cand && memcmp(tmp, (const char*)cand + (at) * SIZE, (size_t)(count) * SIZE)) differ = 1;

/* One row of n elements along the last axis, at element offset r of every pointer. */
#define CENTER_ROW(LD, ST, SIZE)                                                                  \
    {                                                                                             \
        const char* row = (const char*)src + r * SIZE;                                            \
        double p[8] = {0, 0, 0, 0, 0, 0, 0, 0};                                                   \
        int64_t i = 0;                                                                            \
        if (s) {                                                                                  \
            for (; i + 8 <= n; i += 8)                                                            \
                for (int k = 0; k < 8; k++) p[k] += s[i + k] * LD(row, i + k);                    \
            for (int k = 0; i + k < n; k++) p[k] += s[i + k] * LD(row, i + k);                    \
        } else {                                                                                  \
            for (; i + 8 <= n; i += 8)                                                            \
                for (int k = 0; k < 8; k++) p[k] += LD(row, i + k);                               \
            for (int k = 0; i + k < n; k++) p[k] += LD(row, i + k);                               \
        }                                                                                         \
        const double mean = (((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]))) / (double)n; \
        for (int64_t i0 = 0; i0 < n; i0 += SEG) {                                                 \
            const int64_t m = n - i0 < SEG ? n - i0 : SEG;                                        \
            const char* in = row + i0 * SIZE;                                                     \
            void* out = OUT(r + i0, SIZE);                                                              \
            if (s)                                                                                \
                for (int64_t k = 0; k < m; k++) ST(out, k, LD(in, k) - mean / s[i0 + k]);         \
            else                                                                                  \
                for (int64_t k = 0; k < m; k++) ST(out, k, LD(in, k) - mean);                     \
            COMPARE(r + i0, m, SIZE)                                                                    \
        }                                                                                         \
    }

/* Columns jb .. jb + w of one outer slice [n, inner] that starts at element offset r. */
#define CENTER_COLUMNS(LD, ST, SIZE)                                                              \
    {                                                                                             \
        const char* base = (const char*)src + r * SIZE;                                           \
        double acc[BLOCK];                                                                        \
        for (int64_t j = 0; j < w; j++) acc[j] = 0.0;                                             \
        for (int64_t i = 0; i < n; i++) {                                                         \
            const char* in = base + (i * inner + jb) * SIZE;                                      \
            if (s) {                                                                              \
                const double si = s[i];                                                           \
                for (int64_t j = 0; j < w; j++) acc[j] += si * LD(in, j);                         \
            } else {                                                                              \
                for (int64_t j = 0; j < w; j++) acc[j] += LD(in, j);                              \
            }                                                                                     \
        }                                                                                         \
        for (int64_t j = 0; j < w; j++) acc[j] = acc[j] / (double)n;                              \
        for (int64_t i = 0; i < n; i++) {                                                         \
            const int64_t at = r + i * inner + jb;                                                \
            const char* in = base + (i * inner + jb) * SIZE;                                      \
            void* out = OUT(at, SIZE);                                                                  \
            if (s) {                                                                              \
                const double si = s[i];                                                           \
                for (int64_t j = 0; j < w; j++) ST(out, j, LD(in, j) - acc[j] / si);              \
            } else {                                                                              \
                for (int64_t j = 0; j < w; j++) ST(out, j, LD(in, j) - acc[j]);                   \
            }                                                                                     \
            COMPARE(at, w, SIZE)                                                                        \
        }                                                                                         \
    }

#define CENTER_ALL(LD, ST, SIZE)                                                                  \
    if (inner == 1) {                                                                             \
        _Pragma("omp parallel for num_threads(threads) schedule(static) reduction(|:differ) if(outer * n >= PARALLEL_MIN)") \
        for (int64_t o = 0; o < outer; o++) {                                                     \
            double tmp[SEG];                                                                      \
            const int64_t r = o * outer_stride;                                                   \
            CENTER_ROW(LD, ST, SIZE)                                                              \
        }                                                                                         \
    } else {                                                                                      \
        const int64_t blocks = (inner + BLOCK - 1) / BLOCK;                                       \
        _Pragma("omp parallel for num_threads(threads) schedule(static) reduction(|:differ) if(outer * n * inner >= PARALLEL_MIN)") \
        for (int64_t t = 0; t < outer * blocks; t++) {                                            \
            double tmp[BLOCK];                                                                    \
            const int64_t o = t / blocks, jb = (t % blocks) * BLOCK;                              \
            const int64_t w = inner - jb < BLOCK ? inner - jb : BLOCK;                            \
            const int64_t r = o * outer_stride;                                                   \
            CENTER_COLUMNS(LD, ST, SIZE)                                                          \
        }                                                                                         \
    }

/* Below this many elements a second thread costs more than it saves. */
#define PARALLEL_MIN 262144

/* Center the slice that starts at src (and at dst, cand: the same layout) into dst, or
 * compare it with cand. outer_stride is in elements; s is NULL or n float64 gains.
 * Returns 0 (written, or equal to cand), 1 (cand differs somewhere), or -1 for an
 * unknown dtype. Every output element is computed by one thread in a fixed order, so the
 * bits do not depend on the number of threads. */
int enjoyln_center_into(const void* src, void* dst, const void* cand, int dtype, int64_t outer,
                        int64_t outer_stride, int64_t n, int64_t inner, const double* s, int threads) {
    if (n <= 0 || outer <= 0 || inner <= 0) return 0;
    int differ = 0;
    switch (dtype) {
        case F32: CENTER_ALL(ld_f32, st_f32, 4) return differ;
        case F64: CENTER_ALL(ld_f64, st_f64, 8) return differ;
        case BF16: CENTER_ALL(ld_bf16, st_bf16, 2) return differ;
        case F16: CENTER_ALL(ld_f16, st_f16, 2) return differ;
    }
    return -1;
}

/* In place: what the fold does to a tensor in its buffer. */
int enjoyln_center(void* x, int dtype, int64_t outer, int64_t outer_stride, int64_t n, int64_t inner,
                   const double* s, int threads) {
    return enjoyln_center_into(x, x, NULL, dtype, outer, outer_stride, n, inner, s, threads);
}

/* Whether n bytes at a and b are equal, compared by `threads` threads over contiguous
 * halves (each stays a sequential stream): memory bandwidth, not one core's memcmp, is then
 * the limit. A thread stops once any difference is found. */
int enjoyln_same_bytes(const void* a, const void* b, int64_t n, int threads) {
    const int64_t chunk = 1 << 20;
    const int64_t chunks = (n + chunk - 1) / chunk;
    int differ = 0;
    _Pragma("omp parallel for num_threads(threads) schedule(static) if(n >= 16 * chunk)")
    for (int64_t c = 0; c < chunks; c++) {
        if (__atomic_load_n(&differ, __ATOMIC_RELAXED)) continue;
        const int64_t at = c * chunk, len = n - at < chunk ? n - at : chunk;
        if (memcmp((const char*)a + at, (const char*)b + at, (size_t)len))
            __atomic_store_n(&differ, 1, __ATOMIC_RELAXED);
    }
    return !differ;
}
