/* The BFP product with exact integer K-tile sums (docs/numerics.md, section 3).

   For every output: acc = C (or +0), then for each K-tile in order acc += p, where p is the
   tile's exact integer sum s of code products, times 2**(E_A + E_B - 254 - frac_A - frac_B),
   rounded once to fp32 (RNE, a result below 2**-126 a zero of its sign, overflow to inf; NaN
   when either tile is NaN); then the bias, an activation on the bf16 rounding, fp32 or bf16 out.

   With AVX-512 VNNI, int8 codes are packed as quads along K for vpdpbusd (the VNNI path
   below). Otherwise the codes are packed as 16-bit pairs along K, so that one multiply-add
   instruction of the CPU (x86's vpmaddwd, or the compiler's vectorization of the portable
   loop) forms two products and their sum exactly: int8 or narrow int16 codes whose K-tile sums fit 31 bits
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
/* The AVX-512 VNNI tile (int8 codes): MR rows x VNR columns, two zmm registers of 16 int32
   sums a row; its B panels are VNR columns wide. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__x86_64__)
#define HBFP_VNNI 1
#define VNR 32
#define NRS VNR /* the scales of a B panel: room for the widest panel */
#define VNR_OR_NR VNR
#else
#define NRS NR
#define VNR_OR_NR NR
#endif
#define KC_TARGET 384 /* codes of K per block (rounded to whole K-tiles), at least */
#define KC_BYTES (1L << 22) /* packed panels of a K block, at most, where KC_TARGET is exceeded */
#define MC 24         /* rows of an output block (a multiple of MR) */
#define NC 512        /* columns of an output block (a multiple of NR) */

/* Per K-tile of a packed panel: the fp32 scales of its rows (A) or columns (B) for the fast
   epilogue, their powers of two (NAN_X for a NaN tile) for the exact one, and whether the fast
   epilogue may be used (every row or column safe). */
#define NAN_X 32767
typedef struct {
    float sf[MR];
    short x[MR];
    i32 corr[MR]; /* VNNI: -128 times the row's code sum over the K-tile (see vnni_tile) */
    char safe;
} scales_a_t;
typedef struct {
    float sf[NRS];
    short x[NRS];
    char safe;
} scales_b_t;

