/* bfp.quantize of a matrix, bit for bit (docs/numerics.md, section 2): per tile the largest
   exponent field, then every element scaled exactly by the tile's power of two and rounded
   (nearest even, toward zero, or stochastically with the generator of bfp.random_bits). */

#include <stdlib.h>
#include <string.h>

#include "common.h"

/* ---- quantize (bfp.quantize of a matrix, bit for bit) ------------------------------------ */

/* mix32's two multipliers (golden/bfp.py's MIX32_MULTIPLIERS), for every width below. */
#define MIX32_M1 0x7FEB352Du
#define MIX32_M2 0x846CA68Bu

static inline unsigned mix32(unsigned x)
{
    x ^= x >> 16;
    x *= MIX32_M1;
    x ^= x >> 15;
    x *= MIX32_M2;
    x ^= x >> 16;
    return x;
}


/* One row of a band (see quantize_bands), in precision F (float or double) with scales SC. */
#define QUANTIZE_ROW(T, F, SC, RINT, TRUNC)                                                  \
    {                                                                                        \
        T *out = (T *)codes + (r0 + r) * ldq;                                                \
        const F fmax = (F)qmax;                                                              \
        if (rounding == 0) {                                                                 \
            for (long c = 0; c < n; c++) {                                                   \
                float v = xr[c];                                                             \
                F y = ((f32_bits(v) >> 23) & 0xFF) - 1u < 254u ? (F)v * SC[c] : (F)0;       \
                F q = RINT(y);                                                               \
                q = q > fmax ? fmax : q < -fmax ? -fmax : q;                                 \
                out[c] = (T)q;                                                               \
            }                                                                                \
        } else if (rounding == 1) {                                                          \
            for (long c = 0; c < n; c++) {                                                   \
                float v = xr[c];                                                             \
                F y = ((f32_bits(v) >> 23) & 0xFF) - 1u < 254u ? (F)v * SC[c] : (F)0;       \
                F q = TRUNC(y);                                                              \
                q = q > fmax ? fmax : q < -fmax ? -fmax : q;                                 \
                out[c] = (T)q;                                                               \
            }                                                                                \
        } else {                                                                             \
            unsigned base = band_pos + (unsigned)(r * tw);                                   \
            for (long c = 0; c < n; c++) {                                                   \
                float v = xr[c];                                                             \
                F y = ((f32_bits(v) >> 23) & 0xFF) - 1u < 254u ? (F)v * SC[c] : (F)0;       \
                F a = y < 0 ? -y : y;                                                        \
                unsigned mag = (unsigned)(a * (F)65536); /* floor of a nonnegative < 2**31 */ \
                unsigned q = (mag + (mix32((base + posc[c]) ^ key) >> 16)) >> 16;           \
                q = q > (unsigned)qmax ? (unsigned)qmax : q;                                 \
                out[c] = (T)(y < 0 ? -(int)q : (int)q);                                      \
            }                                                                                \
        }                                                                                    \
    }

/* A band of one tile column over contiguous rows: len values from xb under one scale S. */
#define QUANTIZE_FLAT(T, F, S, RINT, TRUNC)                                                  \
    {                                                                                        \
        T *out = (T *)codes + r0 * ldq;                                                      \
        const F fmax = (F)qmax, sc_ = S;                                                     \
        if (rounding == 0) {                                                                 \
            for (long i = 0; i < len; i++) {                                                 \
                float v = xb[i];                                                             \
                F y = ((f32_bits(v) >> 23) & 0xFF) - 1u < 254u ? (F)v * sc_ : (F)0;         \
                F q = RINT(y);                                                               \
                q = q > fmax ? fmax : q < -fmax ? -fmax : q;                                 \
                out[i] = (T)q;                                                               \
            }                                                                                \
        } else {                                                                             \
            for (long i = 0; i < len; i++) {                                                 \
                float v = xb[i];                                                             \
                F y = ((f32_bits(v) >> 23) & 0xFF) - 1u < 254u ? (F)v * sc_ : (F)0;         \
                F q = TRUNC(y);                                                              \
                q = q > fmax ? fmax : q < -fmax ? -fmax : q;                                 \
                out[i] = (T)q;                                                               \
            }                                                                                \
        }                                                                                    \
    }


#if defined(__AVX2__)
/* mix32 on 8 lanes. */
static inline __m256i mix32x8(__m256i x)
{
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)MIX32_M1));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)MIX32_M2));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
/* mix32 on 16 lanes. */
static inline __m512i mix32x16(__m512i x)
{
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)MIX32_M1));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)MIX32_M2));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

