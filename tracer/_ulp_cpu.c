/* One pass over two bit-pattern arrays: the ULP statistics of a record on the CPU (see _ulp_cpu.py).
 *
 * Per element: the ordered-key distance counted into the histogram's buckets ("0", "1", "2", "3-4", "5-8", "9-16",
 * "> 16", NaN on either side), its largest finite value, and whether the bit patterns differ. The CUDA kernel counts
 * the distance codes 0..16 one by one; this writes each bucket's count at its first code (0, 1, 2, 3, 5, 9, 17, 18;
 * the others 0), which ulp._buckets sums into the same buckets: counting by nested comparisons (> 0, > 1, > 2, > 4,
 * > 8, > 16) keeps the whole element statistics in one loop the compiler vectorizes (a code per element counted
 * value by value was 80% of the pass). Per row (the last dimension), when asked: the distance in ULPs of
 * the row's largest finite |a| (row codes 0 "0", 1 "<1", 2 "1", 3 "2", 4 "3-4", 5 "5-8", 6 "9-16", 7 ">16",
 * 8 nonfinite) and its largest finite value, in double precision from values decoded from the bits (exact).
 * A row whose bytes are equal on both sides (the common case) is counted without decoding (memcmp, then NaNs).
 * Output: int64 out[32] laid out as the Triton kernel's (ulptrace._ulp_triton.RECORD_LAYOUT); out[30] holds the
 * largest row distance's double bit pattern.
 *
 * The element statistics go over the whole array in blocks of BLOCK elements (a bitwise-equal block only counts its
 * NaNs); the row statistics put each differing row's distances, in its own units, into a buffer of BLOCK elements that
 * is counted when full (rows are often short: 32-element attention heads), one loop per row comparison (one loop
 * counting all seven from the doubles did not vectorize: 1.6x slower). Loops without branches, so that the compiler
 * vectorizes them: built with -march=native and -fno-trapping-math (_ulp_cpu.py).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 256

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

/* a BF16 or an FP32 bit pattern's value (the pattern as a signed integer of its width) */
static inline double widen_bf16(int16_t x) { return decode_f32(((uint32_t)(uint16_t)x) << 16); }
static inline double widen_f32(int32_t x) { return decode_f32((uint32_t)x); }

/* 0 "0", 1 "<1", 2 "1", 3 "2", 4 "3-4", 5 "5-8", 6 "9-16", 7 ">16" for d >= 0: the number of these comparisons
 * that hold (nested: each implies the ones before it), so row code k counts the distances that pass comparison k
 * and not k + 1 */
static inline int row_code(double d) {
    return (d > 0.0) + (d >= 1.0) + (d > 1.0) + (d > 2.0) + (d > 4.0) + (d > 8.0) + (d > 16.0);
}

/* the row codes and the largest distance of the buffered distances dv[0..fill) (0 where an element was not finite:
 * `nonfinite` of them, counted as row code 8). Every distance is finite and >= 0, so the largest is the largest bit
 * pattern read as an integer: a loop the compiler vectorizes (compared as doubles it did not, and ran one element a
 * comparison's latency: most of a differing row's cost) */
static void count_rows(const double* dv, int fill, int nonfinite, int64_t* row_codes, double* max_row) {
    int passed[8] = {fill - nonfinite, 0, 0, 0, 0, 0, 0, 0};
    for (int i = 0; i < fill; ++i) passed[1] += dv[i] > 0.0;
    for (int i = 0; i < fill; ++i) passed[2] += dv[i] >= 1.0;
    for (int i = 0; i < fill; ++i) passed[3] += dv[i] > 1.0;
    for (int i = 0; i < fill; ++i) passed[4] += dv[i] > 2.0;
    for (int i = 0; i < fill; ++i) passed[5] += dv[i] > 4.0;
    for (int i = 0; i < fill; ++i) passed[6] += dv[i] > 8.0;
    for (int i = 0; i < fill; ++i) passed[7] += dv[i] > 16.0;
    for (int k = 0; k < 7; ++k) row_codes[k] += passed[k] - passed[k + 1];
    row_codes[7] += passed[7];
    row_codes[8] += nonfinite;
    int64_t top;
    memcpy(&top, max_row, sizeof top);
    for (int i = 0; i < fill; ++i) {
        int64_t u;
        memcpy(&u, dv + i, sizeof u);
        top = u > top ? u : top;
    }
    memcpy(max_row, &top, sizeof top);
}