typedef struct {
    const hbfp_operand *a, *b;
    const hbfp_output *o;
    long batch, m, n, k, tk, kt; /* tk: the K side of the tiles; kt: K-tiles */
    long kct, kb, t0, t1, kp;   /* K-tiles per K block; the block being done: its K-tiles and pairs */
    long pa, pb;                /* panels of A (MR rows) and B (NR columns) per matrix */
    long a_group, b_group, a_tasks, b_tasks; /* panels per packing task, tasks per matrix */
    long rows, cols;            /* the output block of a part */
    long row_blocks, col_blocks;
    int wide;                   /* K-tile sums need more than 31 bits */
    int sbits;                  /* bits of the largest K-tile sum */
    int a_layout, a_block, b_kind; /* how the operands pack (see gemm_part) */
    int direct;                 /* the fp32 sums accumulate in out itself */
    int vnni;                   /* int8 codes in quads along K (the VNNI tile), else int16 pairs */
    int nr;                     /* columns of a B panel: NR, or VNR for the VNNI tile */
    i16 *apk, *bpk;             /* the K block's packed panels: [batch][panel][pairs] */
    scales_a_t *asc;            /* [batch][panel][K-tile] */
    scales_b_t *bsc;
    float *acc;                 /* the sums where not `direct`: [batch][m][n] */
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
static inline int row_scales(int e, int frac, int nonzero, int top, float *sf, short *xp)
{
    if (e == 0xFF) {
        *sf = __builtin_nanf("");
        *xp = NAN_X;
        return 1;
    }
    int x = e - 127 - frac;
    *xp = (short)x;
    if (e == 0 && !nonzero) { /* s = 0 whatever the scale: any normal one will do */
        *sf = 1.0f;
        return 1;
    }
    *sf = pow2f(x);
    return x >= -126 && x <= top;
}

/* 2**x exactly (NaN for NAN_X). */
static inline double scale_of(short x)
{
    return x == NAN_X ? __builtin_nan("") : pow2d(x);
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
                     int rows, long t0, long t1, scales_a_t *sc)
{
    int top = 127 - g->sbits;
    for (long t = t0; t < t1; t++) {
        scales_a_t *s = sc + (t - t0);
        s->safe = 1;
        for (int r = 0; r < rows;) {
            long i = i0 + r, tr = i / a->th, end = (tr + 1) * a->th - i0; /* rows of this tile */
            if (end > rows)
                end = rows;
            int e = exps[tr * a->ers + t * a->ecs];
            if (e == 0) {
                for (; r < end; r++) {
                    int nz = any_code(codes, a->code_bytes, (i0 + r) * a->rs + t * g->tk * a->cs, tile_k(g, t), a->cs);
                    s->safe &= row_scales(e, a->frac, nz, top, &s->sf[r], &s->x[r]);
                }
                continue;
            }
            float f;
            short x;
            s->safe &= row_scales(e, a->frac, 1, top, &f, &x);
            for (; r < end; r++) {
                s->sf[r] = f;
                s->x[r] = x;
            }
        }
        for (int r = rows; r < MR; r++) {
            s->sf[r] = 1.0f;
            s->x[r] = 0;
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
                     int cols, long t0, long t1, scales_b_t *sc)
{
    for (long t = t0; t < t1; t++) {
        scales_b_t *s = sc + (t - t0);
        s->safe = 1;
        for (int c = 0; c < cols;) {
            long j = j0 + c, tc = j / b->tw, end = (tc + 1) * b->tw - j0;
            if (end > cols)
                end = cols;
            int e = exps[t * b->ers + tc * b->ecs];
            if (e == 0) {
                for (; c < end; c++) {
                    int nz = any_code(codes, b->code_bytes, t * g->tk * b->rs + (j0 + c) * b->cs, tile_k(g, t), b->rs);
                    s->safe &= row_scales(e, b->frac, nz, 127, &s->sf[c], &s->x[c]);
                }
                continue;
            }
            float f;
            short x;
            s->safe &= row_scales(e, b->frac, 1, 127, &f, &x);
            for (; c < end; c++) {
                s->sf[c] = f;
                s->x[c] = x;
            }
        }
        for (int c = cols; c < g->nr; c++) {
            s->sf[c] = 1.0f;
            s->x[c] = 0;
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
static void step_exact(const long long *s, long lds, int nr, const scales_a_t *sa, const scales_b_t *sb, float *acc,
                       long lda)
{
    double da[MR], db[NRS];
    for (int r = 0; r < MR; r++)
        da[r] = scale_of(sa->x[r]);
    for (int c = 0; c < nr; c++)
        db[c] = scale_of(sb->x[c]);
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < nr; c++) {
            double v = (double)(float)s[r * lds + c] * da[r] * db[c];
            float p = fabs(v) < 0x1p-126 ? copysignf(0.0f, (float)v) : (float)v;
            acc[r * lda + c] = add_ftz(acc[r * lda + c], p);
        }
}

/* The fast route on 32-bit sums, in C (the portable build): p = (fp32(s) * sa) * sb exactly
   as the contract rounds it, by hand. */
#if !(defined(__AVX2__) && defined(__x86_64__))
static void step_fast_c(const i32 *s, const scales_a_t *sa, const scales_b_t *sb, float *acc, long lda)
{
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < NR; c++) {
            float x = (float)s[r * NR + c] * sa->sf[r];                     /* exact */
            double v = (double)x * (double)sb->sf[c];                       /* exact */
            float p = fabs(v) < 0x1p-126 ? copysignf(0.0f, (float)v) : (float)v; /* one rounding */
            acc[r * lda + c] = add_ftz(acc[r * lda + c], p);
        }
}
#endif

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

/* Row r's fp32 step within a run of K-tiles: acc rows at (acc) .. (acc3, lda, 2). */
#define AVX2_RUN_STEP(o, a0, a1, row)                                                                   \
    "vbroadcastss " #o "(%[sa]),%%ymm14\n vcvtdq2ps " a0 "," a0 "\n vcvtdq2ps " a1 "," a1 "\n"          \
    "vmulps %%ymm14," a0 "," a0 "\n vmulps %%ymm14," a1 "," a1 "\n"                                     \
    "vmulps %%ymm12," a0 "," a0 "\n vmulps %%ymm13," a1 "," a1 "\n"                                     \
    "vaddps " row "," a0 "," a0 "\n vaddps 32+" row "," a1 "," a1 "\n"                                   \
    "vmovups " a0 "," row "\n vmovups " a1 ",32+" row "\n"
#define AVX2_RUN_STEPS                                                                                  \
    "vmovups (%[sb]),%%ymm12\n vmovups 32(%[sb]),%%ymm13\n"                                             \
    AVX2_RUN_STEP(0, "%%ymm0", "%%ymm1", "(%[acc])") AVX2_RUN_STEP(4, "%%ymm2", "%%ymm3", "(%[acc],%[lda],1)") \
    AVX2_RUN_STEP(8, "%%ymm4", "%%ymm5", "(%[acc],%[lda],2)") AVX2_RUN_STEP(12, "%%ymm6", "%%ymm7", "(%[acc3])") \
    AVX2_RUN_STEP(16, "%%ymm8", "%%ymm9", "(%[acc3],%[lda],1)")                                        \
    AVX2_RUN_STEP(20, "%%ymm10", "%%ymm11", "(%[acc3],%[lda],2)")
#define AVX2_INNER_PAIRS                                                                                \
    AVX2_BODY("(%[ap])", "4(%[ap])", "8(%[ap])", "12(%[ap])", "16(%[ap])", "20(%[ap])")                \
    "add $24,%[ap]\n add $64,%[bp]\n dec %[np]\n jnz 1b\n"
#define AVX2_INNER_ROWS                                                                                 \
    AVX2_BODY("(%[ap])", "(%[ap],%[rs],1)", "(%[ap],%[rs],2)", "(%[a3])", "(%[a3],%[rs],1)",            \
              "(%[a3],%[rs],2)")                                                                        \
    "add $4,%[ap]\n add $4,%[a3]\n add $64,%[bp]\n dec %[np]\n jnz 1b\n"

/* A run of nt K-tiles of np pairs each, every one safe: their fp32 steps onto acc in order,
   the scales of tile i at sa + i * sizeof(scales_a_t) and sb + i * sizeof(scales_b_t). The
   K-tile loop is in the asm too: a tile is only np pairs (12 for HBFP8). */
static inline void run_avx2(const panel_a *a, long off, const i16 *bp, long np, long nt, const scales_a_t *sa,
                            const scales_b_t *sb, float *acc, long lda)
{
    long ldb = lda * 4, cnt;
    float *acc3 = acc + 3 * lda;
    const float *pa = sa->sf, *pb = sb->sf;
    if (a->layout == A_PAIRS) {
        const i16 *ap = a->p + off * MR * 2;
        __asm__ volatile("2:\n mov %[n0],%[np]\n" AVX2_ZERO AVX2_INNER_PAIRS AVX2_RUN_STEPS
                         "add %[ssa],%[sa]\n add %[ssb],%[sb]\n dec %[nt]\n jnz 2b\n"
                         : [ap] "+r"(ap), [bp] "+r"(bp), [np] "=&r"(cnt), [nt] "+r"(nt), [sa] "+r"(pa), [sb] "+r"(pb)
                         : [n0] "rm"(np), [acc] "r"(acc), [acc3] "r"(acc3), [lda] "r"(ldb),
                           [ssa] "i"(sizeof(scales_a_t)), [ssb] "i"(sizeof(scales_b_t))
                         : AVX2_CLOBBER);
    } else {
        const i16 *ap = a->p + off * 2, *a3 = ap + 3 * a->rstride;
        long rs = a->rstride * 2; /* bytes */
        __asm__ volatile("2:\n mov %[n0],%[np]\n" AVX2_ZERO AVX2_INNER_ROWS AVX2_RUN_STEPS
                         "add %[ssa],%[sa]\n add %[ssb],%[sb]\n dec %[nt]\n jnz 2b\n"
                         : [ap] "+r"(ap), [a3] "+r"(a3), [bp] "+r"(bp), [np] "=&r"(cnt), [nt] "+r"(nt),
                           [sa] "+r"(pa), [sb] "+r"(pb)
                         : [n0] "rm"(np), [acc] "r"(acc), [acc3] "r"(acc3), [lda] "r"(ldb), [rs] "r"(rs),
                           [ssa] "i"(sizeof(scales_a_t)), [ssb] "i"(sizeof(scales_b_t))
                         : AVX2_CLOBBER);
    }
}

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

#ifdef HBFP_VNNI
/* ---- the AVX-512 VNNI path: int8 codes in quads along K ------------------------------------

   vpdpbusd multiplies four unsigned bytes by four signed bytes and adds the four products to
   an int32 lane, exactly. A's codes are the signed side, broadcast from the panel; B's are made
   unsigned by adding 128 (flipping the sign bit), so a lane sums a * (b + 128), and the K-tile
   sum is that minus 128 * sum(a): the sums start from corr = -128 * (the row's code sum over
   the K-tile), worked out while A is packed. Each K-tile is padded to whole quads with zero
   codes of A (what B holds there is multiplied by zero). Any int8 code takes part, -128 (a raw
   operand's) included: every partial sum fits int32 while tk * 255 * 128 < 2**31.

   Panels: A's (MR rows) quad after quad, each the MR rows' four codes (k .. k + 3); B's (VNR
   columns) quad after quad, each the VNR columns' four codes + 128. A quad is 4 bytes, as an
   int16 pair is, so the driver's panel sizes in units (pairs or quads) hold for both. */

/* Largest K side of a tile for the VNNI tile (its int32 lanes never wrap). */
#define VNNI_TK_MAX 32768

static inline long quads(long kn)
{
    return (kn + 3) / 4;
}

/* A's rows [i0, i0 + rows), K-tiles [t0, t1), as quads into ap; each K-tile's corr into sc. */
static void pack_a_quads(const gemm_job *g, const hbfp_operand *a, const void *codes, long i0, int rows, long t0,
                         long t1, i8 *ap, scales_a_t *sc)
{
    int by = a->code_bytes;
    for (long t = t0; t < t1; t++) {
        long kn = tile_k(g, t), nq = quads(kn), k0 = t * g->tk;
        scales_a_t *s = sc + (t - t0);
        for (int r = 0; r < MR; r++) {
            i32 sum = 0;
            i8 *d = ap + r * 4;
            if (r >= rows) {
                for (long q = 0; q < nq; q++)
                    memset(d + q * MR * 4, 0, 4);
            } else if (by == 1 && a->cs == 1) { /* the row's K-tile is consecutive */
                const i8 *x = (const i8 *)codes + (i0 + r) * a->rs + k0;
                long k = 0;
                for (; k + 4 <= kn; k += 4, d += MR * 4) {
                    memcpy(d, x + k, 4);
                    sum += x[k] + x[k + 1] + x[k + 2] + x[k + 3];
                }
                for (int h = 0; k < kn && h < 4; h++) {
                    d[h] = k + h < kn ? x[k + h] : 0;
                    sum += d[h];
                }
            } else {
                long at = (i0 + r) * a->rs + k0 * a->cs;
                for (long q = 0; q < nq; q++, d += MR * 4)
                    for (int h = 0; h < 4; h++) {
                        long kk = 4 * q + h;
                        d[h] = kk < kn ? (i8)code_at(codes, by, at + kk * a->cs) : 0;
                        sum += d[h];
                    }
            }
            s->corr[r] = -128 * sum;
        }
        ap += nq * MR * 4;
    }
}

/* Rows [i0, i0 + rows) of an A stored with consecutive rows (A^T's rows are K) into panels
   of MR rows at ap + q * pstride (bytes), K-tiles [t0, t1): per quad, four K-rows' codes of
   up to 96 rows interleaved at once (SSE2 unpacks), then each panel's MR of them copied out;
   the corr of panel q's K-tile t at sc + q * kt + t - t0. */
static void pack_a_quads_block(const gemm_job *g, const hbfp_operand *a, const void *codes, long i0, long rows,
                               long t0, long t1, i8 *ap, long pstride, scales_a_t *sc)
{
    enum { CHUNK = 96 };
    i32 inter[CHUNK + MR] __attribute__((aligned(16)));
    i32 sums[CHUNK + MR];
    long panels = (rows + MR - 1) / MR, off = 0; /* quads so far */
    for (long t = t0; t < t1; t++) {
        long kn = tile_k(g, t), nq = quads(kn);
        for (long r0 = 0; r0 < rows; r0 += CHUNK) {
            long w = rows - r0 < CHUNK ? rows - r0 : CHUNK;
            for (long r = 0; r < CHUNK + MR; r++)
                sums[r] = 0;
            for (long q = 0; q < nq; q++) {
                const i8 *x[4];
                i8 zero[CHUNK] = {0};
                for (int h = 0; h < 4; h++) {
                    long kk = 4 * q + h;
                    x[h] = kk < kn ? (const i8 *)codes + (t * g->tk + kk) * a->cs + i0 + r0 : zero;
                }
                long r = 0;
                for (; r + 16 <= w; r += 16) {
                    __m128i v0 = _mm_loadu_si128((const __m128i *)(x[0] + r));
                    __m128i v1 = _mm_loadu_si128((const __m128i *)(x[1] + r));
                    __m128i v2 = _mm_loadu_si128((const __m128i *)(x[2] + r));
                    __m128i v3 = _mm_loadu_si128((const __m128i *)(x[3] + r));
                    __m128i lo01 = _mm_unpacklo_epi8(v0, v1), hi01 = _mm_unpackhi_epi8(v0, v1);
                    __m128i lo23 = _mm_unpacklo_epi8(v2, v3), hi23 = _mm_unpackhi_epi8(v2, v3);
                    _mm_store_si128((__m128i *)(inter + r), _mm_unpacklo_epi16(lo01, lo23));
                    _mm_store_si128((__m128i *)(inter + r + 4), _mm_unpackhi_epi16(lo01, lo23));
                    _mm_store_si128((__m128i *)(inter + r + 8), _mm_unpacklo_epi16(hi01, hi23));
                    _mm_store_si128((__m128i *)(inter + r + 12), _mm_unpackhi_epi16(hi01, hi23));
                }
                for (; r < w; r++) {
                    i8 v[4] = {x[0][r], x[1][r], x[2][r], x[3][r]};
                    memcpy(inter + r, v, 4);
                }
                for (r = w; r < CHUNK + MR; r++)
                    inter[r] = 0;
                for (r = 0; r < w; r++)
                    sums[r] += x[0][r] + x[1][r] + x[2][r] + x[3][r];
                for (long p = r0 / MR; p < panels && p * MR < r0 + w; p++)
                    memcpy(ap + p * pstride + (off + q) * MR * 4, inter + (p * MR - r0), MR * 4);
            }
            for (long p = r0 / MR; p < panels && p * MR < r0 + w; p++) {
                scales_a_t *s = sc + p * g->kt + (t - t0);
                for (int r = 0; r < MR; r++)
                    s->corr[r] = -128 * sums[p * MR - r0 + r];
            }
        }
        off += nq;
    }
}

/* B's columns [j0, j0 + cols), K-tiles [t0, t1), as quads of codes + 128 into bp. */
static void pack_b_quads(const gemm_job *g, const hbfp_operand *b, const void *codes, long j0, int cols, long t0,
                         long t1, unsigned char *bp)
{
    int by = b->code_bytes;
    const __m128i flip = _mm_set1_epi8((char)0x80);
    if (by == 1 && b->rs == 1 && cols == VNR && g->tk % 4 == 0) {
        /* B^T stored, whole K-tiles of whole quads: the panel's quads are each column's K run
           as it lies, so blocks of 4 columns x 4 quads are transposed as 32-bit units */
        long tf = t1 > t0 && tile_k(g, t1 - 1) < g->tk ? t1 - 1 : t1, nq = (tf - t0) * (g->tk / 4), q = 0;
        const i8 *x = (const i8 *)codes + j0 * b->cs + t0 * g->tk;
        for (; q + 4 <= nq; q += 4)
            for (int c0 = 0; c0 < VNR; c0 += 4) {
                const i8 *xc = x + c0 * b->cs + 4 * q;
                __m128i r0 = _mm_loadu_si128((const __m128i *)xc);
                __m128i r1 = _mm_loadu_si128((const __m128i *)(xc + b->cs));
                __m128i r2 = _mm_loadu_si128((const __m128i *)(xc + 2 * b->cs));
                __m128i r3 = _mm_loadu_si128((const __m128i *)(xc + 3 * b->cs));
                __m128i u0 = _mm_unpacklo_epi32(r0, r1), u1 = _mm_unpackhi_epi32(r0, r1);
                __m128i u2 = _mm_unpacklo_epi32(r2, r3), u3 = _mm_unpackhi_epi32(r2, r3);
                unsigned char *d = bp + q * VNR * 4 + c0 * 4;
                _mm_storeu_si128((__m128i *)d, _mm_xor_si128(_mm_unpacklo_epi64(u0, u2), flip));
                _mm_storeu_si128((__m128i *)(d + VNR * 4), _mm_xor_si128(_mm_unpackhi_epi64(u0, u2), flip));
                _mm_storeu_si128((__m128i *)(d + 2 * VNR * 4), _mm_xor_si128(_mm_unpacklo_epi64(u1, u3), flip));
                _mm_storeu_si128((__m128i *)(d + 3 * VNR * 4), _mm_xor_si128(_mm_unpackhi_epi64(u1, u3), flip));
            }
        for (; q < nq; q++)
            for (int c = 0; c < VNR; c++) {
                unsigned v;
                memcpy(&v, x + c * b->cs + 4 * q, 4);
                v ^= 0x80808080u;
                memcpy(bp + q * VNR * 4 + 4 * c, &v, 4);
            }
        bp += nq * VNR * 4;
        t0 = tf; /* the last, partial K-tile (if any) below */
    }
    for (long t = t0; t < t1; t++) {
        long kn = tile_k(g, t), nq = quads(kn), k0 = t * g->tk;
        for (long q = 0; q < nq; q++, bp += VNR * 4) {
            long k = k0 + 4 * q;
            int full = 4 * q + 4 <= kn;
            if (full && cols == VNR && by == 1 && b->cs == 1) { /* four K-rows of consecutive columns */
                for (int half = 0; half < 2; half++) {
                    const i8 *x0 = (const i8 *)codes + k * b->rs + j0 + 16 * half;
                    __m128i v0 = _mm_loadu_si128((const __m128i *)x0);
                    __m128i v1 = _mm_loadu_si128((const __m128i *)(x0 + b->rs));
                    __m128i v2 = _mm_loadu_si128((const __m128i *)(x0 + 2 * b->rs));
                    __m128i v3 = _mm_loadu_si128((const __m128i *)(x0 + 3 * b->rs));
                    __m128i lo01 = _mm_unpacklo_epi8(v0, v1), hi01 = _mm_unpackhi_epi8(v0, v1);
                    __m128i lo23 = _mm_unpacklo_epi8(v2, v3), hi23 = _mm_unpackhi_epi8(v2, v3);
                    __m128i *d = (__m128i *)(bp + 64 * half);
                    _mm_storeu_si128(d, _mm_xor_si128(_mm_unpacklo_epi16(lo01, lo23), flip));
                    _mm_storeu_si128(d + 1, _mm_xor_si128(_mm_unpackhi_epi16(lo01, lo23), flip));
                    _mm_storeu_si128(d + 2, _mm_xor_si128(_mm_unpacklo_epi16(hi01, hi23), flip));
                    _mm_storeu_si128(d + 3, _mm_xor_si128(_mm_unpackhi_epi16(hi01, hi23), flip));
                }
            } else if (full && by == 1 && b->rs == 1) { /* B^T stored: a column's quad is consecutive */
                int c = 0;
                for (; c < cols; c++) {
                    unsigned v;
                    memcpy(&v, (const i8 *)codes + (j0 + c) * b->cs + k, 4);
                    v ^= 0x80808080u;
                    memcpy(bp + 4 * c, &v, 4);
                }
                memset(bp + 4 * c, 0x80, (size_t)(VNR - c) * 4);
            } else {
                for (int c = 0; c < VNR; c++)
                    for (int h = 0; h < 4; h++) {
                        long kk = 4 * q + h;
                        long v = c < cols && kk < kn ? code_at(codes, by, (k0 + kk) * b->rs + (j0 + c) * b->cs) : 0;
                        bp[4 * c + h] = (unsigned char)(v + 128);
                    }
            }
        }
    }
}

/* A's four codes of row r in the quad at p, broadcast to every lane. */
static inline __m512i vnni_a(const i8 *p)
{
    return _mm512_set1_epi32(_mm_cvtsi128_si32(_mm_loadu_si32(p)));
}

/* The int32 sums of one K-tile of nq quads (corr included) in s[MR][2]. */
#define VNNI_SUMS(s, ap, bp, nq, corr)                                                                  \
    do {                                                                                                \
        for (int r_ = 0; r_ < MR; r_++)                                                                 \
            s[r_][0] = s[r_][1] = _mm512_set1_epi32((corr)[r_]);                                        \
        for (long q_ = 0; q_ < (nq); q_++, ap += MR * 4, bp += VNR * 4) {                               \
            __m512i b0_ = _mm512_loadu_si512(bp), b1_ = _mm512_loadu_si512(bp + 64);                    \
            for (int r_ = 0; r_ < MR; r_++) {                                                           \
                __m512i x_ = vnni_a(ap + 4 * r_);                                                       \
                s[r_][0] = _mm512_dpbusd_epi32(s[r_][0], b0_, x_);                                      \
                s[r_][1] = _mm512_dpbusd_epi32(s[r_][1], b1_, x_);                                      \
            }                                                                                           \
        }                                                                                               \
    } while (0)

/* A run of K-tiles [t, t1), every one safe: their fp32 steps onto acc (MR x VNR, row stride
   lda) in order, p = (fp32(s) * sa) * sb as in the AVX2 tile, from +0 where `zero` (acc is not
   read); the fp32 sums stay in registers over the run. */
static void vnni_run(const gemm_job *g, const i8 *ap, const unsigned char *bp, long t, long t1, const scales_a_t *sa,
                     const scales_b_t *sb, float *acc, long lda, int zero)
{
    __m512 f[MR][2];
    for (int r = 0; r < MR; r++) {
        f[r][0] = zero ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + r * lda);
        f[r][1] = zero ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + r * lda + 16);
    }
    for (; t < t1; t++, sa++, sb++) {
        __m512i s[MR][2];
        long nq = quads(tile_k(g, t));
        VNNI_SUMS(s, ap, bp, nq, sa->corr);
        __m512 y0 = _mm512_loadu_ps(sb->sf), y1 = _mm512_loadu_ps(sb->sf + 16);
        for (int r = 0; r < MR; r++) {
            __m512 x = _mm512_set1_ps(sa->sf[r]);
            f[r][0] = _mm512_add_ps(f[r][0], _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s[r][0]), x), y0));
            f[r][1] = _mm512_add_ps(f[r][1], _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s[r][1]), x), y1));
        }
    }
    for (int r = 0; r < MR; r++) {
        _mm512_storeu_ps(acc + r * lda, f[r][0]);
        _mm512_storeu_ps(acc + r * lda + 16, f[r][1]);
    }
}

