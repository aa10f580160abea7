/* Fused RMSNorm with gain and bias for CPU tensors.
 *
 * One row at a time: a vectorised sum of squares in fp32, then one pass that
 * scales, applies the gain and adds the bias. A row is small enough to stay
 * in L1 between the two passes, so the input is read from memory once.
 * Built by enjoyln/ops/cpu.py with -O3 -march=native -fopenmp; no torch
 * headers, so it compiles in about a second.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#define ROW_LOOP(T, LOAD, STORE)                                                        \
    _Pragma("omp parallel for num_threads(threads) schedule(static) if(rows * n >= PARALLEL_MIN)")                   \
    for (int64_t i = 0; i < rows; i++) {                                                \
        const T* xr = x + i * n;                                                        \
        T* yr = y + i * n;                                                              \
        float ss = 0.f;                                                                 \
        _Pragma("omp simd reduction(+:ss)")                                             \
        for (int64_t j = 0; j < n; j++) { float v = LOAD(xr[j]); ss += v * v; }         \
        const float r = 1.0f / sqrtf(ss / (float)n + eps);                              \
        if (w && b) {                                                                   \
            _Pragma("omp simd")                                                         \
            for (int64_t j = 0; j < n; j++) yr[j] = STORE(LOAD(xr[j]) * r * LOAD(w[j]) + LOAD(b[j])); \
        } else if (w) {                                                                 \
            _Pragma("omp simd")                                                         \
            for (int64_t j = 0; j < n; j++) yr[j] = STORE(LOAD(xr[j]) * r * LOAD(w[j])); \
        } else if (b) {                                                                 \
            _Pragma("omp simd")                                                         \
            for (int64_t j = 0; j < n; j++) yr[j] = STORE(LOAD(xr[j]) * r + LOAD(b[j])); \
        } else {                                                                        \
            _Pragma("omp simd")                                                         \
            for (int64_t j = 0; j < n; j++) yr[j] = STORE(LOAD(xr[j]) * r);             \
        }                                                                               \
    }

#define ID(v) (v)
/* Below this many elements, waking a second thread costs more than it saves
 * (PyTorch's CPU kernels use a similar grain). */
#define PARALLEL_MIN 32768

#if defined(__AVX512F__)
#include <immintrin.h>
/* float32 on AVX-512: four independent accumulators, so the sum of squares is
 * not one long chain of dependent multiply-adds. */
void enjoyln_rms_norm_f32(const float* x, const float* w, const float* b, float* y,
                          int64_t rows, int64_t n, float eps, int threads) {
    if (!w || !b) { ROW_LOOP(float, ID, ID) return; }
    _Pragma("omp parallel for num_threads(threads) schedule(static) if(rows * n >= PARALLEL_MIN)")
    for (int64_t i = 0; i < rows; i++) {
        const float* xr = x + i * n;
        float* yr = y + i * n;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        int64_t j = 0;
        for (; j + 64 <= n; j += 64) {
            __m512 v0 = _mm512_loadu_ps(xr + j), v1 = _mm512_loadu_ps(xr + j + 16);
            __m512 v2 = _mm512_loadu_ps(xr + j + 32), v3 = _mm512_loadu_ps(xr + j + 48);
            a0 = _mm512_fmadd_ps(v0, v0, a0); a1 = _mm512_fmadd_ps(v1, v1, a1);
            a2 = _mm512_fmadd_ps(v2, v2, a2); a3 = _mm512_fmadd_ps(v3, v3, a3);
        }
        for (; j + 16 <= n; j += 16) { __m512 v = _mm512_loadu_ps(xr + j); a0 = _mm512_fmadd_ps(v, v, a0); }
        float ss = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
        for (; j < n; j++) ss += xr[j] * xr[j];
        const float r = 1.0f / sqrtf(ss / (float)n + eps);
        const __m512 vr = _mm512_set1_ps(r);
        j = 0;
        for (; j + 16 <= n; j += 16)
            _mm512_storeu_ps(yr + j, _mm512_fmadd_ps(_mm512_mul_ps(_mm512_loadu_ps(xr + j), vr),
                                                     _mm512_loadu_ps(w + j), _mm512_loadu_ps(b + j)));
        for (; j < n; j++) yr[j] = xr[j] * r * w[j] + b[j];
    }
}
#else
void enjoyln_rms_norm_f32(const float* x, const float* w, const float* b, float* y,
                          int64_t rows, int64_t n, float eps, int threads) {
    ROW_LOOP(float, ID, ID)
}
#endif

void enjoyln_rms_norm_bf16(const uint16_t* x, const uint16_t* w, const uint16_t* b, uint16_t* y,
                           int64_t rows, int64_t n, float eps, int threads) {
    ROW_LOOP(uint16_t, bf16_to_f32, f32_to_bf16)
}

#ifdef __FLT16_MAX__
#define F16_TO_F32(v) ((float)(v))
#define F32_TO_F16(v) ((_Float16)(v))
void enjoyln_rms_norm_f16(const _Float16* x, const _Float16* w, const _Float16* b, _Float16* y,
                          int64_t rows, int64_t n, float eps, int threads) {
    ROW_LOOP(_Float16, F16_TO_F32, F32_TO_F16)
}
int enjoyln_has_f16(void) { return 1; }
#else
int enjoyln_has_f16(void) { return 0; }
#endif