/* quantize_row_avx2's work 16 elements at a time, the same operations lane for lane (a dead
   lane's product +0, stochastic rounding's sign from y's sign bit, saturating packs of values
   already within +-qmax). Returns how many it did (a multiple of 16). */
static long quantize_row_avx512(const float *x, long n, const float *sc, float s, int rounding, unsigned key,
                                unsigned base, const unsigned *pos, int qmax, void *out, int code_bytes)
{
    const __m512i exp_mask = _mm512_set1_epi32(0xFF), zero = _mm512_setzero_si512(), top = _mm512_set1_epi32(0xFF);
    const __m512 fmax = _mm512_set1_ps((float)qmax), fmin = _mm512_set1_ps(-(float)qmax);
    const __m512i imax = _mm512_set1_epi32(qmax), vkey = _mm512_set1_epi32((int)key), vbase = _mm512_set1_epi32((int)base);
    const __m512 sv = _mm512_set1_ps(s), two16 = _mm512_set1_ps(65536.0f);
    long c = 0;
    for (; c + 16 <= n; c += 16) {
        __m512 v = _mm512_loadu_ps(x + c);
        __m512i e = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(v), 23), exp_mask);
        __mmask16 live = _mm512_cmpneq_epi32_mask(e, zero) & _mm512_cmpneq_epi32_mask(e, top);
        __m512 y = _mm512_maskz_mul_ps(live, v, sc ? _mm512_loadu_ps(sc + c) : sv);
        __m512i q;
        if (rounding == 2) {
            __m512i mag = _mm512_cvttps_epi32(_mm512_mul_ps(_mm512_abs_ps(y), two16));
            __m512i at = _mm512_add_epi32(vbase, _mm512_loadu_si512((const void *)(pos + c)));
            __m512i rnd = _mm512_srli_epi32(mix32x16(_mm512_xor_si512(at, vkey)), 16);
            q = _mm512_min_epi32(_mm512_srli_epi32(_mm512_add_epi32(mag, rnd), 16), imax);
            q = _mm512_mask_sub_epi32(q, _mm512_movepi32_mask(_mm512_castps_si512(y)), zero, q);
        } else {
            __m512 r = rounding == 0 ? _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
                                     : _mm512_roundscale_ps(y, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            q = _mm512_cvtps_epi32(_mm512_max_ps(_mm512_min_ps(r, fmax), fmin));
        }
        if (code_bytes == 2)
            _mm256_storeu_si256((__m256i *)((i16 *)out + c), _mm512_cvtsepi32_epi16(q));
        else
            _mm_storeu_si128((__m128i *)((i8 *)out + c), _mm512_cvtsepi32_epi8(q));
    }
    return c;
}
#endif

/* QUANTIZE_ROW's fp32 case, 8 elements at a time: values x[0 .. n) (subnormals, infinities
   and NaNs read as zero: their tiles have scale 0 or are NaN tiles), scales sc (or, where sc is
   NULL, one scale s), rounded (0: nearest even, 1: toward zero, 2: stochastic at stream
   positions base + pos[c]), saturated to +-qmax, stored as 1- or 2-byte codes. Returns how
   many it did (a multiple of 8; the caller finishes the row). */
