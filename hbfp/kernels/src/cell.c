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

#include <stdlib.h>
#include <string.h>

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

/* ---- a layer's recurrence: every step's product and cell in one call ------------------------
   What hbfp.torch.rnn's lean path made one Python call at a time (a step's quantize, product and
   cell), in the same order with the same arguments, so the same bits: on square tiles (the
   state's tile is w's), the state's codes as hbfp_quantize makes them under `keys[t]` (one per
   step: the seeds the recipe's stream gave, in the loop's order), its product with `w`'s codes
   as hbfp_gemm makes it, fp32 out. A step's products are a few million MACs: the Python between
   them cost as much as they did. */

/* The codes and exponents of a rows x n matrix quantized (contiguous), as the product's A. */
typedef struct {
    void *codes;
    unsigned char *exps;
    hbfp_operand op;
} state_codes;

static int state_codes_init(state_codes *s, const hbfp_operand *w, long rows, long n, int mbits)
{
    long t = w->th, tr = (rows + t - 1) / t, tc = (n + t - 1) / t;
    int bytes = mbits <= 8 ? 1 : 2;
    s->codes = malloc((size_t)(rows * n * bytes + 1));
    s->exps = malloc((size_t)(tr * tc + 1));
    hbfp_operand op = {s->codes, bytes, n, 1, 0, s->exps, tc, 1, 0, t, t, w->frac, w->qmax};
    s->op = op;
    return s->codes && s->exps ? 0 : HBFP_ENOMEM;
}

static void state_codes_free(state_codes *s)
{
    free(s->codes);
    free(s->exps);
}

/* x (rows x n, contiguous) quantized into s, then its product with w (n x cols) into out. */
static int step_product(state_codes *s, const float *x, long rows, long n, long cols, int mbits, int rounding,
                        unsigned key, const hbfp_operand *w, float *out, int threads)
{
    int rc = hbfp_quantize(x, n, 1, rows, n, s->op.th, s->op.tw, mbits, rounding, key, s->codes, s->op.code_bytes, n,
                           s->exps, s->op.ers, 1, 0, 0, 0, threads);
    if (rc)
        return rc;
    hbfp_output o = {out, cols, 0, 0, NULL, 0, 0, NULL, NULL};
    return hbfp_gemm(&s->op, w, &o, 1, rows, cols, n, threads);
}

/* A step's cells shared out over the threads by rows, each part in the caller's fp32 environment
   (as the cell called alone runs): forward (dc == NULL) or backward. */
typedef struct {
    const float *p, *xp, *c_prev, *tc, *dy, *dh, *dc;
    const float *acts_in;
    long rows, hid, rows_per;
    float *acts, *c, *tc_out, *h, *dgates, *dc_prev;
    unsigned csr;
} cells_job;

static int cells_part(void *ctx, long part)
{
    const cells_job *j = ctx;
    long r0 = part * j->rows_per, r1 = r0 + j->rows_per < j->rows ? r0 + j->rows_per : j->rows;
    long n = r1 - r0, g = 4 * j->hid, o4 = r0 * g, o1 = r0 * j->hid;
    unsigned fp = hbfp_fp_state();
    hbfp_fp_leave(j->csr);
    int rc = j->dc == NULL
        ? hbfp_lstm_cell(j->p + o4, j->xp + o4, j->c_prev + o1, n, j->hid, j->acts + o4, j->c + o1, j->tc_out + o1,
                         j->h + o1)
        : hbfp_lstm_cell_backward(j->acts_in + o4, j->c_prev + o1, j->tc + o1, j->dy + o1, j->dh + o1, j->dc + o1, n,
                                  j->hid, j->dgates + o4, j->dc_prev + o1);
    hbfp_fp_leave(fp);
    return rc;
}

static int cells(cells_job *j, int threads)
{
    long parts = threads < j->rows ? threads : j->rows;
    parts = parts < 1 ? 1 : parts;
    j->rows_per = (j->rows + parts - 1) / parts;
    j->csr = hbfp_fp_state();
    return hbfp_parallel(cells_part, j, (j->rows + j->rows_per - 1) / j->rows_per, threads);
}