/* NAME over T bit patterns with W arithmetic (wide enough for a distance); FAST_MANT: the fraction bits of the format
 * decoded as FP32 numbers (7: BF16 in 16 bits, 23: FP32); any other format (FP16, FP8) is decoded through the table */
#define DEFINE_STATS(NAME, T, W, FAST_MANT)                                                                          \
    void NAME(const T* a, const T* b, int64_t n_rows, int64_t n_cols, int64_t mag64, int64_t maxf64,                 \
              int64_t limit64, int mant, int bias, int rows, int64_t* out) {                                         \
        int64_t codes[19] = {0}, row_codes[9] = {0}, differ = 0;                                                     \
        const W mag = (W)mag64, maxf = (W)maxf64, limit = (W)limit64;                                                \
        const int64_t n = n_rows * n_cols;                                                                           \
        const int fast = mant == FAST_MANT;                                                                          \
        W max_ulp = 0;                                                                                               \
        double max_row = 0.0, scale[256], dv[BLOCK];                                                                 \
        for (int64_t e = 0; e <= (mag64 >> mant) && e < 256; ++e)                                                    \
            scale[e] = ldexp(1.0, (int)((e < 1 ? 1 : e) - bias - mant));                                             \
        for (int64_t c0 = 0; c0 < n; c0 += BLOCK) { /* the element statistics, rows aside */                         \
            const int len = (int)(n - c0 < BLOCK ? n - c0 : BLOCK);                                                  \
            const T* pa = a + c0;                                                                                    \
            const T* pb = b + c0;                                                                                    \
            if (memcmp(pa, pb, (size_t)len * sizeof(T)) == 0) { /* the common case: distance 0 but for NaNs */       \
                int nan = 0;                                                                                         \
                for (int i = 0; i < len; ++i) nan += (((W)pa[i]) & mag) > limit;                                     \
                codes[18] += nan;                                                                                    \
                codes[0] += len - nan;                                                                               \
                continue;                                                                                            \
            }                                                                                                        \
            W block_max = 0;                                                                                         \
            int block_differ = 0, nan_count = 0, g0 = 0, g1 = 0, g2 = 0, g4 = 0, g8 = 0, g16 = 0;                  \
            for (int i = 0; i < len; ++i) {                                                                          \
                W xa = pa[i], xb = pb[i];                                                                            \
                W ma = xa & mag, mb = xb & mag;                                                                      \
                W distance = (xa < 0 ? -ma : ma) - (xb < 0 ? -mb : mb);                                              \
                distance = distance < 0 ? -distance : distance;                                                      \
                int nan = (ma > limit) | (mb > limit);                                                               \
                W finite = nan ? 0 : distance;                                                                       \
                nan_count += nan;                                                                                    \
                g0 += finite > 0;                                                                                    \
                g1 += finite > 1;                                                                                    \
                g2 += finite > 2;                                                                                    \
                g4 += finite > 4;                                                                                    \
                g8 += finite > 8;                                                                                    \
                g16 += finite > 16;                                                                                  \
                block_max = finite > block_max ? finite : block_max;                                                 \
                block_differ += xa != xb;                                                                            \
            }                                                                                                        \
            codes[0] += len - nan_count - g0;                                                                        \
            codes[1] += g0 - g1;                                                                                     \
            codes[2] += g1 - g2;                                                                                     \
            codes[3] += g2 - g4;                                                                                     \
            codes[5] += g4 - g8;                                                                                     \
            codes[9] += g8 - g16;                                                                                    \
            codes[17] += g16;                                                                                        \
            codes[18] += nan_count;                                                                                  \
            max_ulp = block_max > max_ulp ? block_max : max_ulp;                                                     \
            differ += block_differ;                                                                                  \
        }                                                                                                            \
        int fill = 0, nonfinite = 0; /* buffered distances of differing rows, and how many of them were not finite */ \
        for (int64_t r = 0; rows && r < n_rows; ++r) {                                                               \
            const T* ra = a + r * n_cols;                                                                            \
            const T* rb = b + r * n_cols;                                                                            \
            if (memcmp(ra, rb, (size_t)n_cols * sizeof(T)) == 0) {                                                   \
                row_codes[0] += n_cols;                                                                              \
                continue;                                                                                            \
            }                                                                                                        \
            W top = 0; /* the row's largest finite |a|, and one over its ULP */                                      \
            for (int64_t c = 0; c < n_cols; ++c) {                                                                   \
                W ma = ((W)ra[c]) & mag;                                                                             \
                W finite = ma <= maxf ? ma : 0;                                                                      \
                top = finite > top ? finite : top;                                                                   \
            }                                                                                                        \
            int64_t biased = ((int64_t)top) >> mant;                                                                 \
            const double inv_unit = ldexp(1.0, (int)(bias + mant - (biased < 1 ? 1 : biased)));                      \
            for (int64_t c0 = 0; c0 < n_cols;) {                                                                     \
                if (fill == BLOCK) {                                                                                 \
                    count_rows(dv, fill, nonfinite, row_codes, &max_row);                                            \
                    fill = nonfinite = 0;                                                                            \
                }                                                                                                    \
                const int len = (int)(n_cols - c0 < BLOCK - fill ? n_cols - c0 : BLOCK - fill);                      \
                const T* pa = ra + c0;                                                                               \
                const T* pb = rb + c0;                                                                               \
                double* d_out = dv + fill;                                                                           \
                /* an element's distance in the row's units, 0 where a side is not finite or the bit patterns are  \
                 * equal (a NaN or an infinity on both sides included): finite and >= 0 (count_rows) */             \
                if (fast) {                                                                                          \
                    for (int i = 0; i < len; ++i) {                                                                  \
                        W xa = pa[i], xb = pb[i];                                                                    \
                        int bad = (xa != xb) & (((xa & mag) > maxf) | ((xb & mag) > maxf));                          \
                        double d = FAST_MANT == 7                                                                    \
                            ? widen_bf16((int16_t)xa) - widen_bf16((int16_t)xb)                                      \
                            : widen_f32((int32_t)xa) - widen_f32((int32_t)xb);                                       \
                        d_out[i] = (xa == xb || bad) ? 0.0 : fabs(d) * inv_unit;                                     \
                        nonfinite += bad;                                                                            \
                    }                                                                                                \
                } else {                                                                                             \
                    for (int i = 0; i < len; ++i) {                                                                  \
                        W xa = pa[i], xb = pb[i];                                                                    \
                        W ma = xa & mag, mb = xb & mag;                                                              \
                        int bad = (xa != xb) & ((ma > maxf) | (mb > maxf));                                          \
                        d_out[i] = (xa == xb || bad) ? 0.0                                                           \
                            : fabs(decode(xa, ma, mant, scale) - decode(xb, mb, mant, scale)) * inv_unit;            \
                        nonfinite += bad;                                                                            \
                    }                                                                                                \
                }                                                                                                    \
                fill += len;                                                                                         \
                c0 += len;                                                                                           \
            }                                                                                                        \
        }                                                                                                            \
        count_rows(dv, fill, nonfinite, row_codes, &max_row);                                                        \
        memset(out, 0, 32 * sizeof(int64_t));                                                                        \
        memcpy(out, codes, sizeof(codes));                                                                           \
        out[19] = differ;                                                                                            \
        out[20] = max_ulp;                                                                                           \
        if (rows) memcpy(out + 21, row_codes, sizeof(row_codes));                                                    \
        memcpy(out + 30, &max_row, sizeof(double));                                                                  \
    }