static long quantize_row_avx2(const float *x, long n, const float *sc, float s, int rounding, unsigned key,
                              unsigned base, const unsigned *pos, int qmax, void *out, int code_bytes)
{
    const __m256i exp_mask = _mm256_set1_epi32(0xFF), zero = _mm256_setzero_si256(),
                  all = _mm256_set1_epi32(-1), top = _mm256_set1_epi32(0xFF);
    const __m256 fmax = _mm256_set1_ps((float)qmax), fmin = _mm256_set1_ps(-(float)qmax);
    const __m256i imax = _mm256_set1_epi32(qmax), vkey = _mm256_set1_epi32((int)key), vbase = _mm256_set1_epi32((int)base);
    const __m256 sv = _mm256_set1_ps(s), two16 = _mm256_set1_ps(65536.0f), absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    long c = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
    c = quantize_row_avx512(x, n, sc, s, rounding, key, base, pos, qmax, out, code_bytes);
#endif
    for (; c + 8 <= n; c += 8) {
        __m256 v = _mm256_loadu_ps(x + c);
        __m256i e = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(v), 23), exp_mask);
        __m256i dead = _mm256_or_si256(_mm256_cmpeq_epi32(e, zero), _mm256_cmpeq_epi32(e, top));
        __m256 y = _mm256_mul_ps(v, sc ? _mm256_loadu_ps(sc + c) : sv);
        y = _mm256_and_ps(y, _mm256_castsi256_ps(_mm256_xor_si256(dead, all)));
        __m256i q;
        if (rounding == 2) {
            __m256i mag = _mm256_cvttps_epi32(_mm256_mul_ps(_mm256_and_ps(y, absmask), two16));
            __m256i at = _mm256_add_epi32(vbase, _mm256_loadu_si256((const __m256i *)(pos + c)));
            __m256i rnd = _mm256_srli_epi32(mix32x8(_mm256_xor_si256(at, vkey)), 16);
            q = _mm256_min_epi32(_mm256_srli_epi32(_mm256_add_epi32(mag, rnd), 16), imax);
            q = _mm256_sign_epi32(q, _mm256_castps_si256(y));
        } else {
            __m256 r = rounding == 0 ? _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
                                     : _mm256_round_ps(y, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            q = _mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(r, fmax), fmin));
        }
        /* 8 int32 to 8 codes: pack (lane-wise), then put the lanes in order */
        __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(q, q), 0x08); /* 8 int16 in the low 128 bits */
        if (code_bytes == 2) {
            _mm_storeu_si128((__m128i *)((i16 *)out + c), _mm256_castsi256_si128(w));
        } else {
            __m128i b = _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_castsi256_si128(w));
            _mm_storel_epi64((__m128i *)((i8 *)out + c), b);
        }
    }
    return c;
}
#endif

/* One element by QUANTIZE_ROW's fp32 rule (the vector loop's tail). */
static inline void quantize_one(float v, float sc, int rounding, unsigned key, unsigned at, int qmax, void *out,
                                int code_bytes, long c)
{
    float y = ((f32_bits(v) >> 23) & 0xFF) - 1u < 254u ? v * sc : 0.0f;
    int q;
    if (rounding == 2) {
        float a = y < 0 ? -y : y;
        unsigned u = ((unsigned)(a * 65536.0f) + (mix32(at ^ key) >> 16)) >> 16;
        q = u > (unsigned)qmax ? qmax : (int)u;
        q = y < 0 ? -q : q;
    } else {
        float r = rounding == 0 ? __builtin_rintf(y) : __builtin_truncf(y);
        r = r > (float)qmax ? (float)qmax : r < -(float)qmax ? -(float)qmax : r;
        q = (int)r;
    }
    if (code_bytes == 2)
        ((i16 *)out)[c] = (i16)q;
    else
        ((i8 *)out)[c] = (i8)q;
}

/* A tile's scale 2**(frac + 127 - E) (within double's normal range for every E), 0 outside live
   tiles; clears *in_f32 unless fp32 holds it, and then x * scale exactly (a product below
   2**-126 rounds to no code in any mode either way): 2**-126 <= scale <= 2**127. */
static double tile_scale_for(unsigned emax, int frac, int *in_f32)
{
    int live = emax != 0 && emax != 0xFF, shift = frac + 127 - (int)emax;
    union { unsigned long long u; double d; } sv = {(unsigned long long)(shift + 1023) << 52};
    *in_f32 &= !live || (shift >= -126 && shift <= 127);
    return live ? sv.d : 0.0;
}

/* M (QUANTIZE_ROW or QUANTIZE_FLAT) for the code width, in fp32 with scales SF where IN_F32,
   else in double with SD. */
#define QUANTIZE_DISPATCH(M, IN_F32, SF, SD)                                                 \
    if (IN_F32) {                                                                            \
        if (code_bytes == 1)                                                                 \
            M(signed char, float, SF, __builtin_rintf, __builtin_truncf)                     \
        else if (code_bytes == 2)                                                            \
            M(short, float, SF, __builtin_rintf, __builtin_truncf)                           \
        else                                                                                 \
            M(int, float, SF, __builtin_rintf, __builtin_truncf)                             \
    } else if (code_bytes == 1)                                                              \
        M(signed char, double, SD, __builtin_rint, __builtin_trunc)                          \
    else if (code_bytes == 2)                                                                \
        M(short, double, SD, __builtin_rint, __builtin_trunc)                                \
    else                                                                                     \
        M(int, double, SD, __builtin_rint, __builtin_trunc)

