/* The golden product's hot loop in C (hbfp.golden.native builds this on first use).

   hbfp_gemm_codes: acc[i][j] += p_0, then p_1, ... for every K-tile t in order, where p_t is
   the sum over k in tile t of a[i][k] * b[k][j], the operands' codes times their tile's power
   of two (gemm._scaled). Under gemm._fast_path_ok's preconditions every product and every
   partial sum of a K-tile is exact in fp32 whatever the order, so p_t is exact; the only
   rounding is acc + p_t, one fp32 addition per K-tile, as the contract says (docs/numerics.md,
   section 3). Multiplies fuse into adds (-ffp-contract=fast) only inside p_t, where all is exact.

   Layout (the usual register-blocked GEMM): B's scaled codes are packed per panel of NR
   columns over all of K (K x NR, contiguous, zero past n and k), a block of panels at a time,
   so a panel streams from L2 while an MR-row panel of A (packed row by row) stays in L1; the
   MR x NR outputs stay in registers over all K-tiles, so the accumulator is read and written
   once. */

#include <stdlib.h>
#include <string.h>

#include <omp.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif
#define NR (2 * VW)
#define MR 6

typedef float vf __attribute__((vector_size(VW * 4)));
/* The same vector at any float's address (the accumulator's rows). */
typedef float vfu __attribute__((vector_size(VW * 4), aligned(4)));

/* An operand as stored: integer codes with any strides (a transposed view included) and
   one E8M0 exponent code per tile, its code step 2**(E - 127 - frac_bits). */
typedef struct {
    const void *codes;
    int code_bytes;           /* 1, 2 or 4: int8, int16 or int32 codes */
    long rs, cs;              /* strides of the codes, in elements */
    const unsigned char *exps;
    long ers, ecs;            /* strides of the exponent codes */
    long th, tw;              /* the tile */
    int frac_bits;
} operand;

/* A tile's power of two, as gemm._scaled makes it: 0 for a NaN tile (code 0xFF, its outputs
   are replaced) and for exponent code 0 (nothing nonzero there under the fast path's
   preconditions), else 2**(E - 127 - frac_bits) clamped to fp32's normal range. */
static float tile_scale(const operand *x, long tr, long tc)
{
    int e = x->exps[tr * x->ers + tc * x->ecs];
    if (e == 0 || e == 0xFF)
        return 0.0f;
    int s = e - 127 - x->frac_bits;
    if (s < -126)
        s = -126;
    if (s > 127)
        s = 127;
    union { unsigned u; float f; } v = {(unsigned)(s + 127) << 23};
    return v.f;
}

typedef signed char i8;
typedef short i16;
typedef int i32;

/* M(T) for the codes' type: 1, 2 or 4 bytes. */
#define BY_CODE_TYPE(M, BYTES)                                                               \
    if ((BYTES) == 1)                                                                        \
        M(i8)                                                                                \
    else if ((BYTES) == 2)                                                                   \
        M(i16)                                                                               \
    else                                                                                     \
        M(i32)

/* d[i] = (float)x[i] * s for a run of int8 codes: 16 (AVX-512) or 8 (AVX2) at a time with the
   widening instructions (GCC's generic vectors convert bytes one by one). */
static inline void convert_run_i8(const i8 *restrict x, float *restrict d, long n, float s)
{
    long i = 0;
#if defined(__AVX512F__)
    __m512 sv = _mm512_set1_ps(s);
    for (; i + 16 <= n; i += 16) {
        __m128i c = _mm_loadu_si128((const __m128i *)(x + i));
        _mm512_storeu_ps(d + i, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c)), sv));
    }
#endif
#if defined(__AVX2__)
    __m256 sv8 = _mm256_set1_ps(s);
    for (; i + 8 <= n; i += 8) {
        __m128i c = _mm_loadl_epi64((const __m128i *)(x + i));
        _mm256_storeu_ps(d + i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)), sv8));
    }
#endif
    for (; i < n; i++)
        d[i] = (float)x[i] * s;
}

static inline void convert_run_i16(const i16 *restrict x, float *restrict d, long n, float s)
{
    for (long i = 0; i < n; i++)
        d[i] = (float)x[i] * s;
}

static inline void convert_run_i32(const i32 *restrict x, float *restrict d, long n, float s)
{
    for (long i = 0; i < n; i++)
        d[i] = (float)x[i] * s;
}

