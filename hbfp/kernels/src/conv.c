/* The patches of a convolution as one matrix (im2col, torch's unfold transposed) and their
   adjoint (col2im, torch's fold), so that a convolution is one product.

   Both walk the image row by row: a row of output positions reads (im2col) or a row of pixels
   takes terms from (col2im) KH rows of the other side, a working set that stays in the cache,
   where going channel by channel over the whole matrix would stream it from memory KH * KW
   times. */

#include <string.h>

#include "common.h"

#define PARALLEL_ELEMENTS (1L << 17)

typedef struct {
    const float *src;
    long n, c, h, w, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow;
    float *out;
} conv_job;

/* Rows [p0, p0 + count) of the patch matrix into dst (row-major, C*KH*KW values a row): output
   position p = (b, y, z) of x (N x C x H x W fp32, contiguous) holds
   x[b, c, y*sh - ph + i*dh, z*sw - pw + j*dw] at column (c*KH + i)*KW + j, zero outside the
   image. Column by column over each run of positions of one image row, so that a column reads
   a run of the image's row (consecutive where the stride is 1). */
void hbfp_patch_rows(const float *x, long c, long h, long w, long kh, long kw, long sh, long sw, long ph, long pw,
                     long dh, long dw, long oh, long ow, long p0, long count, float *dst)
{
    long ckk = c * kh * kw;
    for (long p = p0; p < p0 + count;) {
        long b = p / (oh * ow), y = p / ow % oh, z0 = p % ow;
        long z1 = z0 + (p0 + count - p) < ow ? z0 + (p0 + count - p) : ow; /* the run within this row */
        float *out = dst + (p - p0) * ckk;
        for (long ch = 0; ch < c; ch++) {
            const float *img = x + (b * c + ch) * h * w;
            for (long i = 0; i < kh; i++) {
                long yy = y * sh - ph + i * dh;
                for (long j = 0; j < kw; j++) {
                    float *d = out + (ch * kh + i) * kw + j - z0 * ckk;
                    if (yy < 0 || yy >= h) {
                        for (long z = z0; z < z1; z++)
                            d[z * ckk] = 0.0f;
                        continue;
                    }
                    const float *row = img + yy * w;
                    long off = j * dw - pw; /* xx = z * sw + off */
                    long lo = off >= 0 ? 0 : (-off + sw - 1) / sw;       /* first z with xx >= 0 */
                    long hi = w - off <= 0 ? 0 : (w - off + sw - 1) / sw; /* first z with xx >= w */
                    lo = lo < z0 ? z0 : lo > z1 ? z1 : lo;
                    hi = hi > z1 ? z1 : hi < lo ? lo : hi;
                    for (long z = z0; z < lo; z++)
                        d[z * ckk] = 0.0f;
                    for (long z = lo; z < hi; z++)
                        d[z * ckk] = row[z * sw + off];
                    for (long z = hi; z < z1; z++)
                        d[z * ckk] = 0.0f;
                }
            }
        }
        p += z1 - z0;
    }
}

/* x to out: (N*OH*OW) x (C*KH*KW), row-major (hbfp_patch_rows). One part per row of output
   positions (an image's row y). */
static int im2col_part(void *ctx, long part)
{
    const conv_job *g = ctx;
    long ckk = g->c * g->kh * g->kw;
    hbfp_patch_rows(g->src, g->c, g->h, g->w, g->kh, g->kw, g->sh, g->sw, g->ph, g->pw, g->dh, g->dw, g->oh, g->ow,
                    part * g->ow, g->ow, g->out + part * g->ow * ckk);
    return 0;
}

int hbfp_im2col(const float *x, long n, long c, long h, long w, long kh, long kw, long sh, long sw, long ph, long pw,
                long dh, long dw, long oh, long ow, float *out, int threads)
{
    conv_job g = {x, n, c, h, w, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow, out};
    if (n * oh * ow * c * kh * kw < PARALLEL_ELEMENTS)
        threads = 1;
    return hbfp_parallel(im2col_part, &g, n * oh, threads);
}

/* The adjoint of im2col: cols ((N*OH*OW) x (C*KH*KW), row-major) summed into out (N x C x H x
   W), every pixel starting at +0 and adding its terms in ascending (i, j) (its channel's
   columns), the order of torch's col2im, so the sums have its bits. One part per row of
   pixels of an image (all its channels): the terms of row yy come from output rows
   y = (yy + ph - i*dh) / sh, KH of them. */
static int col2im_part(void *ctx, long part)
{
    const conv_job *g = ctx;
    long c = g->c, h = g->h, w = g->w, kh = g->kh, kw = g->kw, sh = g->sh, sw = g->sw, ph = g->ph, pw = g->pw;
    long dh = g->dh, dw = g->dw, oh = g->oh, ow = g->ow, ckk = c * kh * kw;
    long b = part / h, yy = part % h;
    for (long ch = 0; ch < c; ch++) {
        float *row = g->out + ((b * c + ch) * h + yy) * w;
        memset(row, 0, (size_t)w * sizeof(float));
        for (long i = 0; i < kh; i++) {
            long t = yy + ph - i * dh; /* = y * sh */
            if (t < 0 || t % sh)
                continue;
            long y = t / sh;
            if (y >= oh)
                continue;
            for (long j = 0; j < kw; j++) {
                long col = (ch * kh + i) * kw + j, off = j * dw - pw; /* xx = z * sw + off */
                const float *src = g->src + (b * oh + y) * ow * ckk + col;
                long lo = off >= 0 ? 0 : (-off + sw - 1) / sw;       /* the z whose xx lie in the row */
                long hi = w - off <= 0 ? 0 : (w - off + sw - 1) / sw;
                hi = hi < ow ? hi : ow;
                if (sw == 1)
                    for (long z = lo; z < hi; z++)
                        row[z + off] += src[z * ckk];
                else
                    for (long z = lo; z < hi; z++)
                        row[z * sw + off] += src[z * ckk];
            }
        }
    }
    return 0;
}

int hbfp_col2im(const float *cols, long n, long c, long h, long w, long kh, long kw, long sh, long sw, long ph,
                long pw, long dh, long dw, long oh, long ow, float *out, int threads)
{
    conv_job g = {cols, n, c, h, w, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow, out};
    if (n * oh * ow * c * kh * kw < PARALLEL_ELEMENTS)
        threads = 1;
    return hbfp_parallel(col2im_part, &g, n * h, threads);
}
