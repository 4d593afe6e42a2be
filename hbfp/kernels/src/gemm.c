/* The BFP product with exact integer K-tile sums (docs/numerics.md, section 3).

   For every output: acc = C (or +0), then for each K-tile in order acc += p, where p is the
   tile's exact integer sum s of code products, times 2**(E_A + E_B - 254 - frac_A - frac_B),
   rounded once to fp32 (RNE, a result below 2**-126 a zero of its sign, overflow to inf; NaN
   when either tile is NaN); then the bias, an activation on the bf16 rounding, fp32 or bf16 out.

   The codes are packed as 16-bit pairs along K, so that one multiply-add instruction of the
   CPU (x86's vpmaddwd, or the compiler's vectorization of the portable loop) forms two
   products and their sum exactly: int8 or narrow int16 codes whose K-tile sums fit 31 bits
   sum in 32-bit lanes; wider codes (HBFP16: 24 * 32767**2 needs 35 bits) sum in 64 bits.

   The fp32 step per K-tile, p = (fp32(s) * sa) * sb: sa = 2**(E_A - 127 - frac_A) and
   sb = 2**(E_B - 127 - frac_B) are normal fp32 numbers (NaN for a NaN tile), fp32(s) is the
   RNE rounding of s (exact below 2**24), the first product is exact (no operand tile so small
   or so large that it leaves the normal range: "safe" tiles) and the second rounds once, as
   the contract rounds, under the FTZ/DAZ environment of hbfp_fp_enter. A K-tile that meets an
   unsafe tile (an exponent code at the ends of the range, or code 0 over nonzero codes) takes
   the exact scalar route instead: the product in double, flushed by hand.

   Blocking (GotoBLAS's): per output block of MC x NC, the fp32 sums stay in a contiguous
   buffer in the core's cache over all of K; K goes in blocks of whole K-tiles (KC), B's block
   (KC x NC) and A's (MC x KC) are packed for the block, and MR x NR register tiles of int32
   sums run over each K-tile. Blocks are the parts that the pool's threads take. */

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define MR 6
#define NR 16
#define KC_TARGET 384 /* codes of K per block (rounded to whole K-tiles) */
#define MC 24         /* rows of an output block (a multiple of MR) */
#define NC 512        /* columns of an output block (a multiple of NR) */

/* Per K-tile of a packed panel: the fp32 scales of its rows (A) or columns (B) for the fast
   epilogue, their exact powers of two in double for the scalar one, and whether the fast
   epilogue may be used (every row or column safe). */
typedef struct {
    float sf[NR > MR ? NR : MR];
    double sd[NR > MR ? NR : MR];
    int safe;
} scales_t;

typedef struct {
    const hbfp_operand *a, *b;
    const hbfp_output *o;
    long m, n, k, tk, kt;   /* tk: the K side of the tiles; kt: K-tiles */
    long rows, cols;        /* the output block of a part */
    long row_blocks, col_blocks;
    int wide;               /* K-tile sums need more than 31 bits */
    int sbits;              /* bits of the largest K-tile sum */
} gemm_job;

/* ---- packing --------------------------------------------------------------------------- */

/* Packed panels hold int16 codes in pairs along K (k, k + 1), each K-tile padded to whole
   pairs with a zero code. A panel of A (MR rows) is laid out one of two ways, whichever its
   storage packs into with the fewest moves:
   - by rows (A_ROWS, from A with consecutive K): row r's pairs of all the block's K-tiles in
     a row of `rstride` codes, so packing is a widening copy per row;
   - by pairs (A_PAIRS, from A with consecutive rows, A^T stored, and any other strides):
     pair after pair, each the MR rows' (k, k + 1).
   A panel of B (NR columns) is always by pairs: pair after pair, each the NR columns' (k, k+1)
   side by side (two vectors of 8 columns for the AVX2 tile). */
enum { A_ROWS, A_PAIRS };

static inline long code_at(const void *codes, int bytes, long at)
{
    return bytes == 1 ? ((const i8 *)codes)[at] : ((const i16 *)codes)[at];
}

/* 2**e as a float where e is a normal exponent, else 0 (the caller marks the tile unsafe). */
static inline float pow2f(int e)
{
    return e >= -126 && e <= 127 ? bits_f32((unsigned)(e + 127) << 23) : 0.0f;
}

static inline double pow2d(int e)
{
    union { unsigned long long u; double d; } v = {(unsigned long long)(e + 1023) << 52};
    return v.d;
}

/* The scales of one row of A (or column of B) in one K-tile of exponent code `e`; `nonzero()`
   is asked only for exponent code 0 (a tile of zeros from quantize, but a stored operand may
   hold codes under it). `top`: the largest exponent sa may have for the first product to be
   exact. Returns whether the row is safe for the fast fp32 step. */
static inline int row_scales(int e, int frac, int nonzero, int top, float *sf, double *sd)
{
    if (e == 0xFF) {
        *sf = __builtin_nanf("");
        *sd = __builtin_nan("");
        return 1;
    }
    int x = e - 127 - frac;
    *sd = pow2d(x);
    if (e == 0 && !nonzero) { /* s = 0 whatever the scale: any normal one will do */
        *sf = 1.0f;
        return 1;
    }
    *sf = pow2f(x);
    return x >= -126 && x <= top;
}

/* Whether any of n codes (stride st) is nonzero. */
static int any_code(const void *codes, int bytes, long at, long n, long st)
{
    for (long i = 0; i < n; i++)
        if (code_at(codes, bytes, at + i * st))
            return 1;
    return 0;
}

