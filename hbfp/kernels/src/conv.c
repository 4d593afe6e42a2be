/* The patches of a convolution as one matrix (im2col, torch's unfold transposed) and their
   adjoint (col2im, torch's fold), so that a convolution is one product. */

#include "common.h"

#define PARALLEL_ELEMENTS (1L << 17)

typedef struct {
    const float *src;
    long n, c, h, w, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow;
    float *out;
} conv_job;

/* x: N x C x H x W fp32 (contiguous) to out: (N*OH*OW) x (C*KH*KW), row-major, the row of
   output position (n, oh, ow) holding x[n, c, oh*sh - ph + i*dh, ow*sw - pw + j*dw] at column
   (c*KH + i)*KW + j, zero outside the image. One part per image: for a kernel offset (i, j) the
   output positions whose source lies inside the image are a range of z per row, read along the
   image's row. */
static int im2col_part(void *ctx, long b)
{
    const conv_job *g = ctx;
    long c = g->c, h = g->h, w = g->w, kh = g->kh, kw = g->kw, sh = g->sh, sw = g->sw, ph = g->ph, pw = g->pw;
    long dh = g->dh, dw = g->dw, oh = g->oh, ow = g->ow;
    long ckk = c * kh * kw;
    float *blk = g->out + b * oh * ow * ckk;
    for (long ch = 0; ch < c; ch++) {
        const float *img = g->src + (b * c + ch) * h * w;
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
    return 0;
}

int hbfp_im2col(const float *x, long n, long c, long h, long w, long kh, long kw, long sh, long sw, long ph, long pw,
                long dh, long dw, long oh, long ow, float *out, int threads)
{
    conv_job g = {x, n, c, h, w, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow, out};
    if (n * oh * ow * c * kh * kw < PARALLEL_ELEMENTS)
        threads = 1;
    return hbfp_parallel(im2col_part, &g, n, threads);
}

/* The adjoint of im2col: cols ((N*OH*OW) x (C*KH*KW), row-major) summed into out (N x C x H x
   W), every pixel starting at +0 and adding its terms in ascending (c, i, j), the order of
   torch's col2im, so the sums have its bits. One part per image and channel. */
static int col2im_part(void *ctx, long b)
{
    const conv_job *g = ctx;
    long c = g->c, h = g->h, w = g->w, kh = g->kh, kw = g->kw, sh = g->sh, sw = g->sw, ph = g->ph, pw = g->pw;
    long dh = g->dh, dw = g->dw, oh = g->oh, ow = g->ow;
    long ckk = c * kh * kw;
    long bn = b / c, ch = b % c;
    float *img = g->out + b * h * w;
    for (long p = 0; p < h * w; p++)
        img[p] = 0.0f;
    for (long i = 0; i < kh; i++) {
        for (long j = 0; j < kw; j++) {
            long col = (ch * kh + i) * kw + j;
            for (long y = 0; y < oh; y++) {
                long yy = y * sh - ph + i * dh;
                if (yy < 0 || yy >= h)
                    continue;
                const float *src = g->src + (bn * oh + y) * ow * ckk + col;
                for (long z = 0; z < ow; z++) {
                    long xx = z * sw - pw + j * dw;
                    if (xx >= 0 && xx < w)
                        img[yy * w + xx] += src[z * ckk];
                }
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
    return hbfp_parallel(col2im_part, &g, n * c, threads);
}