/* One register tile over K-tiles [t0, t1) of the quad panels: runs of safe K-tiles at once,
   any other K-tile by its int32 sums and the exact route; from +0 where `zero` (acc not read). */
static void register_tile_vnni(const gemm_job *g, const i8 *ap, const scales_a_t *sa, const unsigned char *bp,
                               const scales_b_t *sb, long t0, long t1, float *acc, long lda, int zero)
{
    for (long t = t0; t < t1;) {
        long nq = quads(tile_k(g, t));
        const scales_a_t *ra = sa + (t - t0);
        const scales_b_t *rb = sb + (t - t0);
        if (ra->safe && rb->safe) {
            long end = t + 1, n = 0;
            while (end < t1 && sa[end - t0].safe && sb[end - t0].safe)
                end++;
            vnni_run(g, ap, bp, t, end, ra, rb, acc, lda, zero);
            for (; t < end; t++)
                n += quads(tile_k(g, t));
            ap += n * MR * 4;
            bp += n * VNR * 4;
        } else {
            if (zero)
                for (int r = 0; r < MR; r++)
                    memset(acc + r * lda, 0, VNR * sizeof(float));
            __m512i s[MR][2];
            long long w[MR * VNR];
            i32 lanes[16];
            VNNI_SUMS(s, ap, bp, nq, ra->corr);
            for (int r = 0; r < MR; r++)
                for (int h = 0; h < 2; h++) {
                    _mm512_storeu_si512(lanes, s[r][h]);
                    for (int c = 0; c < 16; c++)
                        w[r * VNR + 16 * h + c] = lanes[c];
                }
            step_exact(w, VNR, VNR, ra, rb, acc, lda);
            t++;
        }
        zero = 0;
    }
}
#endif