static inline long tile_k(const gemm_job *g, long t)
{
    long k0 = t * g->tk;
    return g->k - k0 < g->tk ? g->k - k0 : g->tk;
}

/* n codes (consecutive) widened to int16, then `pad` zeros. */
static inline void widen(const void *src, int bytes, long n, long pad, i16 *restrict d)
{
    if (bytes == 1) {
        const i8 *restrict x = src;
        for (long i = 0; i < n; i++)
            d[i] = x[i];
    } else {
        memcpy(d, src, (size_t)n * sizeof(i16));
    }
    for (long i = 0; i < pad; i++)
        d[n + i] = 0;
}

/* Scales of A's rows [i0, i0 + rows) in K-tiles [t0, t1): one row_scales per tile of A that
   the rows meet (rows of one tile share its exponent), except under exponent code 0, where each
   row's own codes say whether it is zero. */
static void scales_a(const gemm_job *g, const hbfp_operand *a, const void *codes, const unsigned char *exps, long i0,
                     int rows, long t0, long t1, scales_t *sc)
{
    int top = 127 - g->sbits;
    for (long t = t0; t < t1; t++) {
        scales_t *s = sc + (t - t0);
        s->safe = 1;
        for (int r = 0; r < rows;) {
            long i = i0 + r, tr = i / a->th, end = (tr + 1) * a->th - i0; /* rows of this tile */
            if (end > rows)
                end = rows;
            int e = exps[tr * a->ers + t * a->ecs];
            if (e == 0) {
                for (; r < end; r++) {
                    int nz = any_code(codes, a->code_bytes, (i0 + r) * a->rs + t * g->tk * a->cs, tile_k(g, t), a->cs);
                    s->safe &= row_scales(e, a->frac, nz, top, &s->sf[r], &s->sd[r]);
                }
                continue;
            }
            float f;
            double d;
            s->safe &= row_scales(e, a->frac, 1, top, &f, &d);
            for (; r < end; r++) {
                s->sf[r] = f;
                s->sd[r] = d;
            }
        }
        for (int r = rows; r < MR; r++) {
            s->sf[r] = 1.0f;
            s->sd[r] = 1.0;
        }
    }
}

/* A's rows [i0, i0 + rows), K-tiles [t0, t1), by rows (A's K consecutive): row r at
   ap + r * rstride. */
static void pack_a_rows(const gemm_job *g, const hbfp_operand *a, const void *codes, long i0, int rows, long t0,
                        long t1, i16 *ap, long rstride)
{
    for (int r = 0; r < MR; r++) {
        i16 *d = ap + r * rstride;
        for (long t = t0; t < t1; t++) {
            long kn = tile_k(g, t), np = (kn + 1) / 2;
            if (r < rows)
                widen((const char *)codes + ((i0 + r) * a->rs + t * g->tk) * a->code_bytes, a->code_bytes, kn,
                      np * 2 - kn, d);
            else
                memset(d, 0, (size_t)np * 2 * sizeof(i16));
            d += np * 2;
        }
    }
}

/* Any number of rows [i0, i0 + rows) of A stored with consecutive rows (A^T's rows are K),
   by pairs into panels of MR rows at ap + q * pstride: per pair, the two K-rows' codes of all
   the rows interleaved at once, then each panel's MR of them copied out. */
static void pack_a_pairs_block(const gemm_job *g, const hbfp_operand *a, const void *codes, long i0, long rows,
                               long t0, long t1, i16 *ap, long pstride)
{
    enum { CHUNK = 96 };
    i32 inter[CHUNK + MR];
    long panels = (rows + MR - 1) / MR;
    long off = 0; /* pairs so far */
    for (long t = t0; t < t1; t++) {
        long kn = tile_k(g, t), np = (kn + 1) / 2;
        for (long p = 0; p < np; p++) {
            long k = t * g->tk + 2 * p;
            int second = 2 * p + 1 < kn;
            for (long r0 = 0; r0 < rows; r0 += CHUNK) {
                long w = rows - r0 < CHUNK ? rows - r0 : CHUNK;
                long at0 = k * a->cs + (i0 + r0) * a->rs, at1 = at0 + a->cs;
                if (a->code_bytes == 1) {
                    const i8 *x0 = (const i8 *)codes + at0, *x1 = (const i8 *)codes + at1;
                    for (long r = 0; r < w; r++)
                        inter[r] = (i32)(unsigned short)(i16)x0[r] | (second ? (i32)((unsigned)(i16)x1[r] << 16) : 0);
                } else {
                    const i16 *x0 = (const i16 *)codes + at0, *x1 = (const i16 *)codes + at1;
                    for (long r = 0; r < w; r++)
                        inter[r] = (i32)(unsigned short)x0[r] | (second ? (i32)((unsigned)x1[r] << 16) : 0);
                }
                for (long r = w; r < CHUNK + MR; r++)
                    inter[r] = 0;
                for (long q = r0 / MR; q < panels && q * MR < r0 + w; q++)
                    memcpy(ap + q * pstride + (off + p) * MR * 2, inter + (q * MR - r0), MR * sizeof(i32));
            }
        }
        off += np;
    }
}

/* A's rows [i0, i0 + rows) by pairs, from any strides (one panel). */
static void pack_a_pairs(const gemm_job *g, const hbfp_operand *a, const void *codes, long i0, int rows, long t0,
                         long t1, i16 *ap)
{
    for (long t = t0; t < t1; t++) {
        long kn = tile_k(g, t), np = (kn + 1) / 2;
        for (long p = 0; p < np; p++)
            for (int r = 0; r < MR; r++)
                for (int h = 0; h < 2; h++) {
                    long kk = 2 * p + h;
                    ap[p * MR * 2 + r * 2 + h] = r < rows && kk < kn
                        ? (i16)code_at(codes, a->code_bytes, (i0 + r) * a->rs + (t * g->tk + kk) * a->cs) : 0;
                }
        ap += np * MR * 2;
    }
}