/* Forward over `steps` steps from h0, c0 (rows x hid): xp (steps x rows x 4 hid, the input
   projections with the biases), w (hid x 4 hid: W_hh^T's codes); every step's acts, c, tc and h
   (the layouts of hbfp_lstm_cell, step after step). */
int hbfp_lstm_steps(const hbfp_operand *w, const float *xp, const float *h0, const float *c0, long steps, long rows,
                    long hid, int mbits, int rounding, const unsigned *keys, float *acts, float *c, float *tc,
                    float *h, int threads)
{
    if (steps < 0 || rows < 0 || hid < 0 || w->th != w->tw || (w->code_bytes == 1) != (mbits <= 8))
        return HBFP_EINVAL;
    if (!steps || !rows || !hid)
        return 0;
    long g = 4 * hid;
    state_codes s;
    float *p = malloc((size_t)(rows * g) * sizeof(float));
    int rc = state_codes_init(&s, w, rows, hid, mbits);
    if (!rc && !p)
        rc = HBFP_ENOMEM;
    const float *hp = h0, *cp = c0;
    for (long t = 0; t < steps && !rc; t++) {
        rc = step_product(&s, hp, rows, hid, g, mbits, rounding, keys[t], w, p, threads);
        if (rc)
            break;
        float *ct = c + t * rows * hid, *ht = h + t * rows * hid;
        cells_job j = {.p = p, .xp = xp + t * rows * g, .c_prev = cp, .rows = rows, .hid = hid,
                       .acts = acts + t * rows * g, .c = ct, .tc_out = tc + t * rows * hid, .h = ht};
        rc = cells(&j, threads);
        hp = ht;
        cp = ct;
    }
    free(p);
    state_codes_free(&s);
    return rc;
}

/* Backward over the steps, the last first: from acts, c (and c0 before the first), tc and dy
   (the gradient of every step's h from the layer's output), with dh and dc the gradients of
   the last h and c (read, then overwritten with those of h0, when need_h0, and of c0); every
   step's dgates. Step t's dh for step t - 1 is dgates_t (quantized under keys[steps - 1 - t])
   times wt (4 hid x hid: W_hh's codes as the forward read them); the first step's is made only
   when need_h0. */
int hbfp_lstm_steps_backward(const hbfp_operand *wt, const float *acts, const float *c0, const float *c,
                             const float *tc, const float *dy, long steps, long rows, long hid, int need_h0,
                             int mbits, int rounding, const unsigned *keys, float *dh, float *dc, float *dgates,
                             int threads)
{
    if (steps < 0 || rows < 0 || hid < 0 || wt->th != wt->tw || (wt->code_bytes == 1) != (mbits <= 8))
        return HBFP_EINVAL;
    if (!steps || !rows || !hid)
        return 0;
    long g = 4 * hid, n = rows * hid;
    state_codes s;
    float *spare = malloc((size_t)(2 * n) * sizeof(float));
    int rc = state_codes_init(&s, wt, rows, g, mbits);
    if (!rc && !spare)
        rc = HBFP_ENOMEM;
    float *dh_at = dh, *dc_at = dc;  /* where this step's dh and dc lie */
    for (long t = steps - 1; t >= 0 && !rc; t--) {
        float *dc_prev = dc_at == dc ? spare : dc;
        float *dg = dgates + t * rows * g;
        cells_job j = {.acts_in = acts + t * rows * g, .c_prev = t ? c + (t - 1) * n : c0, .tc = tc + t * n,
                       .dy = dy + t * n, .dh = dh_at, .dc = dc_at, .rows = rows, .hid = hid, .dgates = dg,
                       .dc_prev = dc_prev};
        rc = cells(&j, threads);
        dc_at = dc_prev;
        if (rc || !(t || need_h0))
            continue;
        float *dh_prev = dh_at == dh ? spare + n : dh;
        rc = step_product(&s, dg, rows, g, hid, mbits, rounding, keys[steps - 1 - t], wt, dh_prev, threads);
        dh_at = dh_prev;
    }
    if (!rc && dh_at != dh)
        memcpy(dh, dh_at, (size_t)n * sizeof(float));
    if (!rc && dc_at != dc)
        memcpy(dc, dc_at, (size_t)n * sizeof(float));
    free(spare);
    state_codes_free(&s);
    return rc;
}