/* Scaled codes of rows [i0, i0+rows) of A (m x k), K columns [k0, k0+kc) (k0 at a tile
   boundary), as an MR-row panel, zero past row m or column k: row by row, ap[r*kc + kk], when
   A's rows are contiguous (long runs convert at once), else K-step by K-step, ap[kk*MR + r]
   (a transposed A: the MR codes of a K-step are adjacent). */
static void pack_a(const operand *a, long i0, int rows, long k0, long kc, long k, float *restrict ap)
{
    memset(ap, 0, (size_t)(kc * MR) * sizeof(float));
    long kend = k0 + kc < k ? k0 + kc : k;
    for (long t0 = k0; t0 < kend; t0 += a->tw) {
        long t1 = t0 + a->tw < kend ? t0 + a->tw : kend;
        float s[MR];
        for (int r = 0; r < rows; r++)
            s[r] = tile_scale(a, (i0 + r) / a->th, t0 / a->tw);
#define PACK_A(T)                                                                            \
        {                                                                                    \
            const T *restrict x = (const T *)a->codes + i0 * a->rs;                          \
            long rs = a->rs, cs = a->cs;                                                     \
            if (cs == 1) {                                                                   \
                for (int r = 0; r < rows; r++) {                                             \
                    const T *restrict xr = x + r * rs;                                       \
                    float *restrict dr = ap + r * kc - k0;                                   \
                    float sr = s[r];                                                         \
                    convert_run_##T(xr + t0, dr + t0, t1 - t0, sr);                          \
                }                                                                            \
            } else {                                                                         \
                for (long kk = t0; kk < t1; kk++)                                            \
                    for (int r = 0; r < rows; r++)                                           \
                        ap[(kk - k0) * MR + r] = (float)x[r * rs + kk * cs] * s[r];          \
            }                                                                                \
        }
        BY_CODE_TYPE(PACK_A, a->code_bytes)
#undef PACK_A
    }
}

/* Scaled codes of B (k x n), K rows [k0, k0+kc) (k0 at a tile boundary), columns [j0, j0+nc),
   in panels of NR columns: panel q holds bp[q*kc*NR + kk*NR + c] for column j0 + q*NR + c,
   zero past n or k. */
static void pack_b(const operand *b, long k0, long kc, long k, long j0, long nc, long n, float *restrict bp)
{
    long j1 = j0 + nc < n ? j0 + nc : n;
    long kend = k0 + kc < k ? k0 + kc : k;
    memset(bp, 0, (size_t)(((nc + NR - 1) / NR) * kc * NR) * sizeof(float));
    for (long t0 = k0; t0 < kend; t0 += b->th) {
        long t1 = t0 + b->th < kend ? t0 + b->th : kend;
        for (long c0 = j0; c0 < j1; c0 += NR) {
            long c1 = c0 + NR < j1 ? c0 + NR : j1;
            float s[NR];
            for (long j = c0; j < c1; j++)
                s[j - c0] = tile_scale(b, t0 / b->th, j / b->tw);
            float *restrict dst = bp + ((c0 - j0) / NR) * kc * NR - k0 * NR;
#define PACK_B(T)                                                                            \
            {                                                                                \
                const T *restrict x = (const T *)b->codes + c0 * b->cs;                      \
                long w = c1 - c0, rs = b->rs, cs = b->cs;                                    \
                if (cs == 1) {                                                               \
                    for (long kk = t0; kk < t1; kk++) {                                      \
                        const T *restrict xk = x + kk * rs;                                  \
                        float *restrict dk = dst + kk * NR;                                  \
                        for (long j = 0; j < w; j++)                                         \
                            dk[j] = (float)xk[j] * s[j];                                     \
                    }                                                                        \
                } else {                                                                     \
                    for (long j = 0; j < w; j++) {                                           \
                        const T *restrict xj = x + j * cs;                                   \
                        float sj = s[j];                                                     \
                        for (long kk = t0; kk < t1; kk++)                                    \
                            dst[kk * NR + j] = (float)xj[kk * rs] * sj;                      \
                    }                                                                        \
                }                                                                            \
            }
            BY_CODE_TYPE(PACK_B, b->code_bytes)
#undef PACK_B
        }
    }
}