/* One register tile over K-tiles [t0, t1) of the packed panels: acc (MR x NR, row stride
   lda) += every K-tile's p in order. */
static void register_tile(const gemm_job *g, const panel_a *a, const scales_a_t *sa, const i16 *bp,
                          const scales_b_t *sb, long t0, long t1, float *acc, long lda, int zero)
{
#ifdef HBFP_VNNI
    if (g->vnni) {
        register_tile_vnni(g, (const i8 *)a->p, sa, (const unsigned char *)bp, sb, t0, t1, acc, lda, zero);
        return;
    }
#endif
    if (zero)
        for (int r = 0; r < MR; r++)
            memset(acc + r * lda, 0, NR * sizeof(float));
    long off = 0;
    for (long t = t0; t < t1; t++) {
        long np = (tile_k(g, t) + 1) / 2;
        const scales_a_t *ra = sa + (t - t0);
        const scales_b_t *rb = sb + (t - t0);
        if (g->wide) {
            long long s[MR * NR];
            tile_sums_wide(a, off, bp, np, s);
            step_exact(s, NR, NR, ra, rb, acc, lda);
        } else if (ra->safe && rb->safe) {
#if defined(__AVX2__) && defined(__x86_64__)
            /* the run of safe K-tiles of this length from here, at once */
            long end = t + 1;
            while (end < t1 && sa[end - t0].safe && sb[end - t0].safe && (tile_k(g, end) + 1) / 2 == np)
                end++;
            run_avx2(a, off, bp, np, end - t, ra, rb, acc, lda);
            off += np * (end - t - 1);
            bp += np * NR * 2 * (end - t - 1);
            t = end - 1;
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
            step_exact(w, NR, NR, ra, rb, acc, lda);
        }
        off += np;
        bp += np * NR * 2;
    }
}