DEFINE_STATS(ulptrace_stats_8, int8_t, int32_t, -1)
DEFINE_STATS(ulptrace_stats_16, int16_t, int32_t, 7)
DEFINE_STATS(ulptrace_stats_32, int32_t, int64_t, 23)

/* Histograms of the ULP distances between a and b by group, in one pass (ulptrace.ulp.grouped_ulp_histograms): the
 * arrays hold n_units units of unit_len elements each, and an element of unit u with code c (codes[i] < 256) is in group
 * bases[u] + c (< n_groups, checked by the caller); counts[group * 8 + bucket] is incremented for its distance's bucket
 * (0 "0", 1 "1", 2 "2", 3 "3-4", 4 "5-8", 5 "9-16", 6 ">16", 7 NaN on either side: ulptrace.ulp.HISTOGRAM_BUCKETS), as
 * torch's bincount over the distances and the groups counts them — without the int64 temporaries of that path (a
 * stacked record's verdict histograms took ~20 passes of them).
 * In blocks: first each element's counter (a loop the compiler vectorizes), then the increments, into four
 * interleaved copies of the counters taken in turn, so that neighbouring elements — mostly of one counter — do not
 * each wait for the one before (2.2 ns an element counted as it came, 0.6 ns so). Returns 0, or -1 where the copies
 * cannot be allocated or their indices would not fit in 32 bits (the caller then counts with torch). */
