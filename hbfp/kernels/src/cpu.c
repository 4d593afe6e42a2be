/* What this CPU and its OS let the kernels run, as bits (hbfp.kernels.build.FEATURES): read
   from CPUID and XGETBV (the OS saves the registers' state), and for AMX the tile data state
   that Linux grants a process only when it asks (arch_prctl ARCH_REQ_XCOMP_PERM). */

#define _GNU_SOURCE
#include "common.h"

#define FEATURE_AVX2 1u      /* AVX2 and FMA, YMM state saved */
#define FEATURE_AVX512 2u    /* AVX-512 F, BW, VL, DQ and VNNI, ZMM and opmask state saved */
#define FEATURE_AMX 4u       /* AMX-TILE and AMX-INT8, tile data granted */

#ifdef HBFP_X86
#include <cpuid.h>
#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_GET_XCOMP_PERM 0x1022
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#endif

static unsigned long long xgetbv0(void)
{
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((unsigned long long)hi << 32) | lo;
}

static int amx_granted(void)
{
#ifdef __linux__
    unsigned long bits = 0;
    if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &bits) == 0 && (bits & (1ul << XFEATURE_XTILEDATA)))
        return 1;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0)
        return 0;
    return syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &bits) == 0 && (bits & (1ul << XFEATURE_XTILEDATA));
#else
    return 0;
#endif
}
#endif

unsigned hbfp_cpu_features(void)
{
    unsigned out = 0;
#ifdef HBFP_X86
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d))
        return 0;
    int osxsave = (c >> 27) & 1, fma = (c >> 12) & 1, avx = (c >> 28) & 1;
    if (!osxsave || !avx)
        return 0;
    unsigned long long xcr0 = xgetbv0();
    if ((xcr0 & 6) != 6) /* XMM and YMM state */
        return 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d))
        return 0;
    int avx2 = (b >> 5) & 1;
    if (avx2 && fma)
        out |= FEATURE_AVX2;
    int f = (b >> 16) & 1, dq = (b >> 17) & 1, bw = (b >> 30) & 1, vl = (b >> 31) & 1, vnni = (c >> 11) & 1;
    if ((out & FEATURE_AVX2) && f && dq && bw && vl && vnni && (xcr0 & 0xE0) == 0xE0)
        out |= FEATURE_AVX512;
    int amx_tile = (d >> 24) & 1, amx_int8 = (d >> 25) & 1;
    if ((out & FEATURE_AVX512) && amx_tile && amx_int8 && (xcr0 & 0x60000) == 0x60000 && amx_granted())
        out |= FEATURE_AMX;
#endif
    return out;
}

int hbfp_abi(void)
{
    return HBFP_ABI;
}

const char *hbfp_isa(void)
{
    return HBFP_ISA;
}