/* Scales of B's columns [j0, j0 + cols) in K-tiles [t0, t1) (as scales_a, by tiles of B). */
static void scales_b(const gemm_job *g, const hbfp_operand *b, const void *codes, const unsigned char *exps, long j0,
                     int cols, long t0, long t1, scales_t *sc)
{
    for (long t = t0; t < t1; t++) {
        scales_t *s = sc + (t - t0);
        s->safe = 1;
        for (int c = 0; c < cols;) {
            long j = j0 + c, tc = j / b->tw, end = (tc + 1) * b->tw - j0;
            if (end > cols)
                end = cols;
            int e = exps[t * b->ers + tc * b->ecs];
            if (e == 0) {
                for (; c < end; c++) {
                    int nz = any_code(codes, b->code_bytes, t * g->tk * b->rs + (j0 + c) * b->cs, tile_k(g, t), b->rs);
                    s->safe &= row_scales(e, b->frac, nz, 127, &s->sf[c], &s->sd[c]);
                }
                continue;
            }
            float f;
            double d;
            s->safe &= row_scales(e, b->frac, 1, 127, &f, &d);
            for (; c < end; c++) {
                s->sf[c] = f;
                s->sd[c] = d;
            }
        }
        for (int c = cols; c < NR; c++) {
            s->sf[c] = 1.0f;
            s->sd[c] = 1.0;
        }
    }
}

/* One pair of B's K-rows (x0, and x1 or none) over NR columns (cols valid), consecutive
   columns, into d: (x0[c], x1[c]) for c = 0 .. NR - 1. */
static inline void interleave_b(const void *x0, const void *x1, int bytes, int cols, i16 *restrict d)
{
#if defined(__AVX2__)
    if (cols == NR && bytes == 1) {
        __m256i a = _mm256_cvtepi8_epi16(_mm_loadu_si128(x0));
        __m256i b = x1 ? _mm256_cvtepi8_epi16(_mm_loadu_si128(x1)) : _mm256_setzero_si256();
        __m256i lo = _mm256_unpacklo_epi16(a, b), hi = _mm256_unpackhi_epi16(a, b);
        _mm256_storeu_si256((__m256i *)d, _mm256_permute2x128_si256(lo, hi, 0x20));
        _mm256_storeu_si256((__m256i *)(d + 16), _mm256_permute2x128_si256(lo, hi, 0x31));
        return;
    }
    if (cols == NR && bytes == 2) {
        __m256i a = _mm256_loadu_si256(x0);
        __m256i b = x1 ? _mm256_loadu_si256(x1) : _mm256_setzero_si256();
        __m256i lo = _mm256_unpacklo_epi16(a, b), hi = _mm256_unpackhi_epi16(a, b);
        _mm256_storeu_si256((__m256i *)d, _mm256_permute2x128_si256(lo, hi, 0x20));
        _mm256_storeu_si256((__m256i *)(d + 16), _mm256_permute2x128_si256(lo, hi, 0x31));
        return;
    }
#endif
    for (int c = 0; c < NR; c++) {
        d[2 * c] = c < cols ? (i16)code_at(x0, bytes, c) : 0;
        d[2 * c + 1] = c < cols && x1 ? (i16)code_at(x1, bytes, c) : 0;
    }
}

/* B's columns [j0, j0 + cols), K-tiles [t0, t1), B with consecutive columns. */
static void pack_b_rows(const gemm_job *g, const hbfp_operand *b, const void *codes, long j0, int cols, long t0,
                        long t1, i16 *bp)
{
    int by = b->code_bytes;
    for (long t = t0; t < t1; t++) {
        long kn = tile_k(g, t), np = (kn + 1) / 2;
        for (long p = 0; p < np; p++) {
            long k = t * g->tk + 2 * p;
            const char *x0 = (const char *)codes + (k * b->rs + j0) * by;
            interleave_b(x0, 2 * p + 1 < kn ? x0 + b->rs * by : NULL, by, cols, bp);
            bp += NR * 2;
        }
    }
}

/* B's columns [j0, j0 + cols), K-tiles [t0, t1), B with consecutive K (B^T stored): a
   column's pairs are consecutive, so the panel is a transpose of 32-bit pair units, four
   columns by four pairs at a time. */
static void pack_b_cols(const gemm_job *g, const hbfp_operand *b, const void *codes, long j0, int cols, long t0,
                        long t1, i16 *bp)
{
    int by = b->code_bytes;
    for (long t = t0; t < t1; t++) {
        long kn = tile_k(g, t), np = (kn + 1) / 2, p = 0;
        long kbase = t * g->tk;
#if defined(__AVX2__)
        if (cols == NR)
            for (; 2 * p + 8 <= kn; p += 4) { /* 4 pairs of all 16 columns */
                for (int c0 = 0; c0 < NR; c0 += 4) {
                    __m128i r[4];
                    for (int c = 0; c < 4; c++) {
                        const char *x = (const char *)codes + ((j0 + c0 + c) * b->cs + kbase + 2 * p) * by;
                        r[c] = by == 1 ? _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)x))
                                       : _mm_loadu_si128((const __m128i *)x);
                    }
                    /* r[c]: pairs p .. p+3 of column c0+c; to rows of pairs */
                    __m128i t0_ = _mm_unpacklo_epi32(r[0], r[1]), t1_ = _mm_unpackhi_epi32(r[0], r[1]);
                    __m128i t2_ = _mm_unpacklo_epi32(r[2], r[3]), t3_ = _mm_unpackhi_epi32(r[2], r[3]);
                    i16 *d = bp + p * NR * 2 + c0 * 2;
                    _mm_storeu_si128((__m128i *)d, _mm_unpacklo_epi64(t0_, t2_));
                    _mm_storeu_si128((__m128i *)(d + NR * 2), _mm_unpackhi_epi64(t0_, t2_));
                    _mm_storeu_si128((__m128i *)(d + 2 * NR * 2), _mm_unpacklo_epi64(t1_, t3_));
                    _mm_storeu_si128((__m128i *)(d + 3 * NR * 2), _mm_unpackhi_epi64(t1_, t3_));
                }
            }