/* R rows x NV vectors of outputs (NV = 2: a whole NR-column panel; NV = 1 where w <= VW, the
   panel's other half holding zeros): c (row stride ldc, w valid columns) = (zero ? +0 : c + 0)
   + every K-tile's p in order (c + 0: a -0 starts as +0, as gemm's acc += 0 makes it). A's
   panel element (r, k) is ap[r*ars + k*aks]; B's panel is kt*tk rows of NR floats. */
#define DEFINE_MICRO(NAME, R, NV)                                                            \
static void NAME(const float *ap, long ars, long aks, const float *bp, float *c, long ldc, int w, \
                 long kt, long tk, long kv, int zero)                                        \
{                                                                                            \
    vf acc[R][NV];                                                                           \
    float tmp[NR] __attribute__((aligned(64)));                                              \
    for (int r = 0; r < R; r++) {                                                            \
        if (zero) {                                                                          \
            for (int v = 0; v < NV; v++)                                                     \
                acc[r][v] = (vf){0};                                                         \
        } else if (w == NV * VW) {                                                           \
            for (int v = 0; v < NV; v++)                                                     \
                acc[r][v] = *(const vfu *)(c + r * ldc + v * VW) + 0.0f;                     \
        } else {                                                                             \
            memset(tmp, 0, sizeof tmp);                                                      \
            memcpy(tmp, c + r * ldc, (size_t)w * sizeof(float));                             \
            for (int v = 0; v < NV; v++) {                                                   \
                memcpy(&acc[r][v], tmp + v * VW, sizeof(vf));                                \
                acc[r][v] += 0.0f;                                                           \
            }                                                                                \
        }                                                                                    \
    }                                                                                        \
    const float *bk = bp;                                                                    \
    for (long t = 0; t < kt; t++) {                                                          \
        vf p[R][NV];                                                                         \
        for (int r = 0; r < R; r++)                                                          \
            for (int v = 0; v < NV; v++)                                                     \
                p[r][v] = (vf){0};                                                           \
        /* the K-tile's rows up to the kv that hold codes: the zero codes of K's padding add   \
           only zero products, and p (from +0, exact) stays the same without them */          \
        long kn = kv - t * tk < tk ? kv - t * tk : tk;                                       \
        const float *bt = bk, *at = ap;                                                      \
        bk += tk * NR;                                                                       \
        ap += tk * aks;                                                                      \
        for (long k = 0; k < kn; k++, bt += NR, at += aks) {                                 \
            vf b[NV];                                                                        \
            for (int v = 0; v < NV; v++)                                                     \
                b[v] = *(const vf *)(bt + v * VW);                                           \
            for (int r = 0; r < R; r++) {                                                    \
                float x = at[r * ars];                                                       \
                for (int v = 0; v < NV; v++)                                                 \
                    p[r][v] += x * b[v];                                                     \
            }                                                                                \
        }                                                                                    \
        for (int r = 0; r < R; r++)                                                          \
            for (int v = 0; v < NV; v++)                                                     \
                acc[r][v] += p[r][v];                                                        \
    }                                                                                        \
    for (int r = 0; r < R; r++) {                                                            \
        if (w == NV * VW) {                                                                  \
            for (int v = 0; v < NV; v++)                                                     \
                *(vfu *)(c + r * ldc + v * VW) = acc[r][v];                                  \
        } else {                                                                             \
            for (int v = 0; v < NV; v++)                                                     \
                memcpy(tmp + v * VW, &acc[r][v], sizeof(vf));                                \
            memcpy(c + r * ldc, tmp, (size_t)w * sizeof(float));                             \
        }                                                                                    \
    }                                                                                        \
}

DEFINE_MICRO(micro_1, 1, 2)
DEFINE_MICRO(micro_2, 2, 2)
DEFINE_MICRO(micro_3, 3, 2)
DEFINE_MICRO(micro_4, 4, 2)
DEFINE_MICRO(micro_5, 5, 2)
DEFINE_MICRO(micro_6, 6, 2)
DEFINE_MICRO(narrow_1, 1, 1)
DEFINE_MICRO(narrow_2, 2, 1)
DEFINE_MICRO(narrow_3, 3, 1)
DEFINE_MICRO(narrow_4, 4, 1)
DEFINE_MICRO(narrow_5, 5, 1)
DEFINE_MICRO(narrow_6, 6, 1)

typedef void (*micro_fn)(const float *, long, long, const float *, float *, long, int, long, long, long, int);
static const micro_fn MICRO[MR + 1] = {0, micro_1, micro_2, micro_3, micro_4, micro_5, micro_6};
static const micro_fn NARROW[MR + 1] = {0, narrow_1, narrow_2, narrow_3, narrow_4, narrow_5, narrow_6};