#define DEFINE_GROUPED(NAME, T, W)                                                                                   \
    int NAME(const T* restrict a, const T* restrict b, const uint8_t* restrict codes, const int64_t* bases,          \
             int64_t n_units, int64_t unit_len, int64_t n_groups, int64_t mag64, int64_t limit64, int64_t* counts) {  \
        const W mag = (W)mag64, limit = (W)limit64;                                                                  \
        const int64_t size = n_groups * 8;                                                                           \
        if (size > INT32_MAX / 4) return -1;                                                                         \
        int64_t* copies = calloc((size_t)(4 * size), sizeof(int64_t));                                               \
        if (copies == NULL) return -1;                                                                               \
        int32_t slot[BLOCK];                                                                                         \
        for (int64_t u = 0; u < n_units; ++u) {                                                                      \
            const int32_t first = (int32_t)(bases[u] * 8);                                                           \
            for (int64_t c0 = u * unit_len; c0 < (u + 1) * unit_len; c0 += BLOCK) {                                  \
                const int len = (int)((u + 1) * unit_len - c0 < BLOCK ? (u + 1) * unit_len - c0 : BLOCK);            \
                const T* pa = a + c0;                                                                                \
                const T* pb = b + c0;                                                                                \
                const uint8_t* pc = codes + c0;                                                                      \
                for (int i = 0; i < len; ++i) {                                                                      \
                    W xa = pa[i], xb = pb[i];                                                                        \
                    W ma = xa & mag, mb = xb & mag;                                                                  \
                    W d = (xa < 0 ? -ma : ma) - (xb < 0 ? -mb : mb);                                                 \
                    d = d < 0 ? -d : d;                                                                              \
                    int32_t bucket = (d > 0) + (d > 1) + (d > 2) + (d > 4) + (d > 8) + (d > 16);                     \
                    bucket = (ma > limit) | (mb > limit) ? 7 : bucket;                                               \
                    slot[i] = (first + pc[i] * 8 + bucket) * 4;                                                      \
                }                                                                                                    \
                int i = 0;                                                                                           \
                for (; i + 4 <= len; i += 4) {                                                                       \
                    copies[slot[i]] += 1;                                                                            \
                    copies[slot[i + 1] + 1] += 1;                                                                    \
                    copies[slot[i + 2] + 2] += 1;                                                                    \
                    copies[slot[i + 3] + 3] += 1;                                                                    \
                }                                                                                                    \
                for (; i < len; ++i) copies[slot[i]] += 1;                                                           \
            }                                                                                                        \
        }                                                                                                            \
        for (int64_t g = 0; g < size; ++g)                                                                           \
            counts[g] += copies[4 * g] + copies[4 * g + 1] + copies[4 * g + 2] + copies[4 * g + 3];                  \
        free(copies);                                                                                                \
        return 0;                                                                                                    \
    }

DEFINE_GROUPED(ulptrace_grouped_8, int8_t, int32_t)
DEFINE_GROUPED(ulptrace_grouped_16, int16_t, int32_t)
DEFINE_GROUPED(ulptrace_grouped_32, int32_t, int64_t)

/* The masks of a judgement (ulptrace.oracle.judge.judge_sets_stacked) in one pass over the output's bit patterns,
 * the reference's (NULL: judged against the semantics alone, where "exact" is "in the set") and the admissible set's
 * float64 ends and point: tie (in the set, not exact), bad (not finite: the output, its point or the set, and not
 * exact) and outside (none of these, not exact) as bytes 0/1 — what its ~30 torch operations on float64 and boolean
 * temporaries give, branch-free (a loop the compiler vectorizes). The output is BF16 (_16) or FP32 (_32), widened
 * exactly. */
