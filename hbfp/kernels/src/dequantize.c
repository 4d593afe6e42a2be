/* BFPTensor.dequantize to fp32 by the device rules (golden/bfp.py): code * 2**(E - 127 - frac)
   exact in double, rounded to fp32 (RNE, overflow to inf), a value below 2**-126 - 2**-151 in
   magnitude (one that rounds below 2**-126) a zero of its sign; NaN tiles give NaN. A tile whose
   every value is a normal fp32 or zero (2**-126 <= 2**k and 2**15 * 2**k < 2**128) multiplies in
   fp32, exactly, and vectorizes; the others take the double path. */

#include "common.h"

typedef struct {
    const void *codes;
    int code_bytes;
    long m, n, ldq;
    const unsigned char *exps;
    long lde, th, tw;
    int frac;
    float *out;
    long rows;
} dequantize_job;

static int dequantize_part(void *ctx, long p)
{
    const dequantize_job *j = ctx;
    const double edge = 0x1p-126 - 0x1p-151;
    long i1 = (p + 1) * j->rows < j->m ? (p + 1) * j->rows : j->m;
    for (long i = p * j->rows; i < i1; i++) {
        float *o = j->out + i * j->n;
        for (long c0 = 0; c0 < j->n; c0 += j->tw) {
            long c1 = c0 + j->tw < j->n ? c0 + j->tw : j->n;
            int e = j->exps[(i / j->th) * j->lde + c0 / j->tw];
            if (e == 0xFF) {
                for (long c = c0; c < c1; c++)
                    o[c] = __builtin_nanf("");
                continue;
            }
            int k = e - 127 - j->frac;  /* a value is code * 2**k */
            long at = i * j->ldq + c0;
            if (k >= -126 && k <= 112) {  /* every value a normal fp32 (|code| < 2**15) or zero: exact in fp32 */
                union { unsigned u; float f; } sf = {(unsigned)(k + 127) << 23};
                float s = sf.f;
                if (j->code_bytes == 1) {
                    const i8 *q = (const i8 *)j->codes + at;
                    for (long c = 0; c < c1 - c0; c++)
                        o[c0 + c] = (float)q[c] * s;
                } else {
                    const i16 *q = (const i16 *)j->codes + at;
                    for (long c = 0; c < c1 - c0; c++)
                        o[c0 + c] = (float)q[c] * s;
                }
                continue;
            }
            union { unsigned long long u; double d; } sv = {(unsigned long long)(k + 1023) << 52};
            double s = sv.d;
            for (long c = c0; c < c1; c++) {
                long a = i * j->ldq + c;
                double q = j->code_bytes == 1 ? ((const i8 *)j->codes)[a] : ((const i16 *)j->codes)[a];
                double v = q * s;
                float f = (float)v;
                o[c] = (v < 0 ? -v : v) < edge ? __builtin_copysignf(0.0f, f) : f;
            }
        }
    }
    return 0;
}

int hbfp_dequantize(const void *codes, int code_bytes, long m, long n, long ldq, const unsigned char *exps, long lde,
                    long th, long tw, int frac, float *out, int threads)
{
    if (m < 0 || n < 0 || th < 1 || tw < 1 || (code_bytes != 1 && code_bytes != 2))
        return HBFP_EINVAL;
    long rows = (1L << 15) / (n > 0 ? n : 1);
    rows = rows < 1 ? 1 : rows;
    long parts = (m + rows - 1) / rows;
    if (m * n < (1L << 17))
        threads = 1;
    dequantize_job job = {codes, code_bytes, m, n, ldq, exps, lde, th, tw, frac, out, rows};
    return hbfp_parallel(dequantize_part, &job, parts, threads);
}
