/* The product of a few rows by a float32 matrix packed for it: y (rows, n) = x (rows, k) w^T, w (n, k).
 *
 * The packed matrix interleaves w two output rows at a time: for each pair (2t, 2t + 1), k / LANES steps of
 * LANES values of row 2t then LANES values of row 2t + 1 (client/rows_kernel.py packs it, padding k to a multiple
 * of LANES and n to an even number with zeros). A product then reads the matrix once, front to back, for up to
 * ROWS_PER_PASS rows at a time, so it runs at about the speed the CPU streams memory; a row-major matrix read two
 * or more rows at once does not. (The CPU's own prefetcher follows the one stream: prefetching in software slowed
 * it here.)
 *
 * Each output is summed in the same order whatever the number of rows: lane by lane over k, then the lanes as a
 * tree. A row's result is therefore the same, bit for bit, alone or among others.
 *
 * One portable build holds a variant per vector width: 4 floats (any CPU), and on x86-64 with GCC also 8 (AVX2 and
 * FMA) and 16 (AVX-512); rows_lanes() names the widest this CPU runs, and rows_product() uses it. The file is built
 * when the package is installed (pyproject.toml) and includes itself once per variant: the part below `#else` is
 * the body, compiled with LANES, ROWS_PER_PASS and NAME() set by the part above.
 */
#ifndef LANES

#include <stddef.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define WIDE_VARIANTS 1
#else
#define WIDE_VARIANTS 0
#endif

#define LANES 4
#define ROWS_PER_PASS 4
#define NAME(x) x##_4
#include "rows_kernel.c"
#undef LANES
#undef ROWS_PER_PASS
#undef NAME

#if WIDE_VARIANTS
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define LANES 8
#define ROWS_PER_PASS 4 /* 8 accumulators of 16 vector registers */
#define NAME(x) x##_8
#include "rows_kernel.c"
#undef LANES
#undef ROWS_PER_PASS
#undef NAME
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f")
#define LANES 16
#define ROWS_PER_PASS 8 /* 16 accumulators of 32 vector registers */
#define NAME(x) x##_16
#include "rows_kernel.c"
#undef LANES
#undef ROWS_PER_PASS
#undef NAME
#pragma GCC pop_options
#endif

typedef int (*product_fn)(const float *, long, const float *, long, long, float *, long, long);

/* whether this CPU runs the variant of `lanes` floats (4, 8 or 16) */
int rows_supports(int lanes) {
    if (lanes == 4) return 1;
#if WIDE_VARIANTS
    __builtin_cpu_init();
    if (lanes == 8) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (lanes == 16) return __builtin_cpu_supports("avx512f");
#endif
    return 0;
}

/* the widest variant this CPU runs */
int rows_lanes(void) { return rows_supports(16) ? 16 : rows_supports(8) ? 8 : 4; }

/* y (rows, ldy >= n) = x (rows, ldx >= k) w^T for w packed for `lanes`; 0, or -1 when the variant cannot run here
 * or k is not a multiple of `lanes` */
int rows_product_lanes(int lanes, const float *x, long ldx, const float *packed, long n, long k, float *y, long ldy,
                       long rows) {
    if (!rows_supports(lanes)) return -1;
    product_fn product = product_4;
#if WIDE_VARIANTS
    if (lanes == 8) product = product_8;
    if (lanes == 16) product = product_16;
#endif
    return product(x, ldx, packed, n, k, y, ldy, rows);
}

/* the same with the widest variant (the weight packed for rows_lanes()) */
int rows_product(const float *x, long ldx, const float *packed, long n, long k, float *y, long ldy, long rows) {
    return rows_product_lanes(rows_lanes(), x, ldx, packed, n, k, y, ldy, rows);
}

#else /* the body of one variant */

typedef float NAME(vec) __attribute__((vector_size(LANES * 4)));
typedef float NAME(uvec) __attribute__((vector_size(LANES * 4), aligned(4))); /* loads from any float address */
typedef int NAME(ivec) __attribute__((vector_size(LANES * 4)));
#define VEC NAME(vec)
#define UVEC NAME(uvec)
#define IVEC NAME(ivec)

static inline float NAME(total)(VEC v) {
#if LANES == 16
    v += __builtin_shuffle(v, (IVEC){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v += __builtin_shuffle(v, (IVEC){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    v += __builtin_shuffle(v, (IVEC){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    v += __builtin_shuffle(v, (IVEC){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
#elif LANES == 8
    v += __builtin_shuffle(v, (IVEC){4, 5, 6, 7, 0, 1, 2, 3});
    v += __builtin_shuffle(v, (IVEC){2, 3, 0, 1, 6, 7, 4, 5});
    v += __builtin_shuffle(v, (IVEC){1, 0, 3, 2, 5, 4, 7, 6});
#else
    v += __builtin_shuffle(v, (IVEC){2, 3, 0, 1});
    v += __builtin_shuffle(v, (IVEC){1, 0, 3, 2});
#endif
    return v[0];
}

/* outputs 2t and 2t + 1 (the second only if < n) of `rows` rows; `rows` is a constant where this is inlined */
static inline __attribute__((always_inline)) void NAME(pair)(
    int rows, const float *x, long ldx, const float *packed, long k, float *y, long ldy, long t, long n) {
    VEC acc[ROWS_PER_PASS][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = (VEC){0};
    const float *p = packed + t * 2 * k;
    for (long i = 0; i < k; i += LANES, p += 2 * LANES) {
        VEC w0 = *(const UVEC *)p, w1 = *(const UVEC *)(p + LANES);
        for (int r = 0; r < rows; r++) {
            VEC xv = *(const UVEC *)(x + r * ldx + i);
            acc[r][0] += xv * w0;
            acc[r][1] += xv * w1;
        }
    }
    for (int r = 0; r < rows; r++) {
        y[r * ldy + 2 * t] = NAME(total)(acc[r][0]);
        if (2 * t + 1 < n) y[r * ldy + 2 * t + 1] = NAME(total)(acc[r][1]);
    }
}

#define PAIRS(R)                                                                   \
    for (long t = 0; t < pairs; t++) NAME(pair)(R, xs, ldx, packed, k, ys, ldy, t, n); \
    break;

static int NAME(product)(const float *x, long ldx, const float *packed, long n, long k, float *y, long ldy,
                         long rows) {
    if (k % LANES != 0 || rows < 0) return -1;
    long pairs = (n + 1) / 2;
    for (long r0 = 0; r0 < rows; r0 += ROWS_PER_PASS) {
        const float *xs = x + r0 * ldx;
        float *ys = y + r0 * ldy;
        switch (rows - r0 < ROWS_PER_PASS ? rows - r0 : ROWS_PER_PASS) {
        case 1: PAIRS(1)
        case 2: PAIRS(2)
        case 3: PAIRS(3)
        case 4: PAIRS(4)
#if ROWS_PER_PASS == 8
        case 5: PAIRS(5)
        case 6: PAIRS(6)
        case 7: PAIRS(7)
        case 8: PAIRS(8)
#endif
        default: return -1;
        }
    }
    return 0;
}

#undef VEC
#undef UVEC
#undef IVEC
#undef PAIRS

#endif