int hbfp_native_abi(void) { return 9; }

/* Blocking (the usual GEMM's): a block of KC rows of B (whole K-tiles) by NC columns is packed
   for a core's L2, a block of MC rows of A by KC for its L1/L2, one NR-column panel of B
   (KC x NR) stays in L1 while the MR-row panels of A pass it. The outputs are read and written
   once per KC block; K-tiles stay in order because the KC blocks go in order. */
#define KC_TARGET 256
#define MC 96
#define NC 512

static void *alloc64(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

/* Outputs [r0, r1) x [c0, c1) of one thread: see hbfp_gemm_codes. */
static int gemm_block(const operand *a, const operand *b, float *acc, long ldc, long r0, long r1, long c0, long c1,
                      long k, int zero)
{
    long tk = a->tw, kp = (k + tk - 1) / tk * tk;
    if (r1 <= r0 || c1 <= c0)
        return 0;
    long kc = KC_TARGET / tk * tk;
    if (kc < tk)
        kc = tk;
    if (kp == 0)
        kp = kc = tk; /* no K-tile: one pass of zero codes gives +0 or acc + 0 */
    if (kc > kp)
        kc = kp;
    float *bp = alloc64((size_t)(kc * NC) * sizeof(float));
    float *ap = alloc64((size_t)(kc * MC) * sizeof(float));
    if (!bp || !ap) {
        free(bp);
        free(ap);
        return -1;
    }
    for (long j0 = c0; j0 < c1; j0 += NC) {
        long w = c1 - j0 < NC ? c1 - j0 : NC;
        for (long k0 = 0; k0 < kp; k0 += kc) {
            long kcur = kp - k0 < kc ? kp - k0 : kc;
            /* A's panel row by row where its rows are contiguous, else K-step by K-step */
            long ars = a->cs == 1 ? kcur : 1, aks = a->cs == 1 ? 1 : MR;
            pack_b(b, k0, kcur, k, j0, w, c1, bp);
            for (long i0 = r0; i0 < r1; i0 += MC) {
                long mb = r1 - i0 < MC ? r1 - i0 : MC;
                for (long ir = 0; ir < mb; ir += MR) {
                    int rows = mb - ir < MR ? (int)(mb - ir) : MR;
                    pack_a(a, i0 + ir, rows, k0, kcur, k, ap + (ir / MR) * kcur * MR);
                }
                for (long q = 0; q * NR < w; q++) {
                    long cc = j0 + q * NR;
                    int cw = c1 - cc < NR ? (int)(c1 - cc) : NR;
                    for (long ir = 0; ir < mb; ir += MR) {
                        int rows = mb - ir < MR ? (int)(mb - ir) : MR;
                        (cw <= VW ? NARROW : MICRO)[rows](ap + (ir / MR) * kcur * MR, ars, aks, bp + q * kcur * NR, acc + (i0 + ir) * ldc + cc,
                                    ldc, cw, kcur / tk, tk, (k < k0 + kcur ? k : k0 + kcur) - k0, zero && k0 == 0);
                    }
                }
            }
        }
    }
    free(bp);
    free(ap);
    return 0;
}

/* Multiply-adds below which one thread does the whole product. */
#define PARALLEL_MACS (1L << 21)

/* acc (m x n, row stride ldc) = (zero ? +0 : acc + 0) + every K-tile's exact sum of A (m x k)
   and B (k x n), K-tile by K-tile (tk = A's tile columns = B's tile rows; K padded with zero
   codes to whole tiles). Shared out over `threads` OpenMP threads (0: as many as OpenMP's default
   for a product of PARALLEL_MACS or more, else one) (the same runtime and threads as
   torch's when torch is loaded, so no thread of one spins while the other works), in shares of
   rows or columns that threads take as they come free. Returns 0, or -1 if out of memory. */
int hbfp_gemm_codes(const void *a_codes, int a_bytes, long a_rs, long a_cs, const unsigned char *a_exps, long a_ers,
                    long a_ecs, long a_th, long a_tw, int a_frac, const void *b_codes, int b_bytes, long b_rs,
                    long b_cs, const unsigned char *b_exps, long b_ers, long b_ecs, long b_th, long b_tw, int b_frac,
                    float *acc, long ldc, long m, long n, long k, int zero, int threads)
{
    operand a = {a_codes, a_bytes, a_rs, a_cs, a_exps, a_ers, a_ecs, a_th, a_tw, a_frac};
    operand b = {b_codes, b_bytes, b_rs, b_cs, b_exps, b_ers, b_ecs, b_th, b_tw, b_frac};
    if (m <= 0 || n <= 0)
        return 0;
    if (threads <= 0)
        threads = m * n * (k > 0 ? k : 1) >= PARALLEL_MACS ? omp_get_max_threads() : 1;
    int failed = 0;
    /* Up to four shares per thread, taken as threads come free: a thread that the system
       deschedules (or that shares its core with another pool's spinning thread) holds up
       one share, not half the product. Shares of columns where they outnumber the rows
       (each share packs its rows of A again), else of rows (each packs B again). */
    int by_cols = n > m && n >= 64 * threads;
    long parts = threads == 1 ? 1 : 4L * threads, step;
    if (by_cols) {
        step = (n + parts * NR - 1) / (parts * NR) * NR;
        if (step < 4 * NR)
            step = 4 * NR;
        parts = (n + step - 1) / step;
    } else {
        step = (m + parts * MR - 1) / (parts * MR) * MR;
        if (step < MC && m > MC)
            step = MC;
        parts = (m + step - 1) / step;
    }
#pragma omp parallel for num_threads(threads) if (threads > 1 && parts > 1) schedule(dynamic, 1) reduction(| : failed)
    for (long p = 0; p < parts; p++) {
        long lo = p * step, hi = lo + step;
        if (by_cols)
            failed |= gemm_block(&a, &b, acc, ldc, 0, m, lo, hi < n ? hi : n, k, zero) != 0;
        else
            failed |= gemm_block(&a, &b, acc, ldc, lo, hi < m ? hi : m, 0, n, k, zero) != 0;
    }
    return failed ? -1 : 0;
}

/* ---- quantize (bfp.quantize of a matrix, bit for bit) ------------------------------------ */

static inline unsigned mix32(unsigned x)
{
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    x ^= x >> 16;
    return x;
}

static inline unsigned f32_bits(float f)
{
    unsigned u;
    memcpy(&u, &f, sizeof u);
    return u;
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
                          long band0, long band1)
{
    long tc = (n + tw - 1) / tw;
    int frac = mbits - 2;
    double qmax = (double)((1LL << (mbits - 1)) - 1);
    unsigned *colmax = malloc((size_t)n * sizeof(unsigned));
    unsigned *posc = malloc((size_t)n * sizeof(unsigned));
    double *sc = malloc((size_t)n * sizeof(double));
    float *scf = malloc((size_t)n * sizeof(float));
    if (!colmax || !posc || !sc || !scf) {
        free(colmax);
        free(posc);
        free(sc);
        free(scf);
        return -1;
    }
    /* A column's stream position within its band, less the row's: tile-major, row-major in a tile. */
    for (long c = 0; c < n; c++)
        posc[c] = (unsigned)((unsigned long long)(c / tw) * (unsigned long long)(th * tw) + (unsigned long long)(c % tw));
    /* One tile column over contiguous rows (a narrow matrix): a band is one run of rows * n
       values under one scale, quantized as a whole (nearest even and toward zero). */
    int flat = tc == 1 && rs == n && ldq == n && rounding != 2;
    for (long b = band0; b < band1 && flat; b++) {
        long r0 = b * th, len = (m - r0 < th ? m - r0 : th) * n;
        const float *xb = x + r0 * rs;
        unsigned emax = 0;
        for (long i = 0; i < len; i++) {
            unsigned e = (f32_bits(xb[i]) >> 23) & 0xFF;
            emax = e > emax ? e : emax;
        }
        exps[b * lde] = (unsigned char)emax;
        int in_f32 = 1;
        double sd = tile_scale_for(emax, frac, &in_f32);
        float sf = (float)sd;
        QUANTIZE_DISPATCH(QUANTIZE_FLAT, in_f32, sf, sd)
    }
    for (long b = band0; b < band1 && !flat; b++) {
        long r0 = b * th, rows = m - r0 < th ? m - r0 : th;
        unsigned band_pos = (unsigned)(((unsigned long long)b * (unsigned long long)(tc * th * tw)) & 0xFFFFFFFFull);
        memset(colmax, 0, (size_t)n * sizeof(unsigned));
        int narrow = 1; /* every live tile's scale a normal fp32: the rows in fp32 */
        for (long r = 0; r < rows; r++) {
            const float *xr = x + (r0 + r) * rs;
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
            const float *xr = x + (r0 + r) * rs;
            QUANTIZE_DISPATCH(QUANTIZE_ROW, narrow, scf, sc)
        }
    }
    free(colmax);
    free(posc);
    free(sc);
    free(scf);
    return 0;
}

/* Elements below which one thread quantizes the whole matrix. */
#define PARALLEL_ELEMENTS (1L << 17)

/* quantize_bands over all tile-row bands, shared out in shares of bands over `threads` OpenMP threads (0:
   OpenMP's default for PARALLEL_ELEMENTS or more, else one). */
int hbfp_quantize(const float *x, long rs, long m, long n, long th, long tw, int mbits, int rounding, unsigned key,
                  void *codes, int code_bytes, long ldq, unsigned char *exps, long lde, int threads)
{
    long tr = (m + th - 1) / th;
    if (threads <= 0)
        threads = m * n >= PARALLEL_ELEMENTS && tr > 1 ? omp_get_max_threads() : 1;
    int failed = 0;
    /* up to four shares of bands per thread, taken as threads come free (see hbfp_gemm_codes) */
    long parts = threads == 1 ? 1 : 4L * threads, step = (tr + parts - 1) / parts;
    parts = (tr + step - 1) / step;
#pragma omp parallel for num_threads(threads) if (threads > 1 && parts > 1) schedule(dynamic, 1) reduction(| : failed)
    for (long p = 0; p < parts; p++) {
        long b0 = p * step, b1 = b0 + step < tr ? b0 + step : tr;
        failed |= quantize_bands(x, rs, m, n, th, tw, mbits, rounding, key, codes, code_bytes, ldq, exps, lde, b0,
                                 b1) != 0;
    }
    return failed ? -1 : 0;
}

/* ---- im2col (the patches of a convolution as a matrix) ----------------------------------- */

/* x: N x C x H x W fp32 (contiguous) to out: (N*OH*OW) x (C*KH*KW), row-major, the row of
   output position (n, oh, ow) holding x[n, c, oh*sh - ph + i*dh, ow*sw - pw + j*dw] at column
   (c*KH + i)*KW + j, zero outside the image: torch's unfold, transposed, as one matrix. */
void hbfp_im2col(const float *x, long n, long c, long h, long w, long kh, long kw, long sh, long sw, long ph, long pw,
                 long dh, long dw, long oh, long ow, float *out)
{
    long ckk = c * kh * kw;
    /* An image's patches (OH*OW rows of CKK) at a time, column by column: for a kernel offset
       (i, j) the output positions whose source lies inside the image are a range of z per row,
       read along the image's row. */
#pragma omp parallel for if (n * oh * ow * ckk >= (1L << 17)) schedule(static)
    for (long b = 0; b < n; b++) {
        float *blk = out + b * oh * ow * ckk;
        for (long ch = 0; ch < c; ch++) {
            const float *img = x + (b * c + ch) * h * w;
            for (long i = 0; i < kh; i++) {
                for (long j = 0; j < kw; j++) {
                    long col = (ch * kh + i) * kw + j;
                    long off = j * dw - pw; /* xx = z * sw + off */
                    long zlo = off >= 0 ? 0 : (-off + sw - 1) / sw;
                    long zhi = w - off <= 0 ? 0 : (w - off + sw - 1) / sw; /* first z with xx >= w */
                    if (zhi > ow)
                        zhi = ow;
                    if (zlo > zhi)
                        zlo = zhi;
                    for (long y = 0; y < oh; y++) {
                        long yy = y * sh - ph + i * dh;
                        float *dst = blk + y * ow * ckk + col;
                        if (yy < 0 || yy >= h) {
                            for (long z = 0; z < ow; z++)
                                dst[z * ckk] = 0.0f;
                            continue;
                        }
                        const float *src = img + yy * w + off;
                        for (long z = 0; z < zlo; z++)
                            dst[z * ckk] = 0.0f;
                        for (long z = zlo; z < zhi; z++)
                            dst[z * ckk] = src[z * sw];
                        for (long z = zhi; z < ow; z++)
                            dst[z * ckk] = 0.0f;
                    }
                }
            }
        }
    }
}

/* The adjoint of hbfp_im2col (torch's fold of the transposed patches): cols
   ((N*OH*OW) x (C*KH*KW), row-major) summed into out (N x C x H x W), every pixel starting at
   +0 and adding its terms in ascending (c, i, j), the order of torch's col2im, so the sums have
   its bits. */
void hbfp_col2im(const float *cols, long n, long c, long h, long w, long kh, long kw, long sh, long sw, long ph,
                 long pw, long dh, long dw, long oh, long ow, float *out)
{
    long ckk = c * kh * kw;
#pragma omp parallel for if (n * oh * ow * ckk >= (1L << 17)) schedule(static)
    for (long b = 0; b < n * c; b++) {
        long bn = b / c, ch = b % c;
        float *img = out + b * h * w;
        for (long p = 0; p < h * w; p++)
            img[p] = 0.0f;
        for (long i = 0; i < kh; i++) {
            for (long j = 0; j < kw; j++) {
                long col = (ch * kh + i) * kw + j;
                for (long y = 0; y < oh; y++) {
                    long yy = y * sh - ph + i * dh;
                    if (yy < 0 || yy >= h)
                        continue;
                    const float *src = cols + (bn * oh + y) * ow * ckk + col;
                    for (long z = 0; z < ow; z++) {
                        long xx = z * sw - pw + j * dw;
                        if (xx >= 0 && xx < w)
                            img[yy * w + xx] += src[z * ckk];
                    }
                }
            }
        }
    }
}

/* ---- dequantize (BFPTensor.dequantize to fp32, the device rules) ------------------------- */

/* codes (m x n, row stride ldq; 1, 2 or 4 bytes) and exponents (row stride lde) to out (m x n,
   contiguous): code * 2**(E - 127 - frac) exact in double, rounded to fp32 (RNE; overflow to
   inf), a value below 2**-126 - 2**-151 in magnitude a zero of its sign; NaN tiles give NaN. */
void hbfp_dequantize(const void *codes, int code_bytes, long m, long n, long ldq, const unsigned char *exps, long lde,
                     long th, long tw, int frac, float *out)
{
    const double edge = 0x1p-126 - 0x1p-151;
    for (long i = 0; i < m; i++) {
        float *o = out + i * n;
        for (long c0 = 0; c0 < n; c0 += tw) {
            long c1 = c0 + tw < n ? c0 + tw : n;
            int e = exps[(i / th) * lde + c0 / tw];
            if (e == 0xFF) {
                for (long j = c0; j < c1; j++)
                    o[j] = __builtin_nanf("");
                continue;
            }
            union { unsigned long long u; double d; } sv = {(unsigned long long)(e - 127 - frac + 1023) << 52};
            double s = sv.d;
            for (long j = c0; j < c1; j++) {
                long o_ = i * ldq + j;
                double q = code_bytes == 1 ? ((const signed char *)codes)[o_]
                         : code_bytes == 2 ? ((const short *)codes)[o_] : ((const int *)codes)[o_];
                double v = q * s;
                float f = (float)v;
                o[j] = (v < 0 ? -v : v) < edge ? __builtin_copysignf(0.0f, f) : f;
            }
        }
    }
}

/* ---- a precondition of the product's fast path ------------------------------------------ */

/* Whether any tile of exponent code 0 holds a nonzero code (codes m x n with strides rs, cs;
   1, 2 or 4 bytes; exponents with strides ers, ecs; tiles th x tw): such codes are values below
   2**-126, outside what the compiled product computes. Only those tiles are read. */
int hbfp_dead_tiles_hold_codes(const void *codes, int code_bytes, long rs, long cs, long m, long n,
                               const unsigned char *exps, long ers, long ecs, long th, long tw)
{
    long tr = (m + th - 1) / th, tc = (n + tw - 1) / tw;
    for (long a = 0; a < tr; a++)
        for (long b = 0; b < tc; b++) {
            if (exps[a * ers + b * ecs] != 0)
                continue;
            long r1 = (a + 1) * th < m ? (a + 1) * th : m, c1 = (b + 1) * tw < n ? (b + 1) * tw : n;
            for (long i = a * th; i < r1; i++)
                for (long j = b * tw; j < c1; j++) {
                    long o = i * rs + j * cs;
                    long v = code_bytes == 1 ? ((const signed char *)codes)[o]
                           : code_bytes == 2 ? ((const short *)codes)[o] : ((const int *)codes)[o];
                    if (v != 0)
                        return 1;
                }
        }
    return 0;
}