#endif
        for (; p < np; p++)
            for (int c = 0; c < NR; c++)
                for (int h = 0; h < 2; h++) {
                    long kk = 2 * p + h;
                    bp[p * NR * 2 + c * 2 + h] = c < cols && kk < kn
                        ? (i16)code_at(codes, by, (j0 + c) * b->cs + (kbase + kk) * b->rs) : 0;
                }
        bp += np * NR * 2;
    }
}

/* B's columns [j0, j0 + cols) from any strides. */
static void pack_b_any(const gemm_job *g, const hbfp_operand *b, const void *codes, long j0, int cols, long t0,
                       long t1, i16 *bp)
{
    for (long t = t0; t < t1; t++) {
        long kn = tile_k(g, t), np = (kn + 1) / 2;
        for (long p = 0; p < np; p++)
            for (int c = 0; c < NR; c++)
                for (int h = 0; h < 2; h++) {
                    long kk = 2 * p + h;
                    bp[p * NR * 2 + c * 2 + h] = c < cols && kk < kn
                        ? (i16)code_at(codes, b->code_bytes, (t * g->tk + kk) * b->rs + (j0 + c) * b->cs) : 0;
                }
        bp += np * NR * 2;
    }
}

/* ---- the K-tile's fp32 step ------------------------------------------------------------ */

/* acc[r][c] += p for the exact sums s (int64: any width) by the exact route: p in double,
   rounded to fp32 at 24 bits (fp32(s) is s's RNE rounding; the power of two is exact), a
   result below 2**-126 a zero of its sign, overflow to inf, NaN from a NaN tile. */
static void step_exact(const long long *s, long lds, const scales_t *sa, const scales_t *sb, float *acc, long lda)
{
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < NR; c++) {
            double v = (double)(float)s[r * lds + c] * sa->sd[r] * sb->sd[c];
            float p = fabs(v) < 0x1p-126 ? copysignf(0.0f, (float)v) : (float)v;
            acc[r * lda + c] = add_ftz(acc[r * lda + c], p);
        }
}

/* The fast route on 32-bit sums, in C (the portable build, and the other builds' scalar
   tail): p = (fp32(s) * sa) * sb exactly as the contract rounds it, by hand. */
static void step_fast_c(const i32 *s, const scales_t *sa, const scales_t *sb, float *acc, long lda)
{
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < NR; c++) {
            float x = (float)s[r * NR + c] * sa->sf[r];                     /* exact */
            double v = (double)x * (double)sb->sf[c];                       /* exact */
            float p = fabs(v) < 0x1p-126 ? copysignf(0.0f, (float)v) : (float)v; /* one rounding */
            acc[r * lda + c] = add_ftz(acc[r * lda + c], p);
        }
}

/* ---- register tiles ---------------------------------------------------------------------- */

/* A packed panel of A: its layout, where its first K-tile starts and, by rows, the row stride. */
typedef struct {
    const i16 *p;
    long rstride;
    int layout;
} panel_a;

/* Row r's pair q of a K-tile starting at pair `off` of the panel. */
static inline const i16 *a_pair(const panel_a *a, long off, int r, long q)
{
    return a->layout == A_ROWS ? a->p + r * a->rstride + (off + q) * 2 : a->p + (off + q) * MR * 2 + r * 2;
}

/* int32 sums of one K-tile of np pairs: s[r][c] = sum over pairs of a0*b0 + a1*b1. */
static inline void tile_sums_c(const panel_a *a, long off, const i16 *bp, long np, i32 *s)
{
    i32 acc[MR][NR];
    memset(acc, 0, sizeof acc);
    for (long q = 0; q < np; q++, bp += NR * 2)
        for (int r = 0; r < MR; r++) {
            const i16 *x = a_pair(a, off, r, q);
            i32 a0 = x[0], a1 = x[1];
            for (int c = 0; c < NR; c++)
                acc[r][c] += a0 * bp[c * 2] + a1 * bp[c * 2 + 1];
        }
    memcpy(s, acc, sizeof acc);
}

/* The same in 64 bits (codes whose K-tile sums need more than 31 bits). */
static inline void tile_sums_wide(const panel_a *a, long off, const i16 *bp, long np, long long *s)
{
    long long acc[MR][NR];
    memset(acc, 0, sizeof acc);
    for (long q = 0; q < np; q++, bp += NR * 2)
        for (int r = 0; r < MR; r++) {
            const i16 *x = a_pair(a, off, r, q);
            long long a0 = x[0], a1 = x[1];
            for (int c = 0; c < NR; c++)
                acc[r][c] += a0 * bp[c * 2] + a1 * bp[c * 2 + 1];
        }
    memcpy(s, acc, sizeof acc);
}

