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
 * nothing. ``enjoyln/ops/center.py`` holds a torch version of the same order, for
 * machines without a compiler, and the tests hold the two to the same bits.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { F32 = 0, BF16 = 1, F16 = 2, F64 = 3 };

static inline double ld_f32(const void* p, int64_t i) { return (double)((const float*)p)[i]; }
static inline double ld_f64(const void* p, int64_t i) { return ((const double*)p)[i]; }
static inline double ld_bf16(const void* p, int64_t i) {
    uint32_t u = (uint32_t)((const uint16_t*)p)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return (double)f;
}
static inline void st_f32(void* p, int64_t i, double v) { ((float*)p)[i] = (float)v; }
static inline void st_f64(void* p, int64_t i, double v) { ((double*)p)[i] = v; }
static inline void st_bf16(void* p, int64_t i, double v) {
    float f = (float)v; /* torch rounds a double to float first, then to bfloat16 */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) { ((uint16_t*)p)[i] = 0x7fc0; return; }
    u += 0x7fffu + ((u >> 16) & 1u);
    ((uint16_t*)p)[i] = (uint16_t)(u >> 16);
}
#ifdef __FLT16_MAX__
static inline double ld_f16(const void* p, int64_t i) { return (double)(float)((const _Float16*)p)[i]; }
static inline void st_f16(void* p, int64_t i, double v) { ((_Float16*)p)[i] = (_Float16)(float)v; }
int enjoyln_center_has_f16(void) { return 1; }
#else
static inline double ld_f16(const void* p, int64_t i) { (void)p; (void)i; return 0.0; }
static inline void st_f16(void* p, int64_t i, double v) { (void)p; (void)i; (void)v; }
int enjoyln_center_has_f16(void) { return 0; }
#endif

#define BLOCK 256 /* columns summed together: 2 KiB of float64 sums, in L1 */

/* One row of n elements along the last axis. */
#define CENTER_ROW(LD, ST)                                                                        \
    {                                                                                             \
        double p[8] = {0, 0, 0, 0, 0, 0, 0, 0};                                                   \
        int64_t i = 0;                                                                            \
        if (s) {                                                                                  \
            for (; i + 8 <= n; i += 8)                                                            \
                for (int k = 0; k < 8; k++) p[k] += s[i + k] * LD(row, i + k);                     \
            for (int k = 0; i + k < n; k++) p[k] += s[i + k] * LD(row, i + k);                     \
        } else {                                                                                  \
            for (; i + 8 <= n; i += 8)                                                            \
                for (int k = 0; k < 8; k++) p[k] += LD(row, i + k);                                \
            for (int k = 0; i + k < n; k++) p[k] += LD(row, i + k);                                \
        }                                                                                         \
        const double mean = (((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]))) / (double)n; \
        if (s)                                                                                    \
            for (i = 0; i < n; i++) ST(row, i, LD(row, i) - mean / s[i]);                         \
        else                                                                                      \
            for (i = 0; i < n; i++) ST(row, i, LD(row, i) - mean);                                \
    }

/* Columns jb .. jb + w of one outer slice [n, inner]. */
#define CENTER_COLUMNS(LD, ST)                                                                    \
    {                                                                                             \
        double acc[BLOCK];                                                                        \
        for (int64_t j = 0; j < w; j++) acc[j] = 0.0;                                             \
        for (int64_t i = 0; i < n; i++) {                                                         \
            const int64_t at = i * inner + jb;                                                    \
            if (s) {                                                                              \
                const double si = s[i];                                                           \
                for (int64_t j = 0; j < w; j++) acc[j] += si * LD(base, at + j);                  \
            } else {                                                                              \
                for (int64_t j = 0; j < w; j++) acc[j] += LD(base, at + j);                       \
            }                                                                                     \
        }                                                                                         \
        for (int64_t j = 0; j < w; j++) acc[j] = acc[j] / (double)n;                              \
        for (int64_t i = 0; i < n; i++) {                                                         \
            const int64_t at = i * inner + jb;                                                    \
            if (s) {                                                                              \
                const double si = s[i];                                                           \
                for (int64_t j = 0; j < w; j++) ST(base, at + j, LD(base, at + j) - acc[j] / si); \
            } else {                                                                              \
                for (int64_t j = 0; j < w; j++) ST(base, at + j, LD(base, at + j) - acc[j]);      \
            }                                                                                     \
        }                                                                                         \
    }

#define CENTER_ALL(LD, ST, SIZE)                                                                  \
    if (inner == 1) {                                                                             \
        _Pragma("omp parallel for num_threads(threads) schedule(static) if(outer * n >= PARALLEL_MIN)") \
        for (int64_t o = 0; o < outer; o++) {                                                     \
            char* row = (char*)x + o * outer_stride * SIZE;                                       \
            CENTER_ROW(LD, ST)                                                                    \
        }                                                                                         \
    } else {                                                                                      \
        const int64_t blocks = (inner + BLOCK - 1) / BLOCK;                                       \
        _Pragma("omp parallel for num_threads(threads) schedule(static) if(outer * n * inner >= PARALLEL_MIN)") \
        for (int64_t t = 0; t < outer * blocks; t++) {                                            \
            const int64_t o = t / blocks, jb = (t % blocks) * BLOCK;                              \
            const int64_t w = inner - jb < BLOCK ? inner - jb : BLOCK;                            \
            char* base = (char*)x + o * outer_stride * SIZE;                                      \
            CENTER_COLUMNS(LD, ST)                                                                \
        }                                                                                         \
    }

/* Below this many elements a second thread costs more than it saves. */
#define PARALLEL_MIN 262144

/* Center x (the first element of the slice) in place. outer_stride is in elements;
 * s is NULL or n float64 gains. Returns 0, or -1 for an unknown dtype. Every output
 * element is computed by one thread in a fixed order, so the bits do not depend on
 * the number of threads. */
int enjoyln_center(void* x, int dtype, int64_t outer, int64_t outer_stride, int64_t n, int64_t inner,
                   const double* s, int threads) {
    if (n <= 0 || outer <= 0 || inner <= 0) return 0;
    switch (dtype) {
        case F32: CENTER_ALL(ld_f32, st_f32, 4) return 0;
        case F64: CENTER_ALL(ld_f64, st_f64, 8) return 0;
        case BF16: CENTER_ALL(ld_bf16, st_bf16, 2) return 0;
        case F16: CENTER_ALL(ld_f16, st_f16, 2) return 0;
    }
    return -1;
}