/* Tile-row bands [band0, band1) of x (m x n, row stride rs, consecutive columns) to codes (row
   stride ldq; 1, 2 or 4 bytes) and E8M0 exponents (row stride lde): per tile the largest
   exponent field (0xFF: a NaN tile, its codes 0); per element of a live tile
   y = x * 2**(frac + 127 - E), exact (in fp32 when every live tile's scale is a normal fp32,
   else in double), subnormals read as zero, rounded (0: nearest even, 1: toward zero, 2: stochastic with the 16 random bits mix32(position ^ key) >> 16 of
   its tile-major stream position), then saturated to +-qmax. A band goes row by row over all
   its columns, each column with its tile's scale (0 outside live tiles): long loops with no
   branches on the data, which vectorize. Returns 0, or -1 if out of memory. */
static int quantize_bands(const float *x, long rs, long m, long n, long th, long tw, int mbits, int rounding,
                          unsigned key, void *codes, int code_bytes, long ldq, unsigned char *exps, long lde,
                          long band0, long band1, unsigned base, long xrow0)
{
    /* x holds the matrix's rows from xrow0 on (0: all of them; a band gathered elsewhere: im2col) */
    long tc = (n + tw - 1) / tw;
    int frac = mbits - 2;
    double qmax = (double)((1LL << (mbits - 1)) - 1);
    /* the scratch of a band, in this thread's buffer (a call per band: no allocation each) */
    double *sc = hbfp_thread_buffer(HBFP_BUFFER_QUANTIZE, (size_t)n * (sizeof(double) + 3 * sizeof(unsigned)));
    if (!sc)
        return -1;
    unsigned *colmax = (unsigned *)(sc + n), *posc = colmax + n;
    float *scf = (float *)(posc + n);
    /* A column's stream position within its band, less the row's: tile-major, row-major in a
       tile (stochastic rounding's only). */
    for (long c = 0, t = 0, i = 0; c < n && rounding == 2; c++) {
        posc[c] = (unsigned)((unsigned long long)t * (unsigned long long)(th * tw) + (unsigned long long)i);
        if (++i == tw) {
            i = 0;
            t++;
        }
    }
    /* One tile column over contiguous rows (a narrow matrix): a band is one run of rows * n
       values under one scale, quantized as a whole (nearest even and toward zero). */
    int flat = tc == 1 && rs == n && ldq == n && rounding != 2;
    for (long b = band0; b < band1 && flat; b++) {
        long r0 = b * th, len = (m - r0 < th ? m - r0 : th) * n;
        const float *xb = x + (r0 - xrow0) * rs;
        unsigned emax = 0;
        for (long i = 0; i < len; i++) {
            unsigned e = (f32_bits(xb[i]) >> 23) & 0xFF;
            emax = e > emax ? e : emax;
        }
        exps[b * lde] = (unsigned char)emax;
        int in_f32 = 1;
        double sd = tile_scale_for(emax, frac, &in_f32);
        float sf = (float)sd;
#if defined(__AVX2__)
        if (in_f32 && code_bytes <= 2) {
            void *row = (char *)codes + r0 * ldq * code_bytes;
            long done = quantize_row_avx2(xb, len, NULL, sf, rounding, key, 0, NULL, (int)qmax, row, code_bytes);
            for (long i = done; i < len; i++)
                quantize_one(xb[i], sf, rounding, key, 0, (int)qmax, row, code_bytes, i);
            continue;
        }
#endif
        QUANTIZE_DISPATCH(QUANTIZE_FLAT, in_f32, sf, sd)
    }
    for (long b = band0; b < band1 && !flat; b++) {
        long r0 = b * th, rows = m - r0 < th ? m - r0 : th;
        unsigned band_pos = base + (unsigned)(((unsigned long long)b * (unsigned long long)(tc * th * tw)) & 0xFFFFFFFFull);
        memset(colmax, 0, (size_t)n * sizeof(unsigned));
        int narrow = 1; /* every live tile's scale a normal fp32: the rows in fp32 */
        for (long r = 0; r < rows; r++) {
            const float *xr = x + (r0 - xrow0 + r) * rs;
            for (long c = 0; c < n; c++) {
                unsigned e = (f32_bits(xr[c]) >> 23) & 0xFF;
                colmax[c] = e > colmax[c] ? e : colmax[c];
            }
        }
        for (long t = 0; t < tc; t++) {
            long c0 = t * tw, c1 = c0 + tw < n ? c0 + tw : n;
            unsigned emax = 0;
            for (long c = c0; c < c1; c++)
                emax = colmax[c] > emax ? colmax[c] : emax;
            exps[b * lde + t] = (unsigned char)emax;
            double s = tile_scale_for(emax, frac, &narrow);
            for (long c = c0; c < c1; c++) {
                sc[c] = s;
                scf[c] = (float)s;
            }
        }
        for (long r = 0; r < rows; r++) {
            const float *xr = x + (r0 - xrow0 + r) * rs;
#if defined(__AVX2__)
            if (narrow && code_bytes <= 2) {
                void *row = (char *)codes + (r0 + r) * ldq * code_bytes;
                long done = quantize_row_avx2(xr, n, scf, 0.0f, rounding, key, band_pos + (unsigned)(r * tw), posc,
                                              (int)qmax, row, code_bytes);
                for (long c = done; c < n; c++) /* the row's last few, by the scalar rule */
                    quantize_one(xr[c], scf[c], rounding, key, band_pos + (unsigned)(r * tw) + posc[c], (int)qmax,
                                 row, code_bytes, c);
                continue;
            }
#endif
            QUANTIZE_DISPATCH(QUANTIZE_ROW, narrow, scf, sc)
        }
    }
    return 0;
}