#if defined(__AVX2__) && defined(__x86_64__)
/* The AVX2 register tile: 6 rows x 16 columns of int32 sums in ymm0-ymm11 (row r in ymm(2r),
   ymm(2r+1)), B's pair of 16 columns in ymm12-13, A's pair of row r broadcast in ymm14, the
   product in ymm15: per pair 12 vpmaddwd (each two exact products and their sum) and 12
   vpaddd. Written in asm because GCC spills this tile's accumulators to the stack. A's rows
   are read at A0 .. A5 (two layouts: by pairs, offsets 0 .. 20 of one pointer; by rows, two
   pointers and the row stride). */
#define AVX2_CLOBBER "cc", "memory", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", \
                     "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15"
#define AVX2_ZERO                                                                                       \
    "vpxor %%ymm0,%%ymm0,%%ymm0\n vpxor %%ymm1,%%ymm1,%%ymm1\n vpxor %%ymm2,%%ymm2,%%ymm2\n"          \
    "vpxor %%ymm3,%%ymm3,%%ymm3\n vpxor %%ymm4,%%ymm4,%%ymm4\n vpxor %%ymm5,%%ymm5,%%ymm5\n"          \
    "vpxor %%ymm6,%%ymm6,%%ymm6\n vpxor %%ymm7,%%ymm7,%%ymm7\n vpxor %%ymm8,%%ymm8,%%ymm8\n"          \
    "vpxor %%ymm9,%%ymm9,%%ymm9\n vpxor %%ymm10,%%ymm10,%%ymm10\n vpxor %%ymm11,%%ymm11,%%ymm11\n"
#define AVX2_ROW(src, a0, a1)                                                                           \
    "vpbroadcastd " src ",%%ymm14\n"                                                                    \
    "vpmaddwd %%ymm12,%%ymm14,%%ymm15\n vpmaddwd %%ymm13,%%ymm14,%%ymm14\n"                            \
    "vpaddd %%ymm15," a0 "," a0 "\n vpaddd %%ymm14," a1 "," a1 "\n"
#define AVX2_BODY(S0, S1, S2, S3, S4, S5)                                                               \
    "1:\n vmovdqu (%[bp]),%%ymm12\n vmovdqu 32(%[bp]),%%ymm13\n"                                        \
    AVX2_ROW(S0, "%%ymm0", "%%ymm1") AVX2_ROW(S1, "%%ymm2", "%%ymm3") AVX2_ROW(S2, "%%ymm4", "%%ymm5")  \
    AVX2_ROW(S3, "%%ymm6", "%%ymm7") AVX2_ROW(S4, "%%ymm8", "%%ymm9") AVX2_ROW(S5, "%%ymm10", "%%ymm11")
#define AVX2_LOOP_PAIRS                                                                                 \
    AVX2_BODY("(%[ap])", "4(%[ap])", "8(%[ap])", "12(%[ap])", "16(%[ap])", "20(%[ap])")                \
    "add $24,%[ap]\n add $64,%[bp]\n dec %[np]\n jnz 1b\n"
#define AVX2_LOOP_ROWS                                                                                  \
    AVX2_BODY("(%[ap])", "(%[ap],%[rs],1)", "(%[ap],%[rs],2)", "(%[a3])", "(%[a3],%[rs],1)",            \
              "(%[a3],%[rs],2)")                                                                        \
    "add $4,%[ap]\n add $4,%[a3]\n add $64,%[bp]\n dec %[np]\n jnz 1b\n"
/* Row r's fp32 step: p = (cvt(s) * sa[r]) * sb, acc += p (FTZ/DAZ from hbfp_fp_enter). */
#define AVX2_STEP(o, a0, a1)                                                                            \
    "vbroadcastss " #o "(%[sa]),%%ymm14\n vcvtdq2ps " a0 "," a0 "\n vcvtdq2ps " a1 "," a1 "\n"          \
    "vmulps %%ymm14," a0 "," a0 "\n vmulps %%ymm14," a1 "," a1 "\n"                                     \
    "vmulps %%ymm12," a0 "," a0 "\n vmulps %%ymm13," a1 "," a1 "\n"                                     \
    "vaddps (%[acc])," a0 "," a0 "\n vaddps 32(%[acc])," a1 "," a1 "\n"                                 \
    "vmovups " a0 ",(%[acc])\n vmovups " a1 ",32(%[acc])\n add %[lda],%[acc]\n"
#define AVX2_STEPS                                                                                      \
    "vmovups (%[sb]),%%ymm12\n vmovups 32(%[sb]),%%ymm13\n"                                             \
    AVX2_STEP(0, "%%ymm0", "%%ymm1") AVX2_STEP(4, "%%ymm2", "%%ymm3") AVX2_STEP(8, "%%ymm4", "%%ymm5")  \
    AVX2_STEP(12, "%%ymm6", "%%ymm7") AVX2_STEP(16, "%%ymm8", "%%ymm9") AVX2_STEP(20, "%%ymm10", "%%ymm11")
#define AVX2_STORE(o, a0, a1) "vmovdqu " a0 "," #o "(%[s])\n vmovdqu " a1 "," #o "+32(%[s])\n"
#define AVX2_STORES                                                                                     \
    AVX2_STORE(0, "%%ymm0", "%%ymm1") AVX2_STORE(64, "%%ymm2", "%%ymm3") AVX2_STORE(128, "%%ymm4", "%%ymm5") \
    AVX2_STORE(192, "%%ymm6", "%%ymm7") AVX2_STORE(256, "%%ymm8", "%%ymm9") AVX2_STORE(320, "%%ymm10", "%%ymm11")

