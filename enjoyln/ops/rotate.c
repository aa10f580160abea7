/* The structured rotation of the residual stream, applied in float64 in a fixed order.
 *
 * For a width n = k * m (k the largest power of two dividing n, m odd), a vector x
 * (a row vector, x -> x Q) is rotated in four steps:
 *
 *   1. x[i] *= pre[i]                      random signs, times 1/sqrt(k);
 *   2. x[a*m + :] = x[a*m + :] B            an m x m orthogonal block on the odd part, for each a
 *                                           (out[d] = sum over b in order of x[b] B[b][d], each term
 *                                           after the first added by fma, one rounding);
 *   3. the Walsh-Hadamard transform along a (levels h = 1, 2, 4, ... in order, (u, v) -> (u + v, u - v));
 *   4. with w (the keep-mean reflection, w a unit vector): x -= 2 (x . w) w, the dot summed over i in order.
 *
 * Q = S (H_k (x) B) (I - 2 w w^T) is never formed. Each vector is worked on alone, in
 * float64, by one thread, every operation in the order above; vectors are gathered LANES at a
 * time into a buffer [n][LANES] so that vectorising across lanes reorders nothing. The transform's
 * lower levels run on each L1-sized part of the buffer as it is gathered, the higher ones after:
 * every element still goes through the same additions in the same order, only the schedule of
 * independent butterflies changes.
 *
 * Memory is read and written in whole vectors where the layout allows: along rows, four rows
 * four elements at a time, transposed in registers; along strided columns (a weight rotated
 * along its output axis), a panel of up to 256 neighbouring columns is first copied into the
 * thread's own buffer (each strided row visited once per panel, not once per sixteen columns:
 * a page walk each on a tensor larger than the TLB covers), and each row of it read a cache
 * line at a time; without a block, the panel's results are gathered likewise and written out,
 * or compared, row by row.
 *
 * With scale (a norm's gain fused into the weight that reads it), step 0 comes first:
 * x[i] = round(x[i] * scale[i]) to the tensor's dtype, the bits a separate pass of that product
 * rounded into the tensor gives. With
 * -ffp-contract=off (no multiply-add fused into one rounding) the bits do not depend on the
 * layout (rows or strided columns), the number of threads, or the instruction set (AVX2 or
 * AVX-512; fma is correctly rounded wherever it runs, in hardware or in the C library). Results are rounded to the tensor's dtype as torch rounds a float64.
 *
 * The block B and the signs come from enjoyln_rotation_tables: a splitmix64 stream from the
 * seed, normals as sums of twelve uniforms, and a Householder QR in a fixed order, so they are
 * the same bits on every machine (LAPACK's and BLAS's are not).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtypes.h"

#define LANES 4
#define TILE 4 /* items of neighbouring strided vectors gathered together: 16 float32s, one cache line */
#define L1_POSITIONS 512 /* positions whose lower transform levels run while they sit in L1: 16 KiB of lanes */
#define PARALLEL_MIN 262144
#define PANEL_BYTES (2 << 20) /* a panel's copy: in L3, its rows within a few hundred pages */
#define PANEL_MAX 256

