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
 * Built with -march=native for the machine it runs on; the vector width follows what that CPU has.
 */
#include <stddef.h>

#if defined(__AVX512F__)
#define LANES 16
#define ROWS_PER_PASS 8 /* 16 accumulators of 32 vector registers */
#elif defined(__AVX__)
#define LANES 8
#define ROWS_PER_PASS 4 /* 8 accumulators of 16 */
#else
#define LANES 4
#define ROWS_PER_PASS 4
#endif

typedef float vec __attribute__((vector_size(LANES * 4)));
typedef float uvec __attribute__((vector_size(LANES * 4), aligned(4))); /* loads from any float address */
typedef int ivec __attribute__((vector_size(LANES * 4)));

static inline float total(vec v) {
#if LANES == 16
    v += __builtin_shuffle(v, (ivec){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v += __builtin_shuffle(v, (ivec){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    v += __builtin_shuffle(v, (ivec){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    v += __builtin_shuffle(v, (ivec){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
#elif LANES == 8
    v += __builtin_shuffle(v, (ivec){4, 5, 6, 7, 0, 1, 2, 3});
    v += __builtin_shuffle(v, (ivec){2, 3, 0, 1, 6, 7, 4, 5});
    v += __builtin_shuffle(v, (ivec){1, 0, 3, 2, 5, 4, 7, 6});
#else
    v += __builtin_shuffle(v, (ivec){2, 3, 0, 1});
    v += __builtin_shuffle(v, (ivec){1, 0, 3, 2});
#endif
    return v[0];
}

/* outputs 2t and 2t + 1 (the second only if < n) of `rows` rows; `rows` is a constant where this is inlined */
static inline __attribute__((always_inline)) void pair(
    int rows, const float *x, long ldx, const float *packed, long k, float *y, long ldy, long t, long n) {
    vec acc[ROWS_PER_PASS][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = (vec){0};
    const float *p = packed + t * 2 * k;
    for (long i = 0; i < k; i += LANES, p += 2 * LANES) {
        vec w0 = *(const uvec *)p, w1 = *(const uvec *)(p + LANES);
        for (int r = 0; r < rows; r++) {
            vec xv = *(const uvec *)(x + r * ldx + i);
            acc[r][0] += xv * w0;
            acc[r][1] += xv * w1;
        }
    }
    for (int r = 0; r < rows; r++) {
        y[r * ldy + 2 * t] = total(acc[r][0]);
        if (2 * t + 1 < n) y[r * ldy + 2 * t + 1] = total(acc[r][1]);
    }
}

#define PAIRS(R)                                                              \
    for (long t = 0; t < pairs; t++) pair(R, xs, ldx, packed, k, ys, ldy, t, n); \
    break;

int rows_lanes(void) { return LANES; }

/* y (rows, ldy >= n) = x (rows, ldx >= k) w^T for the packed w; 0, or -1 when k is not a multiple of LANES */
int rows_product(const float *x, long ldx, const float *packed, long n, long k, float *y, long ldy, long rows) {
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