/* One K-tile of np pairs: with `s` NULL, its fp32 step onto acc (row stride lda floats) with
   the scales sa, sb; else its int32 sums into s (MR x NR). */
static inline void tile_avx2(const panel_a *a, long off, const i16 *bp, long np, const float *sa, const float *sb,
                             float *acc, long lda, i32 *s)
{
    long ldb = lda * 4;
    if (a->layout == A_PAIRS) {
        const i16 *ap = a->p + off * MR * 2;
        if (s == NULL)
            __asm__ volatile(AVX2_ZERO AVX2_LOOP_PAIRS AVX2_STEPS
                             : [ap] "+r"(ap), [bp] "+r"(bp), [np] "+r"(np), [acc] "+r"(acc)
                             : [lda] "r"(ldb), [sa] "r"(sa), [sb] "r"(sb)
                             : AVX2_CLOBBER);
        else
            __asm__ volatile(AVX2_ZERO AVX2_LOOP_PAIRS AVX2_STORES
                             : [ap] "+r"(ap), [bp] "+r"(bp), [np] "+r"(np)
                             : [s] "r"(s)
                             : AVX2_CLOBBER);
    } else {
        const i16 *ap = a->p + off * 2, *a3 = ap + 3 * a->rstride;
        long rs = a->rstride * 2; /* bytes */
        if (s == NULL)
            __asm__ volatile(AVX2_ZERO AVX2_LOOP_ROWS AVX2_STEPS
                             : [ap] "+r"(ap), [a3] "+r"(a3), [bp] "+r"(bp), [np] "+r"(np), [acc] "+r"(acc)
                             : [lda] "r"(ldb), [sa] "r"(sa), [sb] "r"(sb), [rs] "r"(rs)
                             : AVX2_CLOBBER);
        else
            __asm__ volatile(AVX2_ZERO AVX2_LOOP_ROWS AVX2_STORES
                             : [ap] "+r"(ap), [a3] "+r"(a3), [bp] "+r"(bp), [np] "+r"(np)
                             : [s] "r"(s), [rs] "r"(rs)
                             : AVX2_CLOBBER);
    }
}
#endif

/* One register tile over K-tiles [t0, t1) of the packed panels: acc (MR x NR, row stride
   lda) += every K-tile's p in order. */
static void register_tile(const gemm_job *g, const panel_a *a, const scales_t *sa, const i16 *bp,
                          const scales_t *sb, long t0, long t1, float *acc, long lda)
{
    long off = 0;
    for (long t = t0; t < t1; t++) {
        long np = (tile_k(g, t) + 1) / 2;
        const scales_t *ra = sa + (t - t0), *rb = sb + (t - t0);
        if (g->wide) {
            long long s[MR * NR];
            tile_sums_wide(a, off, bp, np, s);
            step_exact(s, NR, ra, rb, acc, lda);
        } else if (ra->safe && rb->safe) {
#if defined(__AVX2__) && defined(__x86_64__)
            tile_avx2(a, off, bp, np, ra->sf, rb->sf, acc, lda, NULL);
#else
            i32 s[MR * NR];
            tile_sums_c(a, off, bp, np, s);
            step_fast_c(s, ra, rb, acc, lda);
#endif
        } else {
            i32 s[MR * NR] __attribute__((aligned(32)));
            long long w[MR * NR];
#if defined(__AVX2__) && defined(__x86_64__)
            tile_avx2(a, off, bp, np, NULL, NULL, acc, lda, s);
#else
            tile_sums_c(a, off, bp, np, s);
#endif
            for (int i = 0; i < MR * NR; i++)
                w[i] = s[i];
            step_exact(w, NR, ra, rb, acc, lda);
        }
        off += np;
        bp += np * NR * 2;
    }
}

/* ---- the output block ------------------------------------------------------------------ */

/* Pairs of K-tiles [t0, t1): their packed length along K. */
static long pairs(const gemm_job *g, long t0, long t1)
{
    long total = 0;
    for (long t = t0; t < t1; t++)
        total += (tile_k(g, t) + 1) / 2;
    return total;
}

/* Scratch of one thread, kept between calls (grown as needed, freed when the thread ends). */
static __thread void *scratch;
static __thread size_t scratch_bytes;
static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;

static void make_scratch_key(void)
{
    pthread_key_create(&scratch_key, free);
}

static void *thread_scratch(size_t bytes)
{
    if (bytes > scratch_bytes) {
        pthread_once(&scratch_once, make_scratch_key);
        free(scratch);
        scratch = aligned_alloc(64, (bytes + 63) / 64 * 64);
        scratch_bytes = scratch ? bytes : 0;
        pthread_setspecific(scratch_key, scratch);
    }
    return scratch;
}

static inline float flush(float x)
{
    return (f32_bits(x) & 0x7F800000u) == 0 ? bits_f32(f32_bits(x) & 0x80000000u) : x;
}

/* The start of one output block (rows x cols of acc, row stride lda): C, subnormals read as
   zeros, or +0 (acc may be C itself). */
static void read_c(const gemm_job *g, long bi, long r0, long rows, long c0, long cols, float *acc, long lda)
{
    const hbfp_output *o = g->o;
    for (long r = 0; r < rows; r++) {
        float *d = acc + r * lda;
        if (!o->c) {
            memset(d, 0, (size_t)cols * sizeof(float));
            continue;
        }
        const float *x = o->c + bi * o->bsc + (r0 + r) * o->ldc + c0;
        for (long c = 0; c < cols; c++)
            d[c] = flush(x[c]);
    }
}

/* The end of one output block: bias, activation, output format; written to out unless acc is
   out itself (`direct`). */