static uint64_t splitmix(uint64_t* s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double normal(uint64_t* s) {
    double t = 0.0;
    for (int i = 0; i < 12; i++) t += (double)(splitmix(s) >> 11) * 0x1.0p-53;
    return t - 6.0;
}

/* Rows j.. and columns c0.. of the m x m matrix a times I - beta v v^T from the left: for each column c,
 * dot[c] = sum over i = j.. in order of v[i] a[i][c], then a[i][c] -= (beta dot[c]) v[i]; row by row, so
 * that the loops run along memory. */
static void reflect(double* a, const double* v, double beta, double* dot, int64_t j, int64_t c0, int64_t m) {
    for (int64_t c = c0; c < m; c++) dot[c] = 0.0;
    for (int64_t i = j; i < m; i++)
        for (int64_t c = c0; c < m; c++) dot[c] += v[i] * a[i * m + c];
    for (int64_t c = c0; c < m; c++) dot[c] = beta * dot[c];
    for (int64_t i = j; i < m; i++)
        for (int64_t c = c0; c < m; c++) a[i * m + c] -= dot[c] * v[i];
}

/* signs: n entries of +-1; block: an m x m orthogonal matrix, block[b * m + d]. */
int enjoyln_rotation_tables(int64_t n, int64_t m, uint64_t seed, double* signs, double* block) {
    uint64_t s = seed;
    for (int64_t i = 0; i < n; i++) signs[i] = (splitmix(&s) >> 63) ? -1.0 : 1.0;
    if (m < 1) return -1;
    if (m == 1) { /* no odd part: the kernel skips the block */
        block[0] = 1.0;
        return 0;
    }
    double* a = malloc((size_t)(m * m) * sizeof(double));
    double* v = malloc((size_t)(m * m) * sizeof(double)); /* Householder vector j in row j, from index j */
    double* beta = malloc((size_t)m * sizeof(double));
    double* dot = malloc((size_t)m * sizeof(double));
    if (!a || !v || !beta || !dot) {
        free(a), free(v), free(beta), free(dot);
        return -2;
    }
    for (int64_t i = 0; i < m * m; i++) a[i] = normal(&s);
    for (int64_t j = 0; j < m; j++) {
        double norm2 = 0.0;
        for (int64_t i = j; i < m; i++) norm2 += a[i * m + j] * a[i * m + j];
        double alpha = sqrt(norm2);
        if (a[j * m + j] > 0) alpha = -alpha;
        double vn2 = 0.0;
        for (int64_t i = j; i < m; i++) {
            const double vi = i == j ? a[i * m + j] - alpha : a[i * m + j];
            v[j * m + i] = vi;
            vn2 += vi * vi;
        }
        beta[j] = vn2 > 0 ? 2.0 / vn2 : 0.0;
        reflect(a, v + j * m, beta[j], dot, j, j, m);
    }
    for (int64_t i = 0; i < m * m; i++) block[i] = (i / m == i % m) ? 1.0 : 0.0;
    for (int64_t j = m - 1; j >= 0; j--) reflect(block, v + j * m, beta[j], dot, j, 0, m); /* Q = H_0 ... H_{m-1} */
    for (int64_t j = 0; j < m; j++) /* R's diagonal made positive: Q Haar-distributed for normal entries */
        if (a[j * m + j] < 0)
            for (int64_t i = 0; i < m; i++) block[i * m + j] = -block[i * m + j];
    free(a), free(v), free(beta), free(dot);
    return 0;
}

/* LANES doubles, one from each vector: every operation on it is lane by lane (GCC's vector
 * extension), so it reorders no sum, whatever instructions carry it. */
typedef double lanes __attribute__((vector_size(LANES * sizeof(double))));

/* acc + x c for every lane, with one rounding (fma is exact by definition on every machine: the same bits
 * whether the hardware fuses it or the C library does). */
static inline lanes fma_lanes(lanes x, double c, lanes acc) {
    lanes out;
    for (int l = 0; l < LANES; l++) out[l] = __builtin_fma(x[l], c, acc[l]);
    return out;
}

/* x[a*m + :] B for one a, from xt[m] into y[m]. bt is B transposed: bt[d * m + b]. Eight outputs at a
 * time, then four, then one, each its own sum in order of b (acc = x[0] c[0], then acc = fma(x[b], c[b],
 * acc)), so that eight chains overlap the multiply-add's latency; how many run side by side changes no
 * output's order. */
static void mix_one(lanes* restrict y, const lanes* restrict xt, const double* restrict bt, int64_t m) {
    int64_t d = 0;
    for (; d + 8 <= m; d += 8) {
        const double* c[8];
        lanes a[8];
        for (int j = 0; j < 8; j++) c[j] = bt + (d + j) * m, a[j] = xt[0] * c[j][0];
        for (int64_t b = 1; b < m; b++) {
            const lanes x = xt[b];
            for (int j = 0; j < 8; j++) a[j] = fma_lanes(x, c[j][b], a[j]);
        }
        for (int j = 0; j < 8; j++) y[d + j] = a[j];
    }
    for (; d + 4 <= m; d += 4) {
        const double *c0 = bt + d * m, *c1 = c0 + m, *c2 = c1 + m, *c3 = c2 + m;
        lanes a0 = xt[0] * c0[0], a1 = xt[0] * c1[0], a2 = xt[0] * c2[0], a3 = xt[0] * c3[0];
        for (int64_t b = 1; b < m; b++) {
            const lanes x = xt[b];
            a0 = fma_lanes(x, c0[b], a0);
            a1 = fma_lanes(x, c1[b], a1);
            a2 = fma_lanes(x, c2[b], a2);
            a3 = fma_lanes(x, c3[b], a3);
        }
        y[d] = a0, y[d + 1] = a1, y[d + 2] = a2, y[d + 3] = a3;
    }
    for (; d < m; d++) {
        const double* c = bt + d * m;
        lanes acc = xt[0] * c[0];
        for (int64_t b = 1; b < m; b++) acc = fma_lanes(xt[b], c[b], acc);
        y[d] = acc;
    }
}

/* u and v kept in registers: GCC would fold a load of each into every multiply-add that reads them
 * (a vector of lanes fits one register only with AVX). */
#if defined(__AVX__)
#define HOLD(u, v) __asm__("" : "+x"(u), "+x"(v))
#else
#define HOLD(u, v) ((void)0)
#endif

/* Outputs d .. d + t of two positions at once (x0 -> y0, x1 -> y1), every chain as mix_one runs it: each
 * coefficient loaded once for two multiply-adds, and 2 t chains side by side (t a constant once inlined). */
static inline void mix_two_outputs(lanes* restrict y0, lanes* restrict y1, const lanes* restrict x0,
                                   const lanes* restrict x1, const double* restrict bt, int64_t m, int64_t d,
                                   int t) {
    const double* c[4];
    lanes a0[4], a1[4];
    for (int j = 0; j < t; j++) c[j] = bt + (d + j) * m, a0[j] = x0[0] * c[j][0], a1[j] = x1[0] * c[j][0];
    for (int64_t b = 1; b < m; b++) {
        lanes u = x0[b], v = x1[b];
        HOLD(u, v);
        for (int j = 0; j < t; j++) {
            const double cj = c[j][b];
            a0[j] = fma_lanes(u, cj, a0[j]);
            a1[j] = fma_lanes(v, cj, a1[j]);
        }
    }
    for (int j = 0; j < t; j++) y0[d + j] = a0[j], y1[d + j] = a1[j];
}

/* Outputs d .. d + t of g neighbouring positions (x + p m -> y + p m), t g <= 8 chains side by side,
 * each as mix_one runs it (t and g constants once inlined). */
static inline void mix_across(lanes* restrict y, const lanes* restrict x, const double* restrict bt, int64_t m,
                              int64_t d, int t, int g) {
    lanes acc[8];
    for (int j = 0; j < t; j++)
        for (int p = 0; p < g; p++) acc[j * g + p] = x[p * m] * bt[(d + j) * m];
    for (int64_t b = 1; b < m; b++)
        for (int j = 0; j < t; j++) {
            const double cj = bt[(d + j) * m + b];
            for (int p = 0; p < g; p++) acc[j * g + p] = fma_lanes(x[p * m + b], cj, acc[j * g + p]);
        }
    for (int j = 0; j < t; j++)
        for (int p = 0; p < g; p++) y[p * m + d + j] = acc[j * g + p];
}

/* The last m % 4 outputs (m is odd: one or three) of count positions, eight or two positions at a time
 * where they are there. */
static void mix_tail(lanes* restrict y, const lanes* restrict x, const double* restrict bt, int64_t m, int64_t count) {
    const int64_t d = m - m % 4;
    int64_t a = 0;
    switch (m % 4) {
        case 1:
            for (; a + 8 <= count; a += 8) mix_across(y + a * m, x + a * m, bt, m, d, 1, 8);
            for (; a + 2 <= count; a += 2) mix_across(y + a * m, x + a * m, bt, m, d, 1, 2);
            break;
        case 3:
            for (; a + 2 <= count; a += 2) mix_across(y + a * m, x + a * m, bt, m, d, 3, 2);
            break;
    }
    for (; a < count && m % 4; a++)
        for (int64_t e = d; e < m; e++) mix_across(y + a * m, x + a * m, bt, m, e, 1, 1);
}

/* x[a*m + :] B for the count positions a from xt[count * m] into y[count * m]: two positions at a time,
 * four outputs of each per pass (six loads for eight multiply-adds, where one position alone needs nine),
 * then the last outputs across several positions; each output the same chain as mix_one's. */
static void mix_lanes(lanes* restrict y, const lanes* restrict xt, const double* restrict bt, int64_t m,
                      int64_t count) {
    if (count == 1) {
        mix_one(y, xt, bt, m);
        return;
    }
    int64_t a = 0;
    for (; a + 2 <= count; a += 2)
        for (int64_t d = 0; d + 4 <= m; d += 4) mix_two_outputs(y + a * m, y + (a + 1) * m, xt + a * m,
                                                                xt + (a + 1) * m, bt, m, d, 4);
    for (; a < count; a++)
        for (int64_t d = 0; d + 4 <= m; d += 4) mix_across(y + a * m, xt + a * m, bt, m, d, 4, 1);
    mix_tail(y, xt, bt, m, count);
}

/* Levels h = h0, 2 h0, ... below k of the Walsh-Hadamard transform along a on y[k][m], in order:
 * (u, v) -> (u + v, u - v). Three levels per pass over the buffer where they group (eight vectors in
 * registers), else two, else one: the same additions on every element, in the same order, as one level
 * at a time. Four levels left go as two pairs, not three and one: a pass of one level does the most loads
 * and stores per addition (measured slower at width 1600). */
static void hadamard_lanes(lanes* restrict y, int64_t k, int64_t m, int64_t h0) {
    int64_t h = h0;
    for (; 8 * h <= k && 16 * h != k; h <<= 3)
        for (int64_t a0 = 0; a0 < k; a0 += 8 * h)
            for (int64_t a = a0; a < a0 + h; a++) {
                lanes* restrict p[8];
                for (int r = 0; r < 8; r++) p[r] = y + (a + r * h) * m;
                for (int64_t e = 0; e < m; e++) {
                    lanes x[8], u[8];
                    for (int r = 0; r < 8; r++) x[r] = p[r][e];
                    for (int r = 0; r < 8; r += 2) u[r] = x[r] + x[r + 1], u[r + 1] = x[r] - x[r + 1];
                    for (int r = 0; r < 8; r += 4)
                        for (int s = 0; s < 2; s++) x[r + s] = u[r + s] + u[r + s + 2], x[r + s + 2] = u[r + s] - u[r + s + 2];
                    for (int r = 0; r < 4; r++) p[r][e] = x[r] + x[r + 4], p[r + 4][e] = x[r] - x[r + 4];
                }
            }
    for (; 4 * h <= k; h <<= 2)
        for (int64_t a0 = 0; a0 < k; a0 += 4 * h)
            for (int64_t a = a0; a < a0 + h; a++) {
                lanes* restrict p0 = y + a * m;
                lanes* restrict p1 = y + (a + h) * m;
                lanes* restrict p2 = y + (a + 2 * h) * m;
                lanes* restrict p3 = y + (a + 3 * h) * m;
                for (int64_t e = 0; e < m; e++) {
                    const lanes x0 = p0[e], x1 = p1[e], x2 = p2[e], x3 = p3[e];
                    const lanes s0 = x0 + x1, d0 = x0 - x1, s1 = x2 + x3, d1 = x2 - x3;
                    p0[e] = s0 + s1;
                    p2[e] = s0 - s1;
                    p1[e] = d0 + d1;
                    p3[e] = d0 - d1;
                }
            }
    for (; h < k; h <<= 1)
        for (int64_t a0 = 0; a0 < k; a0 += 2 * h)
            for (int64_t a = a0; a < a0 + h; a++) {
                lanes* restrict p = y + a * m;
                lanes* restrict q = y + (a + h) * m;
                for (int64_t e = 0; e < m; e++) {
                    const lanes u = p[e], x = q[e];
                    p[e] = u + x;
                    q[e] = u - x;
                }
            }
}

/* c[q] = 2 (y_q . w) per lane for the nq buffers y_q = y + q n, each summed over i in order; zero without w.
 * The items' sums run side by side, so that each waits on its own additions only. */
static void twice_dots(lanes* c, const lanes* y, const double* w, int64_t n, int nq) {
    lanes acc[TILE] = {{0}};
    if (w) {
        if (nq == TILE)
            for (int64_t i = 0; i < n; i++)
                for (int q = 0; q < TILE; q++) acc[q] += y[q * n + i] * w[i];
        else
            for (int64_t i = 0; i < n; i++)
                for (int q = 0; q < nq; q++) acc[q] += y[q * n + i] * w[i];
    }
    for (int q = 0; q < nq; q++) c[q] = acc[q] + acc[q];
}

/* Four float32s, and four 16-bit words, as one vector; unaligned where a mapped file puts them. */
typedef float f4 __attribute__((vector_size(16), aligned(4)));
typedef uint32_t u4 __attribute__((vector_size(16), aligned(4)));
typedef uint16_t h4 __attribute__((vector_size(8), aligned(2)));
typedef int64_t i4 __attribute__((vector_size(32)));

/* Four neighbouring elements from index i as the lanes of a vector, and back, each lane exactly as ld_*
 * and st_* treat it (conversions between float64, float32 and the 16-bit formats are exact or correctly
 * rounded lane by lane, whatever instructions carry them). */
static inline lanes ldv_f32(const void* p, int64_t i) {
    f4 f;
    memcpy(&f, (const char*)p + 4 * i, 16);
    return __builtin_convertvector(f, lanes);
}
static inline lanes ldv_f64(const void* p, int64_t i) {
    lanes v;
    memcpy(&v, (const char*)p + 8 * i, 32);
    return v;
}
static inline lanes ldv_bf16(const void* p, int64_t i) {
    h4 h;
    memcpy(&h, (const char*)p + 2 * i, 8);
    const u4 u = __builtin_convertvector(h, u4) << 16;
    f4 f;
    memcpy(&f, &u, 16);
    return __builtin_convertvector(f, lanes);
}
static inline lanes ldv_f16(const void* p, int64_t i) {
    lanes v;
    for (int l = 0; l < LANES; l++) v[l] = ld_f16(p, i + l);
    return v;
}
/* v rounded to float32 then bfloat16 (ties to even, a NaN to the quiet one), as st_bf16 does. */
static inline h4 bf16_bits(lanes v) {
    const f4 f = __builtin_convertvector(v, f4);
    u4 u;
    memcpy(&u, &f, 16);
    const u4 nan = (u & 0x7fffffffu) > 0x7f800000u;
    const u4 r = ((u + 0x7fffu + ((u >> 16) & 1u)) >> 16 & ~nan) | (0x7fc0u & nan);
    return __builtin_convertvector(r, h4);
}
static inline void stv_f32(void* p, int64_t i, lanes v) {
    const f4 f = __builtin_convertvector(v, f4);
    memcpy((char*)p + 4 * i, &f, 16);
}
static inline void stv_f64(void* p, int64_t i, lanes v) { memcpy((char*)p + 8 * i, &v, 32); }
static inline void stv_bf16(void* p, int64_t i, lanes v) {
    const h4 h = bf16_bits(v);
    memcpy((char*)p + 2 * i, &h, 8);
}
static inline void stv_f16(void* p, int64_t i, lanes v) {
    for (int l = 0; l < LANES; l++) st_f16(p, i + l, v[l]);
}

/* Each lane of v times s, rounded to the dtype and back to float64: the bits a store of the product and a
 * load of it give. The conversions are explicit vector conversions, which the compiler must keep (GCC 12
 * at -O3 dropped a float32 round trip it vectorized from scalar code). */
static inline lanes sc_f32(lanes v, double s) { return __builtin_convertvector(__builtin_convertvector(v * s, f4), lanes); }
static inline lanes sc_f64(lanes v, double s) { return v * s; }
static inline lanes sc_bf16(lanes v, double s) {
    const u4 u = __builtin_convertvector(bf16_bits(v * s), u4) << 16;
    f4 f;
    memcpy(&f, &u, 16);
    return __builtin_convertvector(f, lanes);
}
static inline lanes sc_f16(lanes v, double s) {
    volatile double p[LANES]; /* through memory, one lane at a time, for the reason above */
    for (int l = 0; l < LANES; l++) {
        uint16_t h;
        st_f16(&h, 0, v[l] * s);
        p[l] = ld_f16(&h, 0);
    }
    for (int l = 0; l < LANES; l++) v[l] = p[l];
    return v;
}

/* The 4 x 4 block r[0..3] (rows) transposed in place: lane l of r[j] becomes lane j of r[l]. */
static inline void transpose(lanes* r) {
    const i4 lo = {0, 4, 2, 6}, hi = {1, 5, 3, 7}, first = {0, 1, 4, 5}, second = {2, 3, 6, 7};
    const lanes a = __builtin_shuffle(r[0], r[1], lo), b = __builtin_shuffle(r[0], r[1], hi);
    const lanes c = __builtin_shuffle(r[2], r[3], lo), d = __builtin_shuffle(r[2], r[3], hi);
    r[0] = __builtin_shuffle(a, c, first), r[1] = __builtin_shuffle(b, d, first);
    r[2] = __builtin_shuffle(a, c, second), r[3] = __builtin_shuffle(b, d, second);
}

/* Positions i0 .. i0 + count of item q (its lanes at off[q][]) loaded into v[0 .. count]: four rows read
 * four positions at a time and transposed; four neighbouring columns read as one vector; else (a short item
 * of columns, the tail) one element at a time. A short item of rows repeats its first row in the lanes it
 * lacks, which SCATTER never writes. */
#define LOAD(LD, LDV, q, v, i0, count)                                                       \
    {                                                                                        \
        int64_t j = 0;                                                                       \
        if (inner == 1)                                                                      \
            for (; j + LANES <= count; j += LANES) {                                         \
                for (int l = 0; l < LANES; l++) v[j + l] = LDV(lsrc, loff[q][l] + i0 + j);     \
                transpose(v + j);                                                            \
            }                                                                                \
        else if (wl[q] == LANES)                                                             \
            for (; j < count; j++) v[j] = LDV(lsrc, loff[q][0] + (i0 + j) * lstep);             \
        for (; j < count; j++)                                                               \
            for (int l = 0; l < LANES; l++) v[j][l] = LD(lsrc, loff[q][l] + (i0 + j) * lstep);  \
    }

/* Where positions a0 .. a0 + kb of item q are loaded: its buffer y + q n itself, or xt where the block has
 * to mix them. */
#define STAGE(q, a0) (m == 1 ? y + q * n + a0 : xt)

/* Positions a0 .. a0 + kb of item q, loaded, into its buffer: scale, signs, block, lower transform levels. */
#define FINISH(SC, q, a0)                                                                    \
    {                                                                                        \
        lanes* yq = y + q * n;                                                               \
        lanes* v = STAGE(q, a0);                                                             \
        const int64_t i0 = a0 * m, count = kb * m;                                           \
        for (int64_t j = 0; j < count; j++)                                                  \
            v[j] = (scale ? SC(v[j], scale[i0 + j]) : v[j]) * pre[i0 + j];                   \
        if (m > 1)                                                                           \
            mix_lanes(yq + a0 * m, v, bt, m, kb);                                           \
        hadamard_lanes(yq + a0 * m, kb, m, 1);                                               \
    }

/* Positions a0 .. a0 + kb of every item of the tile. Where the items are TILE whole runs of neighbouring
 * columns and need no block, each row's TILE * LANES elements (a cache line of float32) are read at once
 * into the items' buffers; else each item is loaded and finished in turn, while its part of xt is in L1. */
#define GATHER(LD, LDV, SC, a0)                                                              \
    {                                                                                        \
        const int64_t i0 = a0 * m, count = kb * m;                                           \
        if (m == 1 && inner > 1 && nq == TILE && wl[TILE - 1] == LANES) {                    \
            for (int64_t j = 0; j < count; j++)                                              \
                for (int q = 0; q < TILE; q++)                                               \
                    STAGE(q, a0)[j] = LDV(lsrc, loff[q][0] + (i0 + j) * lstep);             \
            for (int q = 0; q < nq; q++) FINISH(SC, q, a0)                                   \
        } else                                                                               \
            for (int q = 0; q < nq; q++) {                                                   \
                lanes* v = STAGE(q, a0);                                                     \
                LOAD(LD, LDV, q, v, i0, count)                                               \
                FINISH(SC, q, a0)                                                            \
            }                                                                                \
    }

/* v (count elements from index at) as its dtype would store it: written to sdst, or compared with scand. */
#define EMIT(STORE, SIZE, v, at, count)                                                      \
    {                                                                                        \
        const int64_t at_ = (at);                                                            \
        if (!scand) STORE(sdst, at_, v);                                                     \
        else {                                                                               \
            unsigned char out_[LANES * 8];                                                   \
            STORE(out_, 0, v);                                                               \
            if (memcmp(out_, (const char*)scand + at_ * SIZE, (count) * SIZE)) differ = 1;   \
        }                                                                                    \
    }

/* The vector r[j] (positions i0 + j across item q's lanes) as its dtype would store it, compared with cand
 * or written: where four rows or four neighbouring columns allow, as whole vectors. */
#define PUT(ST, STV, SIZE, q, r, i0, count)                                                  \
    {                                                                                        \
        int64_t j = 0;                                                                       \
        if (inner == 1)                                                                      \
            for (; j + LANES <= count; j += LANES) {                                         \
                lanes t[LANES] = {r[j], r[j + 1], r[j + 2], r[j + 3]};                       \
                transpose(t);                                                                \
                for (int l = 0; l < wl[q]; l++) EMIT(STV, SIZE, t[l], soff[q][l] + i0 + j, LANES) \
            }                                                                                \
        else if (wl[q] == LANES)                                                             \
            for (; j < count; j++) EMIT(STV, SIZE, r[j], soff[q][0] + (i0 + j) * sstep, LANES) \
        for (; j < count; j++)                                                               \
            for (int l = 0; l < wl[q]; l++) EMIT(ST, SIZE, r[j][l], soff[q][l] + (i0 + j) * sstep, 1) \
    }

/* Positions i0 .. i1 of item q written (or compared with cand): the reflection applied, then stored. */
#define SCATTER(ST, STV, SIZE, q, i0, i1)                                                    \
    {                                                                                        \
        lanes* yq = y + q * n;                                                               \
        if (w)                                                                               \
            for (int64_t i = i0; i < i1; i++) yq[i] = yq[i] - c[q] * w[i];                   \
        PUT(ST, STV, SIZE, q, (yq + i0), i0, (i1 - i0))                                      \
    }

/* The items of one tile, each rotated on its own; their gathers and scatters interleaved a block of
 * positions at a time, so that the cache lines and pages of strided vectors are read and written once. */
#define ROTATE_TILE(LD, LDV, SC, ST, STV, SIZE)                                                        \
    {                                                                                        \
        for (int64_t a0 = 0; a0 < k; a0 += kb) GATHER(LD, LDV, SC, a0)                       \
        lanes c[TILE];                                                                       \
        for (int q = 0; q < nq; q++) hadamard_lanes(y + q * n, k, m, kb);                    \
        twice_dots(c, y, w, n, nq);                                                          \
        for (int64_t i0 = 0; i0 < n; i0 += L1_POSITIONS)                                     \
            for (int q = 0; q < nq; q++) SCATTER(ST, STV, SIZE, q, i0, (i0 + L1_POSITIONS < n ? i0 + L1_POSITIONS : n)) \
    }

#define TILE_BY_DTYPE                                                                        \
    switch (dtype) {                                                                         \
        case F32: ROTATE_TILE(ld_f32, ldv_f32, sc_f32, st_f32, stv_f32, 4) break;            \
        case F64: ROTATE_TILE(ld_f64, ldv_f64, sc_f64, st_f64, stv_f64, 8) break;            \
        case BF16: ROTATE_TILE(ld_bf16, ldv_bf16, sc_bf16, st_bf16, stv_bf16, 2) break;      \
        case F16: ROTATE_TILE(ld_f16, ldv_f16, sc_f16, st_f16, stv_f16, 2) break;            \
    }

/* Rotate the vectors of the slice at src (a tensor seen as [outer, n, inner], outer_stride elements
 * between outer indices, the rotated axis in the middle) into dst (in place: dst == src; else dst has
 * src's layout), or compare them with cand (dst unused). pre: n doubles; block: m x m (NULL where m == 1);
 * w: n doubles or NULL; scale: n doubles or NULL (step 0 above).
 * Returns 0 (written, or equal to cand), 1 (cand differs), -1 (unknown dtype), -2 (no memory). */
int enjoyln_rotate_scaled_into(const void* src, void* dst, const void* cand, int dtype, int64_t outer,
                               int64_t outer_stride, int64_t n, int64_t inner, int64_t k, int64_t m,
                               const double* pre, const double* block, const double* w, const double* scale,
                               int threads) {
    if (n <= 0 || outer <= 0 || inner <= 0) return 0;
    if (dtype < F32 || dtype > F64 || k * m != n) return -1;
    /* an item: LANES vectors; a tile: up to TILE items of neighbouring columns (one item for rows); a panel
     * (columns): up to `panel` neighbouring columns copied whole into the thread's own buffer first, so that
     * each strided row is visited once per panel, not once per tile (a page walk each, on a tensor larger
     * than the TLB covers) */
    const int64_t esize = dtype == F64 ? 8 : dtype == F32 ? 4 : 2;
    int64_t panel = PANEL_BYTES / (n * esize) / (TILE * LANES) * (TILE * LANES);
    panel = panel > PANEL_MAX ? PANEL_MAX : panel < TILE * LANES ? TILE * LANES : panel;
    if (panel > inner) panel = inner;
    const int64_t per_outer = (inner + panel - 1) / panel, step = inner;
    const int64_t jobs = inner == 1 ? (outer + TILE * LANES - 1) / (TILE * LANES) : outer * per_outer;
    int64_t kb = 1; /* the lower levels: a power of two dividing k, kb * m positions within L1_POSITIONS */
    while (2 * kb <= k && 2 * kb * m <= L1_POSITIONS) kb <<= 1;
    int differ = 0, failed = 0;
    _Pragma("omp parallel num_threads(threads) reduction(|:differ, failed) if(outer * n * inner >= PARALLEL_MIN)")
    {
        lanes* y = aligned_alloc(64, (size_t)(TILE * n) * sizeof(lanes));
        lanes* xt = aligned_alloc(64, (size_t)(kb * m) * sizeof(lanes));
        double* bt = malloc((size_t)(m * m) * sizeof(double));
        char* copy = inner == 1 ? NULL : aligned_alloc(64, (size_t)(n * panel * esize + 64) / 64 * 64);
        char* out = inner == 1 ? NULL : aligned_alloc(64, (size_t)(n * panel * esize + 64) / 64 * 64);
        if (!y || !xt || !bt || (inner > 1 && (!copy || !out))) failed = 1;
        else
            for (int64_t d = 0; d < m; d++)
                for (int64_t b = 0; b < m; b++) bt[d * m + b] = m == 1 ? 1.0 : block[b * m + d];
        _Pragma("omp for schedule(static)")
        for (int64_t job = 0; job < jobs; job++) {
            if (failed) continue;
            int64_t off[TILE][LANES], loff[TILE][LANES];
            int wl[TILE], nq;
            if (inner == 1) { /* up to TILE items of LANES rows, read and written where they lie */
                const int64_t o0 = job * TILE * LANES;
                const void* lsrc = src;
                const int64_t lstep = 1, sstep = 1;
                void* sdst = dst;
                const void* scand = cand;
                int64_t(*soff)[LANES] = off;
                const int64_t rows = outer - o0 < TILE * LANES ? outer - o0 : TILE * LANES;
                nq = (int)((rows + LANES - 1) / LANES);
                for (int q = 0; q < nq; q++) {
                    wl[q] = rows - q * LANES < LANES ? (int)(rows - q * LANES) : LANES;
                    for (int l = 0; l < LANES; l++)
                        loff[q][l] = off[q][l] = (o0 + q * LANES + (l < wl[q] ? l : 0)) * outer_stride;
                }
                TILE_BY_DTYPE
                continue;
            }
            const int64_t o = job / per_outer, c0 = (job % per_outer) * panel;
            const int64_t pc = inner - c0 < panel ? inner - c0 : panel;
            const char* from = (const char*)src + (o * outer_stride + c0) * esize;
            for (int64_t i = 0; i < n; i++) memcpy(copy + i * pc * esize, from + i * inner * esize, pc * esize);
            const void* lsrc = copy;
            /* without a block, the panel's results are gathered in `out` and written (or compared) row by
             * row after; with one, the arithmetic outweighs the strided stores, and they go straight out */
            const int gathered = m == 1;
            void* sdst = gathered ? (void*)out : dst;
            const void* scand = gathered ? NULL : cand;
            int64_t(*soff)[LANES] = gathered ? loff : off;
            const int64_t lstep = pc, sstep = gathered ? pc : step, lane_blocks = (pc + LANES - 1) / LANES;
            for (int64_t b0 = 0; b0 < lane_blocks; b0 += TILE) {
                nq = lane_blocks - b0 < TILE ? (int)(lane_blocks - b0) : TILE;
                for (int q = 0; q < nq; q++) {
                    const int64_t j0 = (b0 + q) * LANES;
                    wl[q] = pc - j0 < LANES ? (int)(pc - j0) : LANES;
                    for (int l = 0; l < LANES; l++) {
                        loff[q][l] = j0 + (l < wl[q] ? l : 0);
                        off[q][l] = o * outer_stride + c0 + loff[q][l];
                    }
                }
                TILE_BY_DTYPE
            }
            char* to = (char*)(cand ? (void*)(uintptr_t)cand : dst) + (o * outer_stride + c0) * esize;
            for (int64_t i = 0; i < n && gathered; i++) {
                if (!cand) memcpy(to + i * inner * esize, out + i * pc * esize, pc * esize);
                else if (memcmp(to + i * inner * esize, out + i * pc * esize, pc * esize)) differ = 1;
            }
        }
        free(y), free(xt), free(bt), free(copy), free(out);
    }
    return failed ? -2 : differ;
}

/* enjoyln_rotate_scaled_into without a scale. */
int enjoyln_rotate_into(const void* src, void* dst, const void* cand, int dtype, int64_t outer, int64_t outer_stride,
                        int64_t n, int64_t inner, int64_t k, int64_t m, const double* pre, const double* block,
                        const double* w, int threads) {
    return enjoyln_rotate_scaled_into(src, dst, cand, dtype, outer, outer_stride, n, inner, k, m, pre, block, w,
                                      NULL, threads);
}

int enjoyln_rotate_has_f16(void) { return ENJOYLN_HAS_F16; }

/* The fused bias's product W beta, in a fixed order: for each vector of the slice at src (seen as
 * [outer, n, inner] as above), out[o * inner + j] = x[0] beta[0], then fma(x[i], beta[i], acc) for
 * i = 1 .. n - 1 in order, in float64. Each output is one thread's chain, whatever the thread count;
 * the loop runs along memory (rows of [n, inner]) with independent chains side by side, so
 * vectorising it reorders nothing. BLAS's reduction order depends on the machine; this one does not.
 * Returns 0, or -1 for an unknown dtype. */
#define DOT_ROWS(LD)                                                                         \
    _Pragma("omp parallel for num_threads(threads) schedule(static) if(outer * n * inner >= PARALLEL_MIN)") \
    for (int64_t t = 0; t < tiles; t++) {                                                    \
        const int64_t o = t / per_outer, j0 = (t % per_outer) * DOT_COLUMNS;                 \
        const int64_t j1 = j0 + DOT_COLUMNS < inner ? j0 + DOT_COLUMNS : inner;              \
        const int64_t base = o * outer_stride;                                               \
        double* acc = out + o * inner;                                                       \
        for (int64_t j = j0; j < j1; j++) acc[j] = LD(src, base + j) * beta[0];              \
        for (int64_t i = 1; i < n; i++) {                                                    \
            const double b = beta[i];                                                        \
            const int64_t row = base + i * inner;                                            \
            for (int64_t j = j0; j < j1; j++) acc[j] = __builtin_fma(LD(src, row + j), b, acc[j]); \
        }                                                                                    \
    }

#define DOT_CHAINS(LD)                                                                       \
    _Pragma("omp parallel for num_threads(threads) schedule(static) if(outer * n >= PARALLEL_MIN)") \
    for (int64_t o0 = 0; o0 < outer; o0 += LANES) {                                          \
        const int64_t w = outer - o0 < LANES ? outer - o0 : LANES;                           \
        lanes acc = {0};                                                                     \
        for (int l = 0; l < w; l++) acc[l] = LD(src, (o0 + l) * outer_stride) * beta[0];     \
        for (int64_t i = 1; i < n; i++)                                                      \
            for (int l = 0; l < w; l++)                                                      \
                acc[l] = __builtin_fma(LD(src, (o0 + l) * outer_stride + i), beta[i], acc[l]); \
        for (int l = 0; l < w; l++) out[o0 + l] = acc[l];                                    \
    }

#define DOT_COLUMNS 256 /* outputs one thread carries along the rows of a strided slice: 2 KiB */

int enjoyln_dot_vectors(const void* src, int dtype, int64_t outer, int64_t outer_stride, int64_t n,
                        int64_t inner, const double* beta, double* out, int threads) {
    if (n <= 0 || outer <= 0 || inner <= 0) return 0;
    if (dtype < F32 || dtype > F64) return -1;
    const int64_t per_outer = (inner + DOT_COLUMNS - 1) / DOT_COLUMNS, tiles = outer * per_outer;
    if (inner == 1) {
        switch (dtype) {
            case F32: DOT_CHAINS(ld_f32) break;
            case F64: DOT_CHAINS(ld_f64) break;
            case BF16: DOT_CHAINS(ld_bf16) break;
            case F16: DOT_CHAINS(ld_f16) break;
        }
    } else {
        switch (dtype) {
            case F32: DOT_ROWS(ld_f32) break;
            case F64: DOT_ROWS(ld_f64) break;
            case BF16: DOT_ROWS(ld_bf16) break;
            case F16: DOT_ROWS(ld_f16) break;
        }
    }
    return 0;
}
