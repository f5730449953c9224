/* One pass over two bit-pattern arrays: the ULP statistics of a record on the CPU (see _ulp_cpu.py).
 *
 * Per element: the ordered-key distance (codes 0..16, 17 = "> 16", 18 = NaN on either side), its largest finite
 * value, and whether the bit patterns differ. Per row (the last dimension), when asked: the distance in ULPs of
 * the row's largest finite |a| (row codes 0 "0", 1 "<1", 2 "1", 3 "2", 4 "3-4", 5 "5-8", 6 "9-16", 7 ">16",
 * 8 nonfinite) and its largest finite value, in double precision from values decoded from the bits (exact).
 * A row whose bytes are equal on both sides (the common case) is counted without decoding (memcmp, then NaNs).
 * Output: int64 out[32] laid out as the Triton kernel's (ulptrace._ulp_triton.RECORD_LAYOUT); out[30] holds the
 * largest row distance's double bit pattern.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* the value of a finite bit pattern, exactly: its significand times the power of two of its exponent field,
 * scale[e] = 2**(max(e, 1) - bias - mant) (a table per call: no libm call per element) */
static inline double decode(int64_t x, int64_t magnitude, int mant, const double* scale) {
    int64_t exponent = magnitude >> mant;
    int64_t fraction = magnitude & ((((int64_t)1) << mant) - 1);
    int64_t significand = exponent == 0 ? fraction : (fraction | (((int64_t)1) << mant));
    double value = (double)significand * scale[exponent];
    return x < 0 ? -value : value;
}

/* BF16 and FP32 values are FP32 numbers: widened bit patterns reinterpreted, exactly (subnormals included) */
static inline double decode_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return (double)f;
}

/* the value of any finite bit pattern of the call's format: the fast exact paths for BF16 (16 bits, 7 fraction
 * bits) and FP32 (32 bits, 23), the table otherwise (FP16, FP8) */
#define DECODE(x, m) (fast == 1 ? decode_f32(((uint32_t)(uint16_t)(x)) << 16)                                    \
                      : fast == 2 ? decode_f32((uint32_t)(x)) : decode((x), (m), mant, scale))

/* 0 "0", 1 "<1", 2 "1", 3 "2", 4 "3-4", 5 "5-8", 6 "9-16", 7 ">16" for d >= 0, without branches (the
 * comparisons' sum: random data would mispredict a chain of ifs) */
static inline int row_code(double d) {
    return (d > 0.0) + (d >= 1.0) + (d > 1.0) + (d > 2.0) + (d > 4.0) + (d > 8.0) + (d > 16.0);
}

#define DEFINE_STATS(NAME, T)                                                                                    \
    void NAME(const T* a, const T* b, int64_t n_rows, int64_t n_cols, int64_t mag, int64_t maxf, int64_t limit,  \
              int mant, int bias, int rows, int64_t* out) {                                                      \
        int64_t codes[19] = {0}, row_codes[9] = {0}, differ = 0, max_ulp = 0;                                   \
        double max_row = 0.0, scale[256];                                                                        \
        const int fast = (sizeof(T) == 2 && mant == 7) ? 1 : (sizeof(T) == 4 && mant == 23) ? 2 : 0;            \
        for (int64_t e = 0; e <= (mag >> mant) && e < 256; ++e)                                                  \
            scale[e] = ldexp(1.0, (int)((e < 1 ? 1 : e) - bias - mant));                                         \
        for (int64_t r = 0; r < n_rows; ++r) {                                                                   \
            const T* ra = a + r * n_cols;                                                                        \
            const T* rb = b + r * n_cols;                                                                        \
            if (memcmp(ra, rb, (size_t)n_cols * sizeof(T)) == 0) {                                              \
                /* a bitwise-equal row (the common case): distance 0, row code 0; only NaNs need counting */    \
                int64_t nan = 0;                                                                                 \
                for (int64_t c = 0; c < n_cols; ++c) nan += (((int64_t)ra[c]) & mag) > limit;                   \
                codes[18] += nan;                                                                                \
                codes[0] += n_cols - nan;                                                                        \
                if (rows) row_codes[0] += n_cols;                                                                \
                continue;                                                                                        \
            }                                                                                                    \
            double inv_unit = 0.0;                                                                               \
            if (rows) {                                                                                          \
                int64_t top = 0;                                                                                 \
                for (int64_t c = 0; c < n_cols; ++c) {                                                           \
                    int64_t ma = ((int64_t)ra[c]) & mag;                                                         \
                    if (ma <= maxf && ma > top) top = ma;                                                        \
                }                                                                                                \
                int64_t biased = top >> mant;                                                                    \
                inv_unit = ldexp(1.0, (int)(bias + mant - (biased < 1 ? 1 : biased)));                           \
            }                                                                                                    \
            for (int64_t c = 0; c < n_cols; ++c) {                                                               \
                int64_t xa = ra[c], xb = rb[c];                                                                  \
                int64_t ma = xa & mag, mb = xb & mag;                                                            \
                int64_t distance = (xa < 0 ? -ma : ma) - (xb < 0 ? -mb : mb);                                    \
                if (distance < 0) distance = -distance;                                                          \
                if (ma > limit || mb > limit) {                                                                  \
                    codes[18]++;                                                                                 \
                } else {                                                                                         \
                    codes[distance > 17 ? 17 : distance]++;                                                      \
                    if (distance > max_ulp) max_ulp = distance;                                                  \
                }                                                                                                \
                int same = xa == xb;                                                                             \
                differ += !same;                                                                                 \
                if (!rows) continue;                                                                             \
                if (!same && (ma > maxf || mb > maxf)) {                                                         \
                    row_codes[8]++;                                                                              \
                    continue;                                                                                    \
                }                                                                                                \
                /* equal bit patterns decode alike: d is 0 for them */                                         \
                double d = same ? 0.0 : fabs(DECODE(xa, ma) - DECODE(xb, mb)) * inv_unit;                         \
                row_codes[row_code(d)]++;                                                                        \
                if (d > max_row) max_row = d;                                                                    \
            }                                                                                                    \
        }                                                                                                        \
        memset(out, 0, 32 * sizeof(int64_t));                                                                    \
        memcpy(out, codes, sizeof(codes));                                                                       \
        out[19] = differ;                                                                                        \
        out[20] = max_ulp;                                                                                       \
        memcpy(out + 21, row_codes, sizeof(row_codes));                                                          \
        memcpy(out + 30, &max_row, sizeof(double));                                                              \
    }

DEFINE_STATS(ulptrace_stats_8, int8_t)
DEFINE_STATS(ulptrace_stats_16, int16_t)
DEFINE_STATS(ulptrace_stats_32, int32_t)
