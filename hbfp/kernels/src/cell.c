/* The LSTM cell's elementwise work (hbfp.torch.rnn), forward and backward, one call a time step:
   what torch runs as a dozen operators, each a pass over the gates.

   The nonlinearities are fp32 formulas of multiplies, adds and one division (no libm call, so
   that every build vectorizes them and they give the same bits in each: the builds do not
   contract multiplies and adds into FMAs), each within a few ulp:
     exp(x):  n = round(x log2 e) (adding 1.5 * 2**23), r = x - n ln 2 (ln 2 in two parts),
              Cephes' polynomial of r, times 2**n (from t's bits); x clamped to [-87, 88].
     sigmoid(x) = 1 / (1 + exp(-x)).
     tanh(x):  |x| < 0.625: Cephes' odd polynomial; else sign(x) (1 - 2 / (exp(2|x|) + 1)).
   The constants are hbfp.kernels.capi's (CELL_CONSTANTS); hbfp.kernels.torch_ops.lstm_cell
   evaluates the same operations with torch, in the same order: the same bits. */

#include "common.h"

static inline float exp_f(float x)
{
    x = x < HBFP_CELL_EXP_LO ? HBFP_CELL_EXP_LO : x;
    x = x > HBFP_CELL_EXP_HI ? HBFP_CELL_EXP_HI : x;
    float t = x * HBFP_CELL_LOG2E + HBFP_CELL_ROUND; /* n + 1.5 * 2**23: n in t's low bits */
    float n = t - HBFP_CELL_ROUND;
    float r = x - n * HBFP_CELL_LN2_HI;
    r = r - n * HBFP_CELL_LN2_LO;
    float z = r * r;
    float p = r * HBFP_CELL_EXP0 + HBFP_CELL_EXP1;
    p = p * r + HBFP_CELL_EXP2;
    p = p * r + HBFP_CELL_EXP3;
    p = p * r + HBFP_CELL_EXP4;
    p = p * r + HBFP_CELL_EXP5;
    p = p * z + r;
    p = p + 1.0f;
    return p * bits_f32((f32_bits(t) - f32_bits(HBFP_CELL_ROUND) + 127u) << 23); /* 2**n, n in [-126, 127] */
}

static inline float sigmoid_f(float x)
{
    return 1.0f / (1.0f + exp_f(-x));
}

static inline float tanh_f(float x)
{
    float a = x < 0.0f ? -x : x;
    float z = x * x;
    float p = z * HBFP_CELL_TANH0 + HBFP_CELL_TANH1;
    p = p * z + HBFP_CELL_TANH2;
    p = p * z + HBFP_CELL_TANH3;
    p = p * z + HBFP_CELL_TANH4;
    float small = p * z * x + x;
    float big = 1.0f - 2.0f / (exp_f(a + a) + 1.0f);
    big = x < 0.0f ? -big : big;
    return a < HBFP_CELL_TANH_SMALL ? small : big;
}

/* One row's c = f * c_prev + i * g, tc = tanh(c), h = o * tc (n of each). */
static void cell_state(const float *restrict i, const float *restrict f, const float *restrict g,
                       const float *restrict o, const float *restrict cp, long n, float *restrict c,
                       float *restrict tc, float *restrict h)
{
    for (long j = 0; j < n; j++) {
        float cv = f[j] * cp[j] + i[j] * g[j];
        float t = tanh_f(cv);
        c[j] = cv;
        tc[j] = t;
        h[j] = o[j] * t;
    }
}

/* One row's backward (n of each; the gates' gradients at dg, dg + n, dg + 2n, dg + 3n). */
static void cell_backward(const float *restrict i, const float *restrict f, const float *restrict g,
                          const float *restrict o, const float *restrict cp, const float *restrict tc,
                          const float *restrict dy, const float *restrict dh, const float *restrict dc, long n,
                          float *restrict di, float *restrict df, float *restrict dg, float *restrict dout,
                          float *restrict dcp)
{
    for (long j = 0; j < n; j++) {
        float t = tc[j], d = dy[j] + dh[j];
        float dct = d * o[j] * (1.0f - t * t) + dc[j];
        di[j] = dct * g[j] * (1.0f - i[j]) * i[j];
        df[j] = dct * cp[j] * (1.0f - f[j]) * f[j];
        dg[j] = dct * i[j] * (1.0f - g[j] * g[j]);
        dout[j] = d * t * (1.0f - o[j]) * o[j];
        dcp[j] = dct * f[j];
    }
}

/* Forward, rows x hid: gates = p + xp (rows x 4 hid, input | forget | cell | output), acts =
   their nonlinearities, c = f * c_prev + i * g, tc = tanh(c), h = o * tc (all contiguous, the
   outputs apart from the inputs and each other). */
int hbfp_lstm_cell(const float *p, const float *xp, const float *c_prev, long rows, long hid, float *acts, float *c,
                   float *tc, float *h)
{
    if (rows < 0 || hid < 0)
        return HBFP_EINVAL;
    for (long r = 0; r < rows; r++) {
        const float *restrict pr = p + r * 4 * hid, *restrict xr = xp + r * 4 * hid, *restrict cp = c_prev + r * hid;
        float *restrict ar = acts + r * 4 * hid, *restrict cr = c + r * hid, *restrict tr = tc + r * hid;
        float *restrict hr = h + r * hid;
        for (long j = 0; j < 2 * hid; j++)
            ar[j] = sigmoid_f(pr[j] + xr[j]);
        for (long j = 2 * hid; j < 3 * hid; j++)
            ar[j] = tanh_f(pr[j] + xr[j]);
        for (long j = 3 * hid; j < 4 * hid; j++)
            ar[j] = sigmoid_f(pr[j] + xr[j]);
        cell_state(ar, ar + hid, ar + 2 * hid, ar + 3 * hid, cp, hid, cr, tr, hr);
    }
    return 0;
}

/* Backward, rows x hid: from the step's acts, c_prev and tc, the gradients dy (of h, from the
   layer's output), dh (of h, from the next step) and dc (of c, from the next step): dgates
   (before the nonlinearities, rows x 4 hid) and dc_prev (of c_prev). dh = dy + dh_next;
   dct = (dh * o) * (1 - tc * tc) + dc_next (the outputs apart from the inputs). */
int hbfp_lstm_cell_backward(const float *acts, const float *c_prev, const float *tc, const float *dy, const float *dh,
                            const float *dc, long rows, long hid, float *dgates, float *dc_prev)
{
    if (rows < 0 || hid < 0)
        return HBFP_EINVAL;
    for (long r = 0; r < rows; r++) {
        const float *restrict ar = acts + r * 4 * hid, *restrict cp = c_prev + r * hid, *restrict tr = tc + r * hid;
        const float *restrict yr = dy + r * hid, *restrict hr = dh + r * hid, *restrict dcr = dc + r * hid;
        float *restrict gr = dgates + r * 4 * hid, *restrict dcp = dc_prev + r * hid;
        cell_backward(ar, ar + hid, ar + 2 * hid, ar + 3 * hid, cp, tr, yr, hr, dcr, hid, gr, gr + hid, gr + 2 * hid,
                      gr + 3 * hid, dcp);
    }
    return 0;
}