/* Elements below which one thread quantizes the whole matrix. */
#define PARALLEL_ELEMENTS (1L << 17)

typedef struct {
    const float *x;
    long rs, cs, m, n, th, tw;
    int mbits, rounding;
    unsigned key;
    void *codes;
    int code_bytes;
    long ldq;
    unsigned char *exps;
    long lde, step, tr, chunks, xbs, cbs, ebs;
    unsigned long long pos_step;
} quantize_job;

static int quantize_part(void *ctx, long p)
{
    const quantize_job *j = ctx;
    long bi = p / j->chunks, b0 = p % j->chunks * j->step, b1 = b0 + j->step < j->tr ? b0 + j->step : j->tr;
    const float *x = j->x + bi * j->xbs;
    void *codes = (char *)j->codes + bi * j->cbs * j->code_bytes;
    unsigned base = (unsigned)((bi * j->pos_step) & 0xFFFFFFFFull);
    if (j->cs == 1 || j->n <= 1)
        return quantize_bands(x, j->rs, j->m, j->n, j->th, j->tw, j->mbits, j->rounding, j->key, codes, j->code_bytes,
                              j->ldq, j->exps + bi * j->ebs, j->lde, b0, b1, base, 0);
    /* Columns apart (a transposed view): each band's rows gathered into a buffer first, reading
       down the stored rows where they are the band's columns (rs == 1), then quantized there. */
    long ldb = j->n + 16; /* rows 64 bytes more than n apart: rows a multiple of 4 KiB apart share L1 sets */
    float *band = malloc((size_t)(j->th * ldb) * sizeof(float));
    if (!band)
        return HBFP_ENOMEM;
    int rc = 0;
    for (long b = b0; b < b1 && !rc; b++) {
        long r0 = b * j->th, rows = j->m - r0 < j->th ? j->m - r0 : j->th, c = 0;
#if defined(__AVX2__)
        /* A transposed view (rs == 1): blocks of 8 stored rows x 8 of their values through the
           registers, where they become 8 band rows x 8 columns. */
        if (j->rs == 1 && rows >= 8)
            for (; c + 8 <= j->n; c += 8) {
                long r = 0;
                for (; r + 8 <= rows; r += 8)
                    transpose8(x + r0 + r + c * j->cs, j->cs, band + r * ldb + c, ldb);
                for (; r < rows; r++)
                    for (long i = 0; i < 8; i++)
                        band[r * ldb + c + i] = x[r0 + r + (c + i) * j->cs];
            }
#endif
        for (; c < j->n; c++) {
            const float *xc = x + r0 * j->rs + c * j->cs;
            for (long r = 0; r < rows; r++)
                band[r * ldb + c] = xc[r * j->rs];
        }
        rc = quantize_bands(band, ldb, j->m, j->n, j->th, j->tw, j->mbits, j->rounding, j->key, codes, j->code_bytes,
                            j->ldq, j->exps + bi * j->ebs, j->lde, b, b + 1, base, r0);
    }
    free(band);
    return rc;
}