static void write_back(const gemm_job *g, long bi, long r0, long rows, long c0, long cols, float *acc, long lda,
                       int direct)
{
    const hbfp_output *o = g->o;
    for (long r = 0; r < rows; r++) {
        float *x = acc + r * lda;
        long at = bi * o->bso + (r0 + r) * o->ldo + c0;
        if (o->bias) {
            const float *bias = o->bias + c0;
            for (long c = 0; c < cols; c++)
                x[c] = add_ftz(x[c], flush(bias[c]));
        }
        if (direct)
            continue;
        if (o->table) {
            for (long c = 0; c < cols; c++)
                x[c] = bits_f32((unsigned)o->table[bf16_from_f32(x[c])] << 16);
        }
        if (o->out_bf16) {
            unsigned short *d = (unsigned short *)o->out + at;
            for (long c = 0; c < cols; c++)
                d[c] = bf16_from_f32(x[c]); /* exact where the activation's result already is bf16 */
        } else {
            memcpy((float *)o->out + at, x, (size_t)cols * sizeof(float));
        }
    }
}

/* A register tile onto acc at its place in the output, where it has only `rows` x `cols`
   (an edge of the product): through a full tile's buffer. */
static void edge_tile(const gemm_job *g, const panel_a *a, const scales_t *sa, const i16 *bp, const scales_t *sb,
                      long t0, long t1, float *acc, long lda, int rows, int cols)
{
    float tmp[MR * NR] __attribute__((aligned(32)));
    memset(tmp, 0, sizeof tmp);
    for (int r = 0; r < rows; r++)
        memcpy(tmp + r * NR, acc + r * lda, (size_t)cols * sizeof(float));
    register_tile(g, a, sa, bp, sb, t0, t1, tmp, NR);
    for (int r = 0; r < rows; r++)
        memcpy(acc + r * lda, tmp + r * NR, (size_t)cols * sizeof(float));
}

static int gemm_part(void *ctx, long part)
{
    const gemm_job *g = ctx;
    const hbfp_operand *a = g->a, *b = g->b;
    long per = g->row_blocks * g->col_blocks;
    long bi = part / per, rb = part % per / g->col_blocks, cb = part % g->col_blocks;
    long r0 = rb * g->rows, r1 = r0 + g->rows < g->m ? r0 + g->rows : g->m;
    long c0 = cb * g->cols, c1 = c0 + g->cols < g->n ? c0 + g->cols : g->n;
    const void *acodes = (const char *)a->codes + bi * a->bs * a->code_bytes;
    const void *bcodes = (const char *)b->codes + bi * b->bs * b->code_bytes;
    const unsigned char *aexps = a->exps + bi * a->ebs, *bexps = b->exps + bi * b->ebs;
    /* How each operand packs: A by rows where its K is consecutive, by pairs from consecutive
       rows or any other strides; B from consecutive columns, consecutive K, or any strides. */
    int a_rows = a->cs == 1, a_block = !a_rows && a->rs == 1;
    int b_kind = b->cs == 1 ? 0 : b->rs == 1 ? 1 : 2;

    long kct = KC_TARGET / g->tk > 0 ? KC_TARGET / g->tk : 1; /* K-tiles per K block */
    if (kct > g->kt)
        kct = g->kt;
    long kcp = pairs(g, 0, kct); /* the longest K block's pairs (the first is never shorter) */
    long ncb = c1 - c0 < NC ? c1 - c0 : NC;
    long ncp = (ncb + NR - 1) / NR * NR, mrows = (r1 - r0 + MR - 1) / MR * MR;
    size_t acc_bytes = (!g->o->out_bf16 && !g->o->table) ? 0 : (size_t)mrows * ncp * sizeof(float);
    size_t b_bytes = (size_t)(ncp / NR) * kcp * NR * 2 * sizeof(i16);
    size_t a_bytes = (size_t)(MC / MR) * kcp * MR * 2 * sizeof(i16);
    size_t sb_bytes = (size_t)(ncp / NR) * kct * sizeof(scales_t), sa_bytes = (size_t)(MC / MR) * kct * sizeof(scales_t);
    char *mem = thread_scratch(acc_bytes + b_bytes + a_bytes + sb_bytes + sa_bytes + 256);
    if (!mem)
        return HBFP_ENOMEM;
    /* The fp32 sums: in out itself where it is fp32 and nothing follows but the bias, else in
       the scratch. */
    const hbfp_output *o = g->o;
    int direct = !o->out_bf16 && !o->table;
    float *acc = direct ? (float *)o->out + bi * o->bso + r0 * o->ldo : (float *)mem;
    long lda = direct ? o->ldo : ncp;
    i16 *bpk = (i16 *)(mem + acc_bytes), *apk = (i16 *)(mem + acc_bytes + b_bytes);
    scales_t *bsc = (scales_t *)(mem + acc_bytes + b_bytes + a_bytes);
    scales_t *asc = (scales_t *)((char *)bsc + sb_bytes);

    /* GotoBLAS's loops: column blocks, K blocks (B's block packed once), row blocks (A's block
       packed), register tiles; the fp32 sums of the part's rows stay in acc over all of K,
       in K-tile order. */
    for (long jc = c0; jc < c1; jc += NC) {
        long nc = c1 - jc < NC ? c1 - jc : NC, npanels = (nc + NR - 1) / NR;
        float *blk = acc + (direct ? jc : 0);
        read_c(g, bi, r0, r1 - r0, jc, nc, blk, lda);
        for (long t0 = 0; t0 < g->kt; t0 += kct) {
            long t1 = t0 + kct < g->kt ? t0 + kct : g->kt, kp = pairs(g, t0, t1);
            for (long q = 0; q < npanels; q++) {
                long j = jc + q * NR;
                int cols = c1 - j < NR ? (int)(c1 - j) : NR;
                i16 *bq = bpk + q * kp * NR * 2;
                if (b_kind == 0)
                    pack_b_rows(g, b, bcodes, j, cols, t0, t1, bq);
                else if (b_kind == 1)
                    pack_b_cols(g, b, bcodes, j, cols, t0, t1, bq);
                else
                    pack_b_any(g, b, bcodes, j, cols, t0, t1, bq);
                scales_b(g, b, bcodes, bexps, j, cols, t0, t1, bsc + q * kct);
            }
            for (long ic = r0; ic < r1; ic += MC) {
                long mc = r1 - ic < MC ? r1 - ic : MC, mpanels = (mc + MR - 1) / MR;
                if (a_block)
                    pack_a_pairs_block(g, a, acodes, ic, mc, t0, t1, apk, kp * MR * 2);
                for (long q = 0; q < mpanels; q++) {
                    long i = ic + q * MR;
                    int rows = r1 - i < MR ? (int)(r1 - i) : MR;
                    i16 *aq = apk + q * kp * MR * 2;
                    if (a_rows)
                        pack_a_rows(g, a, acodes, i, rows, t0, t1, aq, kp * 2);
                    else if (!a_block)
                        pack_a_pairs(g, a, acodes, i, rows, t0, t1, aq);
                    scales_a(g, a, acodes, aexps, i, rows, t0, t1, asc + q * kct);
                }
                for (long qb = 0; qb < npanels; qb++) {
                    int cols = c1 - (jc + qb * NR) < NR ? (int)(c1 - (jc + qb * NR)) : NR;
                    for (long qa = 0; qa < mpanels; qa++) {
                        panel_a pa = {apk + qa * kp * MR * 2, kp * 2, a_rows ? A_ROWS : A_PAIRS};
                        int rows = r1 - (ic + qa * MR) < MR ? (int)(r1 - (ic + qa * MR)) : MR;
                        float *at = blk + (ic - r0 + qa * MR) * lda + qb * NR;
                        if (direct && (rows < MR || cols < NR))
                            edge_tile(g, &pa, asc + qa * kct, bpk + qb * kp * NR * 2, bsc + qb * kct, t0, t1, at, lda,
                                      rows, cols);
                        else
                            register_tile(g, &pa, asc + qa * kct, bpk + qb * kp * NR * 2, bsc + qb * kct, t0, t1, at,
                                          lda);
                    }
                }
            }
        }
        write_back(g, bi, r0, r1 - r0, jc, nc, blk, lda, direct);
    }
#if defined(__AVX2__)
    _mm256_zeroupper(); /* the asm tiles leave the upper halves dirty */
#endif
    return 0;
}

