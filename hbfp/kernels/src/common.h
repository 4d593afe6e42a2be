/* What the kernels' sources share: the generated interface (hbfp_abi.h, from
   hbfp/kernels/capi.py), the thread pool and the fp32 environment of the device's rules. */
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "hbfp_abi.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HBFP_X86 1
#endif

/* The instruction set of this build, chosen by the compiler flags build.py passes. */
#if defined(__AMX_INT8__) && defined(__AVX512VNNI__)
#define HBFP_ISA "amx"
#elif defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define HBFP_ISA "avx512"
#elif defined(__AVX2__) && defined(__FMA__)
#define HBFP_ISA "avx2"
#else
#define HBFP_ISA "c"
#endif

typedef signed char i8;
typedef short i16;
typedef int i32;

#define HBFP_ENOMEM (-1)
#define HBFP_EINVAL (-2)

/* ---- the thread pool (pool.c) ---------------------------------------------------------- */

/* fn(ctx, part) for part = 0 .. parts - 1, shared out over `threads` threads (the caller's
   and threads - 1 of the pool's): parts are taken one at a time as threads come free, so a
   thread that the OS preempts holds back one part only, and waits are passive (a thread
   with nothing to do sleeps, so that it leaves its core to the thread it waits for). Runs
   everything on the caller's thread when threads <= 1 or parts <= 1. Every part runs in the
   device's fp32 environment (hbfp_fp_enter). Returns the OR of fn's results. */
typedef int (*hbfp_task)(void *ctx, long part);
int hbfp_parallel(hbfp_task fn, void *ctx, long parts, int threads);

/* The calling thread's own buffer `slot` of at least `bytes` (64-byte aligned; NULL when out of
   memory), kept for the thread's next call and freed when the thread ends: so that calls from
   several threads (the parts of hbfp_parallel, Python threads) never share one. Its contents
   are whatever the thread's last user left. */
enum { HBFP_BUFFER_GEMM, HBFP_BUFFER_RUN, HBFP_BUFFER_QUANTIZE, HBFP_BUFFERS };
void *hbfp_thread_buffer(int slot, size_t bytes);

/* ---- a convolution's patches (conv.c) ---------------------------------------------------- */

/* Rows [p0, p0 + count) of the patch matrix of a convolution (hbfp_im2col's) into dst. */
void hbfp_patch_rows(const float *x, long c, long h, long w, long kh, long kw, long sh, long sw, long ph, long pw,
                     long dh, long dw, long oh, long ow, long p0, long count, float *dst);

/* ---- the device's fp32 rules ------------------------------------------------------------ */

/* Flush to zero and denormals are zero for this thread's SSE/AVX arithmetic: a result below
   2**-126 becomes a zero of its sign (x86 detects tininess after rounding, as the contract's
   FTZ does: docs/numerics.md, section 1) and a subnormal input reads as zero. Returns the
   previous state for hbfp_fp_leave. Elsewhere a no-op: the portable code flushes by hand. */
static inline unsigned hbfp_fp_enter(void)
{
#ifdef HBFP_X86
    unsigned old = _mm_getcsr();
    _mm_setcsr(old | 0x8040u); /* FTZ (bit 15) and DAZ (bit 6) */
    return old;
#else
    return 0;
#endif
}

static inline void hbfp_fp_leave(unsigned old)
{
#ifdef HBFP_X86
    _mm_setcsr(old);
#else
    (void)old;
#endif
}

/* The calling thread's fp32 environment as it is (for hbfp_fp_leave to set in another thread:
   work of a part that must round as the caller's own arithmetic does). */
static inline unsigned hbfp_fp_state(void)
{
#ifdef HBFP_X86
    return _mm_getcsr();
#else
    return 0;
#endif
}

static inline unsigned f32_bits(float f)
{
    union { float f; unsigned u; } v = {f};
    return v.u;
}

static inline float bits_f32(unsigned u)
{
    union { unsigned u; float f; } v = {u};
    return v.f;
}

/* fp32 addition by the device's rules without relying on the FP environment: a sum below
   2**-126 is a zero of its sign (the operands are never subnormal). */
static inline float add_ftz(float a, float b)
{
    float r = a + b;
    return (f32_bits(r) & 0x7F800000u) == 0 ? bits_f32(f32_bits(r) & 0x80000000u) : r;
}

/* fp32 to bf16 by the device's rules (golden/bf16.py from_f32): RNE, subnormals to zeros of
   their sign, every NaN the quiet NaN with its sign. */
static inline unsigned short bf16_from_f32(float f)
{
    unsigned u = f32_bits(f);
    if ((u & 0x7F800000u) == 0)
        return (unsigned short)((u >> 16) & 0x8000u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)
        return (unsigned short)(((u >> 16) & 0x8000u) | 0x7FC0u);
    return (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

#if defined(__AVX2__)
/* The 8 x 8 block of rows r0 .. r7 stored by columns: column c at d + c * ld. */
static inline void transpose8_regs(__m256 r0, __m256 r1, __m256 r2, __m256 r3, __m256 r4, __m256 r5, __m256 r6,
                                   __m256 r7, float *d, long ld)
{
    __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
    __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
    __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
    __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    _mm256_storeu_ps(d, _mm256_permute2f128_ps(u0, u4, 0x20));
    _mm256_storeu_ps(d + ld, _mm256_permute2f128_ps(u1, u5, 0x20));
    _mm256_storeu_ps(d + 2 * ld, _mm256_permute2f128_ps(u2, u6, 0x20));
    _mm256_storeu_ps(d + 3 * ld, _mm256_permute2f128_ps(u3, u7, 0x20));
    _mm256_storeu_ps(d + 4 * ld, _mm256_permute2f128_ps(u0, u4, 0x31));
    _mm256_storeu_ps(d + 5 * ld, _mm256_permute2f128_ps(u1, u5, 0x31));
    _mm256_storeu_ps(d + 6 * ld, _mm256_permute2f128_ps(u2, u6, 0x31));
    _mm256_storeu_ps(d + 7 * ld, _mm256_permute2f128_ps(u3, u7, 0x31));
}
#endif

#if defined(__AVX2__)
/* d[c * ld + r] = s[r * ls + c] for r, c < 8: eight rows in registers, eight columns out. */
static inline void transpose8(const float *s, long ls, float *d, long ld)
{
    __m256 r0 = _mm256_loadu_ps(s), r1 = _mm256_loadu_ps(s + ls), r2 = _mm256_loadu_ps(s + 2 * ls);
    __m256 r3 = _mm256_loadu_ps(s + 3 * ls), r4 = _mm256_loadu_ps(s + 4 * ls), r5 = _mm256_loadu_ps(s + 5 * ls);
    __m256 r6 = _mm256_loadu_ps(s + 6 * ls), r7 = _mm256_loadu_ps(s + 7 * ls);
    transpose8_regs(r0, r1, r2, r3, r4, r5, r6, r7, d, ld);
}
#endif