/* ---- the output block ------------------------------------------------------------------ */

/* The packed length along K of K-tiles [t0, t1): pairs, or quads for the VNNI tile. */
static long units(const gemm_job *g, long t0, long t1)
{
    long total = 0;
    for (long t = t0; t < t1; t++)
        total += g->vnni ? (tile_k(g, t) + 3) / 4 : (tile_k(g, t) + 1) / 2;
    return total;
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
        if (g->kt || o->bias) /* every NaN an addition made: the one quiet NaN (golden F32_QNAN) */
            for (long c = 0; c < cols; c++)
                x[c] = (f32_bits(x[c]) & 0x7FFFFFFFu) > 0x7F800000u ? bits_f32(0x7FC00000u) : x[c];
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
static void edge_tile(const gemm_job *g, const panel_a *a, const scales_a_t *sa, const i16 *bp, const scales_b_t *sb,
                      long t0, long t1, float *acc, long lda, int rows, int cols)
{
    float tmp[MR * NRS] __attribute__((aligned(64)));
    int nr = g->nr;
    memset(tmp, 0, sizeof tmp);
    for (int r = 0; r < rows; r++)
        memcpy(tmp + r * nr, acc + r * lda, (size_t)cols * sizeof(float));
    register_tile(g, a, sa, bp, sb, t0, t1, tmp, nr, 0);
    for (int r = 0; r < rows; r++)
        memcpy(acc + r * lda, tmp + r * nr, (size_t)cols * sizeof(float));
}

/* One packing task of the K block: a group of A's panels or of B's of one matrix. */
static int pack_part(void *ctx, long task)
{
    const gemm_job *g = ctx;
    const hbfp_operand *a = g->a, *b = g->b;
    long per = g->a_tasks + g->b_tasks, bi = task / per, t = task % per;
    long t0 = g->t0, t1 = g->t1, kp = g->kp;
    if (t < g->a_tasks) {
        const void *codes = (const char *)a->codes + bi * a->bs * a->code_bytes;
        const unsigned char *exps = a->exps + bi * a->ebs;
        long q0 = t * g->a_group, q1 = q0 + g->a_group < g->pa ? q0 + g->a_group : g->pa;
        i16 *base = g->apk + bi * g->pa * kp * MR * 2;
        scales_a_t *sc = g->asc + bi * g->pa * g->kt + t0;
        long rows_in = (q1 * MR < g->m ? q1 * MR : g->m) - q0 * MR;
#ifdef HBFP_VNNI
        if (g->vnni && g->a_block) /* rows of consecutive codes: all the group's rows at once */
            pack_a_quads_block(g, a, codes, q0 * MR, rows_in, t0, t1, (i8 *)(base + q0 * kp * MR * 2), kp * MR * 4,
                               sc + q0 * g->kt);
#endif
        if (g->a_block && !g->vnni)
            pack_a_pairs_block(g, a, codes, q0 * MR, rows_in, t0, t1, base + q0 * kp * MR * 2, kp * MR * 2);
        for (long q = q0; q < q1; q++) {
            long i = q * MR;
            int rows = g->m - i < MR ? (int)(g->m - i) : MR;
            i16 *aq = base + q * kp * MR * 2;
            if (!g->vnni && g->a_layout == A_ROWS)
                pack_a_rows(g, a, codes, i, rows, t0, t1, aq, kp * 2);
            else if (!g->vnni && !g->a_block)
                pack_a_pairs(g, a, codes, i, rows, t0, t1, aq);
#ifdef HBFP_VNNI
            else if (g->vnni && !g->a_block)
                pack_a_quads(g, a, codes, i, rows, t0, t1, (i8 *)aq, sc + q * g->kt);
#endif
            scales_a(g, a, codes, exps, i, rows, t0, t1, sc + q * g->kt);
        }
    } else {
        t -= g->a_tasks;
        const void *codes = (const char *)b->codes + bi * b->bs * b->code_bytes;
        const unsigned char *exps = b->exps + bi * b->ebs;
        long q0 = t * g->b_group, q1 = q0 + g->b_group < g->pb ? q0 + g->b_group : g->pb;
        int nr = g->nr;
        i16 *base = g->bpk + bi * g->pb * kp * nr * 2;
        for (long q = q0; q < q1; q++) {
            long j = q * nr;
            int cols = g->n - j < nr ? (int)(g->n - j) : nr;
            i16 *bq = base + q * kp * nr * 2;
#ifdef HBFP_VNNI
            if (g->vnni)
                pack_b_quads(g, b, codes, j, cols, t0, t1, (unsigned char *)bq);
            else
#endif
            if (g->b_kind == 0)
                pack_b_rows(g, b, codes, j, cols, t0, t1, bq);
            else if (g->b_kind == 1)
                pack_b_cols(g, b, codes, j, cols, t0, t1, bq);
            else
                pack_b_any(g, b, codes, j, cols, t0, t1, bq);
            scales_b(g, b, codes, exps, j, cols, t0, t1, g->bsc + (bi * g->pb + q) * g->kt + t0);
        }
    }
#if defined(__AVX2__)
    _mm256_zeroupper();
#endif
    return 0;
}

/* One output block of the K block (GotoBLAS's loops on the packed panels: column blocks of NC,
   row blocks of MC, register tiles); the fp32 sums start from C at the first K block and get
   their epilogue after the last, so every output adds its K-tiles in order. */
static int gemm_part(void *ctx, long part)
{
    const gemm_job *g = ctx;
    const hbfp_output *o = g->o;
    long per = g->row_blocks * g->col_blocks;
    long bi = part / per, rb = part % per / g->col_blocks, cb = part % g->col_blocks;
    long r0 = rb * g->rows, r1 = r0 + g->rows < g->m ? r0 + g->rows : g->m;
    long c0 = cb * g->cols, c1 = c0 + g->cols < g->n ? c0 + g->cols : g->n;
    long kp = g->kp, t0 = g->t0, t1 = g->t1;
    int first = g->t0 == 0, last = g->t1 >= g->kt;
    float *acc = g->direct ? (float *)o->out + bi * o->bso : g->acc + bi * g->m * g->n;
    long lda = g->direct ? o->ldo : g->n;
    int nr = g->nr;
    const i16 *apk = g->apk + bi * g->pa * kp * MR * 2, *bpk = g->bpk + bi * g->pb * kp * nr * 2;
    const scales_a_t *asc = g->asc + bi * g->pa * g->kt;
    const scales_b_t *bsc = g->bsc + bi * g->pb * g->kt;
    for (long jc = c0; jc < c1; jc += NC) {
        long nc = c1 - jc < NC ? c1 - jc : NC, q0b = jc / nr, npanels = (nc + nr - 1) / nr;
        for (long ic = r0; ic < r1; ic += MC) {
            long mc = r1 - ic < MC ? r1 - ic : MC, q0a = ic / MR, mpanels = (mc + MR - 1) / MR;
            float *blk = acc + ic * lda + jc;
            /* from C (subnormals read as zeros), while the block is in the cache, or +0: then
               the tiles start from zeros of their own and the block is not read first */
            int zero = first && !o->c && t1 > t0;
            if (first && !zero)
                read_c(g, bi, ic, mc, jc, nc, blk, lda);
            for (long qb = q0b; qb < q0b + npanels && t1 > t0; qb++) {
                int cols = c1 - qb * nr < nr ? (int)(c1 - qb * nr) : nr;
                for (long qa = q0a; qa < q0a + mpanels; qa++) {
                    panel_a pa = {apk + qa * kp * MR * 2, kp * 2, g->a_layout};
                    int rows = r1 - qa * MR < MR ? (int)(r1 - qa * MR) : MR;
                    float *at = acc + qa * MR * lda + qb * nr;
                    /* the sums have only the product's rows and columns: a tile at their edge
                       goes through a full tile's buffer */
                    if (rows < MR || cols < nr) {
                        for (int r = 0; zero && r < rows; r++)
                            memset(at + r * lda, 0, (size_t)cols * sizeof(float));
                        edge_tile(g, &pa, asc + qa * g->kt + t0, bpk + qb * kp * nr * 2, bsc + qb * g->kt + t0, t0, t1,
                                  at, lda, rows, cols);
                    } else {
                        register_tile(g, &pa, asc + qa * g->kt + t0, bpk + qb * kp * nr * 2, bsc + qb * g->kt + t0,
                                      t0, t1, at, lda, zero);
                    }
                }
            }
            if (last)
                write_back(g, bi, ic, mc, jc, nc, blk, lda, g->direct);
        }
    }
#if defined(__AVX2__)
    _mm256_zeroupper(); /* the asm tiles leave the upper halves dirty */
#endif
    return 0;
}

/* Multiply-adds below which one thread does the whole product. */
#define PARALLEL_MACS (1L << 23)

/* The packed panels and scales of a call live in the calling thread's buffer HBFP_BUFFER_GEMM,
   kept for its next call (a training step's products come one after another). */

int hbfp_gemm(const hbfp_operand *a, const hbfp_operand *b, const hbfp_output *o, long batch, long m, long n, long k,
              int threads)
{
    if (batch < 0 || m < 0 || n < 0 || k < 0 || a->tw != b->th || a->tw < 1 || a->th < 1 || b->tw < 1 ||
        (a->code_bytes != 1 && a->code_bytes != 2) || (b->code_bytes != 1 && b->code_bytes != 2) || !o->out)
        return HBFP_EINVAL;
    if (batch == 0 || m == 0 || n == 0)
        return 0;
    gemm_job g = {a, b, o, batch, m, n, k, a->tw, (k + a->tw - 1) / a->tw};
    /* The largest K-tile sum: tk codes of both bounds (a stored operand may hold one more than
       qmax, -2**(m-1)). */
    long kn = k < g.tk ? k : g.tk;
    unsigned long long bound = (unsigned long long)((kn + 1) / 2 * 2) * (unsigned long long)(a->qmax + 1) *
                               (unsigned long long)(b->qmax + 1);
    g.wide = bound >= (1ull << 31);
    g.sbits = 0;
    while (g.sbits < 63 && (1ull << g.sbits) < bound)
        g.sbits++;
    /* How each operand packs: A by rows where its K is consecutive, by pairs from consecutive
       rows (a block of rows at once) or any other strides; B from consecutive columns,
       consecutive K, or any strides. */
    g.a_layout = a->cs == 1 ? A_ROWS : A_PAIRS;
    g.a_block = a->cs != 1 && a->rs == 1;
    g.b_kind = b->cs == 1 ? 0 : b->rs == 1 ? 1 : 2;
    g.direct = !o->out_bf16 && !o->table;
#ifdef HBFP_VNNI
    /* int8 codes (or narrower in int16) take the VNNI tile */
    g.vnni = !g.wide && g.tk <= VNNI_TK_MAX && (a->code_bytes == 1 || a->qmax < 127) &&
             (b->code_bytes == 1 || b->qmax < 127);
    if (g.vnni)
        g.a_block = a->cs != 1 && a->rs == 1 && a->code_bytes == 1;
#endif
    g.nr = g.vnni ? VNR_OR_NR : NR;
    g.pa = (m + MR - 1) / MR;
    g.pb = (n + g.nr - 1) / g.nr;
    g.kct = KC_TARGET / g.tk > 0 ? KC_TARGET / g.tk : 1;
    {
        /* Longer K blocks where the packed panels stay under KC_BYTES (a thin product, a
           weight's gradient: few rows or columns, K long; or all of a 1024-long K): fewer
           blocks, fewer passes of the threads through packing and back, each a wait for the
           slowest thread where other work shares the cores. */
        long per_code = batch * (g.pa * MR + g.pb * g.nr) * (g.vnni ? 1 : 2);
        long kct = KC_BYTES / (per_code > 0 ? per_code : 1) / g.tk;
        if (kct > g.kct)
            g.kct = kct;
    }
    if (g.kct > g.kt)
        g.kct = g.kt > 0 ? g.kt : 1;
    if (batch * m * n * (k > 0 ? k : 1) < PARALLEL_MACS)
        threads = 1;
    /* Parts of the product: output blocks, at least four a thread where there are enough,
       taken by threads as they come free: the longer side halved (to whole register tiles). */
    g.rows = m;
    g.cols = n;
    for (long want = threads > 1 ? 4L * threads : 1;;) {
        long parts = batch * ((m + g.rows - 1) / g.rows) * ((n + g.cols - 1) / g.cols);
        if (parts >= want)
            break;
        if (g.cols >= g.rows && g.cols >= 2 * g.nr)
            g.cols = ((g.cols + 1) / 2 + g.nr - 1) / g.nr * g.nr;
        else if (g.rows >= 2 * MC)
            g.rows = ((g.rows + 1) / 2 + MC - 1) / MC * MC;
        else if (g.cols >= 2 * g.nr)
            g.cols = ((g.cols + 1) / 2 + g.nr - 1) / g.nr * g.nr;
        else if (g.rows >= 2 * MR)
            g.rows = ((g.rows + 1) / 2 + MR - 1) / MR * MR;
        else
            break;
    }
    g.row_blocks = (m + g.rows - 1) / g.rows;
    g.col_blocks = (n + g.cols - 1) / g.cols;
    /* Packing tasks: groups of panels, about four a thread over both operands. */
    long want = threads > 1 ? (4L * threads + batch - 1) / batch : 1;
    g.a_tasks = want < g.pa ? want : g.pa;
    g.b_tasks = want < g.pb ? want : g.pb;
    g.a_group = (g.pa + g.a_tasks - 1) / g.a_tasks;
    g.b_group = (g.pb + g.b_tasks - 1) / g.b_tasks;
    if (g.a_block) /* whole chunks of 16 panels (pack_a_pairs_block's rows) */
        g.a_group = (g.a_group + 15) / 16 * 16;
    g.a_tasks = (g.pa + g.a_group - 1) / g.a_group;
    g.b_tasks = (g.pb + g.b_group - 1) / g.b_group;

    long kpmax = units(&g, 0, g.kct > g.kt ? g.kt : g.kct);
    size_t a_bytes = (size_t)batch * g.pa * kpmax * MR * 2 * sizeof(i16);
    size_t b_bytes = (size_t)batch * g.pb * kpmax * g.nr * 2 * sizeof(i16);
    size_t sa_bytes = (size_t)batch * g.pa * (g.kt > 0 ? g.kt : 1) * sizeof(scales_a_t);
    size_t sb_bytes = (size_t)batch * g.pb * (g.kt > 0 ? g.kt : 1) * sizeof(scales_b_t);
    size_t acc_bytes = g.direct ? 0 : (size_t)batch * m * n * sizeof(float);
    char *mem = hbfp_thread_buffer(HBFP_BUFFER_GEMM, a_bytes + b_bytes + sa_bytes + sb_bytes + acc_bytes + 5 * 64);
    int rc = mem ? 0 : HBFP_ENOMEM;
    if (mem) {
        char *at = mem;
        g.apk = (i16 *)at;
        at += (a_bytes + 63) / 64 * 64;
        g.bpk = (i16 *)at;
        at += (b_bytes + 63) / 64 * 64;
        g.asc = (scales_a_t *)at;
        at += (sa_bytes + 63) / 64 * 64;
        g.bsc = (scales_b_t *)at;
        at += (sb_bytes + 63) / 64 * 64;
        g.acc = (float *)at;
        /* K block by K block: pack both operands' panels of the block, then every part's
           register tiles over it (with no K-tile, one pass: C or +0, the bias, the epilogue). */
        for (g.t0 = 0; rc == 0; g.t0 += g.kct) {
            g.t1 = g.t0 + g.kct < g.kt ? g.t0 + g.kct : g.kt;
            g.kp = units(&g, g.t0, g.t1);
            if (g.t1 > g.t0)
                rc = hbfp_parallel(pack_part, &g, batch * (g.a_tasks + g.b_tasks), threads);
            if (rc == 0)
                rc = hbfp_parallel(gemm_part, &g, batch * g.row_blocks * g.col_blocks, threads);
            if (g.t1 >= g.kt)
                break;
        }
    }
    return rc;
}
