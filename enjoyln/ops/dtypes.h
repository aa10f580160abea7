/* Loads and stores of one element as float64, shared by center.c and rotate.c: a store rounds
 * as torch rounds a float64 (bfloat16 and float16 through float32). Loads and stores go through
 * memcpy: a tensor mapped from a safetensors file need not be aligned. */
#ifndef ENJOYLN_DTYPES_H
#define ENJOYLN_DTYPES_H
#include <stdint.h>
#include <string.h>

enum { F32 = 0, BF16 = 1, F16 = 2, F64 = 3 };

static inline double ld_f32(const void* p, int64_t i) { float f; memcpy(&f, (const char*)p + 4 * i, 4); return (double)f; }
static inline double ld_f64(const void* p, int64_t i) { double d; memcpy(&d, (const char*)p + 8 * i, 8); return d; }
static inline double ld_bf16(const void* p, int64_t i) {
    uint16_t h;
    memcpy(&h, (const char*)p + 2 * i, 2);
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return (double)f;
}
static inline void st_f32(void* p, int64_t i, double v) { float f = (float)v; memcpy((char*)p + 4 * i, &f, 4); }
static inline void st_f64(void* p, int64_t i, double v) { memcpy((char*)p + 8 * i, &v, 8); }
static inline void st_bf16(void* p, int64_t i, double v) {
    float f = (float)v; /* torch rounds a double to float first, then to bfloat16 */
    uint32_t u;
    memcpy(&u, &f, 4);
    uint16_t h;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        h = 0x7fc0;
    } else {
        u += 0x7fffu + ((u >> 16) & 1u);
        h = (uint16_t)(u >> 16);
    }
    memcpy((char*)p + 2 * i, &h, 2);
}
#ifdef __FLT16_MAX__
static inline double ld_f16(const void* p, int64_t i) { _Float16 h; memcpy(&h, (const char*)p + 2 * i, 2); return (double)(float)h; }
static inline void st_f16(void* p, int64_t i, double v) { _Float16 h = (_Float16)(float)v; memcpy((char*)p + 2 * i, &h, 2); }
#define ENJOYLN_HAS_F16 1
#else
static inline double ld_f16(const void* p, int64_t i) { (void)p; (void)i; return 0.0; }
static inline void st_f16(void* p, int64_t i, double v) { (void)p; (void)i; (void)v; }
#define ENJOYLN_HAS_F16 0
#endif

#endif