/* quantize_bands over all tile-row bands of `batch` matrices (row and column strides rs, cs of x;
   batch strides xbs, cbs, ebs; matrix i's
   stream positions start at i * pos_step: the positions of the matrices stacked, each padded to
   whole tiles), in parts of bands that threads take as they come free (up to four a thread;
   one thread below PARALLEL_ELEMENTS). */
int hbfp_quantize(const float *x, long rs, long cs, long m, long n, long th, long tw, int mbits, int rounding, unsigned key,
                  void *codes, int code_bytes, long ldq, unsigned char *exps, long lde, long batch, long xbs,
                  long cbs, long ebs, int threads)
{
    if (m < 0 || n < 0 || th < 1 || tw < 1 || mbits < 2 || mbits > 16 || rounding < 0 || rounding > 2 ||
        (code_bytes != 1 && code_bytes != 2) || batch < 0)
        return HBFP_EINVAL;
    long tr = (m + th - 1) / th;
    if (batch * m * n < PARALLEL_ELEMENTS)
        threads = 1;
    long per = threads <= 1 ? 1 : (4L * threads + batch - 1) / batch, step = (tr + per - 1) / per;
    if (step < 1)
        step = 1;
    long chunks = (tr + step - 1) / step;
    unsigned long long pos_step = (unsigned long long)tr * th * (unsigned long long)((n + tw - 1) / tw * tw);
    quantize_job job = {x, rs, cs, m, n, th, tw, mbits, rounding, key, codes, code_bytes, ldq, exps, lde, step, tr,
                        chunks, xbs, cbs, ebs, pos_step};
    return hbfp_parallel(quantize_part, &job, batch * chunks, threads);
}

/* ---- im2col and quantize in one pass ------------------------------------------------------ */

typedef struct {
    const float *x;
    long n, c, h, w, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow;
    long th, tw;
    int mbits, rounding;
    unsigned key;
    void *codes;
    int code_bytes;
    unsigned char *exps;
    long step, bands;
} patches_job;

static int patches_part(void *ctx, long part)
{
    const patches_job *j = ctx;
    long m = j->n * j->oh * j->ow, ckk = j->c * j->kh * j->kw, tc = (ckk + j->tw - 1) / j->tw;
    float *band = malloc((size_t)(j->th * ckk) * sizeof(float));
    if (!band)
        return -1;
    int rc = 0;
    long b1 = (part + 1) * j->step < j->bands ? (part + 1) * j->step : j->bands;
    for (long b = part * j->step; b < b1 && !rc; b++) {
        long r0 = b * j->th, rows = m - r0 < j->th ? m - r0 : j->th;
        hbfp_patch_rows(j->x, j->c, j->h, j->w, j->kh, j->kw, j->sh, j->sw, j->ph, j->pw, j->dh, j->dw, j->oh, j->ow,
                        r0, rows, band);
        rc = quantize_bands(band, ckk, m, ckk, j->th, j->tw, j->mbits, j->rounding, j->key, j->codes, j->code_bytes,
                            ckk, j->exps, tc, b, b + 1, 0, r0);
    }
    free(band);
    return rc;
}

/* bfp.quantize of im2col(x) (the patches of a convolution as one matrix, hbfp_im2col), without
   the matrix: each tile-row band of it gathered into a buffer of the thread's, then quantized. */
int hbfp_im2col_quantize(const float *x, long n, long c, long h, long w, long kh, long kw, long sh, long sw, long ph,
                         long pw, long dh, long dw, long oh, long ow, long th, long tw, int mbits, int rounding,
                         unsigned key, void *codes, int code_bytes, unsigned char *exps, int threads)
{
    if (th < 1 || tw < 1 || mbits < 2 || mbits > 16 || rounding < 0 || rounding > 2 ||
        (code_bytes != 1 && code_bytes != 2))
        return HBFP_EINVAL;
    long m = n * oh * ow, bands = (m + th - 1) / th;
    if (m * c * kh * kw < PARALLEL_ELEMENTS || bands < 2)
        threads = 1;
    long parts = threads <= 1 ? 1 : 4L * threads, step = (bands + parts - 1) / parts;
    step = step < 1 ? 1 : step;
    patches_job job = {x, n, c, h, w, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow, th, tw, mbits, rounding, key, codes,
                       code_bytes, exps, step, bands};
    return hbfp_parallel(patches_part, &job, (bands + step - 1) / step, threads);
}