/* Multiply-adds below which one thread does the whole product. */
#define PARALLEL_MACS (1L << 20)
/* The most rows of a part (its fp32 sums stay in the thread's scratch over all of K). */
#define MAX_PART_ROWS 768

int hbfp_gemm(const hbfp_operand *a, const hbfp_operand *b, const hbfp_output *o, long batch, long m, long n, long k,
              int threads)
{
    if (batch < 0 || m < 0 || n < 0 || k < 0 || a->tw != b->th || a->tw < 1 || a->th < 1 || b->tw < 1 ||
        (a->code_bytes != 1 && a->code_bytes != 2) || (b->code_bytes != 1 && b->code_bytes != 2) || !o->out)
        return HBFP_EINVAL;
    if (batch == 0 || m == 0 || n == 0)
        return 0;
    gemm_job g = {a, b, o, m, n, k, a->tw, (k + a->tw - 1) / a->tw};
    /* The largest K-tile sum: tk codes of both bounds (a stored operand may hold one more than
       qmax, -2**(m-1)). */
    long kn = k < g.tk ? k : g.tk;
    unsigned long long bound = (unsigned long long)((kn + 1) / 2 * 2) * (unsigned long long)(a->qmax + 1) *
                               (unsigned long long)(b->qmax + 1);
    g.wide = bound >= (1ull << 31);
    g.sbits = 0;
    while (g.sbits < 63 && (1ull << g.sbits) < bound)
        g.sbits++;
    /* Parts: output blocks, at least four a thread where the product is large enough, taken
       by threads as they come free: the longer side is halved (to whole register tiles) until
       there are enough. */
    if (batch * m * n * (k > 0 ? k : 1) < PARALLEL_MACS)
        threads = 1;
    g.rows = m < MAX_PART_ROWS ? m : MAX_PART_ROWS;
    g.cols = n;
    for (long want = threads > 1 ? 4L * threads : 1;;) {
        long parts = batch * ((m + g.rows - 1) / g.rows) * ((n + g.cols - 1) / g.cols);
        if (parts >= want)
            break;
        if (g.cols >= g.rows && g.cols >= 2 * NR)
            g.cols = ((g.cols + 1) / 2 + NR - 1) / NR * NR;
        else if (g.rows >= 2 * MR)
            g.rows = ((g.rows + 1) / 2 + MR - 1) / MR * MR;
        else if (g.cols >= 2 * NR)
            g.cols = ((g.cols + 1) / 2 + NR - 1) / NR * NR;
        else
            break;
    }
    g.row_blocks = (m + g.rows - 1) / g.rows;
    g.col_blocks = (n + g.cols - 1) / g.cols;
    return hbfp_parallel(gemm_part, &g, batch * g.row_blocks * g.col_blocks, threads);
}