#define CLASSIFY_LOOP(T, WIDEN, EXACT)                                                                               \
    for (int64_t i = 0; i < n; ++i) {                                                                                \
        const double v = WIDEN(out[i]), l = lo[i], h = hi[i], p = pt[i];                                             \
        const int v_nan = v != v, pt_nan = p != p, set_nan = (l != l) | (h != h);                                    \
        const int in_set = ((v >= l) & (v <= h)) | (v_nan & (pt_nan | set_nan));                                     \
        const int finite = (fabs(v) <= DBL_MAX) & (fabs(p) <= DBL_MAX) & (!set_nan);                                 \
        const int nonfinite = (!in_set) & (!finite);                                                                 \
        const int exact = EXACT;                                                                                     \
        tie[i] = (uint8_t)(in_set & (!exact));                                                                       \
        bad[i] = (uint8_t)(nonfinite & (!exact));                                                                    \
        outside[i] = (uint8_t)((!in_set) & (!nonfinite) & (!exact));                                                 \
    }

#define DEFINE_CLASSIFY(NAME, T, WIDEN)                                                                              \
    void NAME(const T* restrict out, const T* restrict ref, const double* restrict lo, const double* restrict hi,     \
              const double* restrict pt, int64_t n, uint8_t* restrict tie, uint8_t* restrict bad,                    \
              uint8_t* restrict outside) {                                                                           \
        if (ref != NULL) {                                                                                           \
            CLASSIFY_LOOP(T, WIDEN, out[i] == ref[i])                                                                \
        } else {                                                                                                     \
            CLASSIFY_LOOP(T, WIDEN, in_set)                                                                          \
        }                                                                                                            \
    }

DEFINE_CLASSIFY(ulptrace_classify_16, int16_t, widen_bf16)
DEFINE_CLASSIFY(ulptrace_classify_32, int32_t, widen_f32)

/* Whether each of n_parts consecutive parts of part_bytes bytes differs between a and b (out[k] = 1): one memcmp
 * each, for which rows of a record must be judged (ulptrace.ulp.parts_differ) — bitwise equality, as comparing the bit
 * patterns element by element and reducing each part is. */
void ulptrace_parts_differ(const uint8_t* a, const uint8_t* b, int64_t n_parts, int64_t part_bytes, uint8_t* out) {
    for (int64_t k = 0; k < n_parts; ++k)
        out[k] = memcmp(a + k * part_bytes, b + k * part_bytes, (size_t)part_bytes) != 0;
}

/* Float64 values x[0..n) to FP32, into out, the way the oracle's roundings take them (ulptrace.oracle.intervals):
 * mode 0 the largest FP32 value <= x, mode 1 the smallest >= x, mode 2 rounded to odd (toward zero, the last bit set
 * where inexact: after it one FP32 -> BF16/FP16 cast is the single RNE). Each starts from the cast (RNE, as torch's
 * .to(float32)) and steps one FP32 value by its bit pattern where the cast went the wrong way — what torch.nextafter
 * toward -inf, +inf or 0 gives; NaN is never stepped and keeps the cast's bits. Branch-free loops (selects), so
 * that they vectorize: torch.where's loop on the CPU branches per element, and a data-dependent mask made it ~10x
 * slower than an arithmetic op. */
static inline uint32_t f32_bits(float y) {
    uint32_t u;
    memcpy(&u, &y, sizeof u);
    return u;
}

static inline float f32_of(uint32_t u) {
    float y;
    memcpy(&y, &u, sizeof y);
    return y;
}

void ulptrace_to_fp32(const double* x, float* out, int64_t n, int mode) {
    if (mode == 0) {
        for (int64_t i = 0; i < n; ++i) {
            float y = (float)x[i];
            uint32_t u = f32_bits(y);
            uint32_t down = u == 0 ? 0x80000001u : (u >> 31) ? u + 1 : u - 1;  /* +0 steps to -min_subnormal */
            out[i] = f32_of((double)y > x[i] ? down : u);
        }
    } else if (mode == 1) {
        for (int64_t i = 0; i < n; ++i) {
            float y = (float)x[i];
            uint32_t u = f32_bits(y);
            uint32_t up = u == 0x80000000u ? 1u : (u >> 31) ? u - 1 : u + 1;  /* -0 steps to +min_subnormal */
            out[i] = f32_of((double)y < x[i] ? up : u);
        }
    } else {
        for (int64_t i = 0; i < n; ++i) {
            float y = (float)x[i];
            double back = (double)y;
            uint32_t u = f32_bits(y);
            u = fabs(back) > fabs(x[i]) ? u - 1 : u;  /* toward zero: a nonzero y's magnitude one step down */
            out[i] = f32_of(back != x[i] && x[i] == x[i] ? u | 1u : u);  /* inexact (never NaN): the odd bit */
        }
    }
}
