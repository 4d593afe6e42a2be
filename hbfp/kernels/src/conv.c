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
    long sp, sc; /* col2im: the patch matrix's strides (positions, columns) */
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
#if defined(__AVX2__)
    /* Stride 1: per column of the patch matrix, the image row it reads (NULL: outside the
       image) and the positions [lo, hi) that read inside it; blocks of 8 positions x 8 columns
       go through the registers, transposed (8 loads of a run of a row, masked where positions
       read outside it, and 8 stores of a run of a patch row); the rest below, one by one. */
    const float **src = sw == 1 ? malloc((size_t)ckk * sizeof(*src)) : NULL;
    long *lim = src ? malloc((size_t)ckk * 2 * sizeof(long)) : NULL;
#endif
    for (long p = p0; p < p0 + count;) {
        long b = p / (oh * ow), y = p / ow % oh, z0 = p % ow;
        long z1 = z0 + (p0 + count - p) < ow ? z0 + (p0 + count - p) : ow; /* the run within this row */
        float *out = dst + (p - p0) * ckk;
#if defined(__AVX2__)
        if (src && lim && z1 - z0 >= 8) {
            for (long ch = 0, col = 0; ch < c; ch++)
                for (long i = 0; i < kh; i++) {
                    long yy = y * sh - ph + i * dh;
                    for (long j = 0; j < kw; j++, col++) {
                        long off = j * dw - pw;
                        src[col] = yy < 0 || yy >= h ? NULL : x + ((b * c + ch) * h + yy) * w + off;
                        lim[2 * col] = off >= 0 ? 0 : -off;
                        lim[2 * col + 1] = w - off;
                    }
                }
            const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            long zb = z0;
            for (; zb + 8 <= z1; zb += 8) {
                float *d = out + (zb - z0) * ckk;
                const __m256i at = _mm256_add_epi32(lane, _mm256_set1_epi32((int)zb));
                long c0 = 0;
                for (; c0 + 8 <= ckk; c0 += 8) {
                    __m256 r[8];
                    for (int q = 0; q < 8; q++) {
                        long cq = c0 + q;
                        /* the lanes whose positions read inside the image row (a masked-off
                           lane reads no memory) */
                        __m256i in = _mm256_andnot_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)lim[2 * cq]), at),
                                                         _mm256_cmpgt_epi32(_mm256_set1_epi32((int)lim[2 * cq + 1]), at));
                        r[q] = src[cq] ? _mm256_maskload_ps(src[cq] + zb, in) : _mm256_setzero_ps();
                    }
                    transpose8_regs(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], d + c0, ckk);
                }
                for (; c0 < ckk; c0++)
                    for (long z = zb; z < zb + 8; z++)
                        d[(z - zb) * ckk + c0] = src[c0] && z >= lim[2 * c0] && z < lim[2 * c0 + 1] ? src[c0][z] : 0.0f;
            }
            if (zb == z1) {
                p += z1 - z0;
                continue;
            }
            out += (zb - z0) * ckk; /* the run's last few positions, below */
            p += zb - z0;
            z0 = zb;
        }
#endif
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
#if defined(__AVX2__)
    free(src);
    free(lim);
#endif
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

/* The adjoint of im2col: cols ((N*OH*OW) x (C*KH*KW), element (p, col) at p * sp + col * sc:
   row-major, or transposed as a product of the transposed operands writes it) summed into out (N x C x H x
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
                const float *src = g->src + (b * oh + y) * ow * g->sp + col * g->sc;
                long lo = off >= 0 ? 0 : (-off + sw - 1) / sw;       /* the z whose xx lie in the row */
                long hi = w - off <= 0 ? 0 : (w - off + sw - 1) / sw;
                hi = hi < ow ? hi : ow;
                if (sw == 1)
                    for (long z = lo; z < hi; z++)
                        row[z + off] += src[z * g->sp];
                else
                    for (long z = lo; z < hi; z++)
                        row[z * sw + off] += src[z * g->sp];
            }
        }
    }
    return 0;
}

/* col2im of the transposed matrix (sp == 1: each column's positions consecutive), one part per
   image plane (b, ch): its KH * KW columns in turn, each a run of the plane's positions added
   onto the rows it meets (runs of a row of pixels), in the same order per pixel. */
static int col2im_t_part(void *ctx, long part)
{
    const conv_job *g = ctx;
    long c = g->c, h = g->h, w = g->w, kh = g->kh, kw = g->kw, sh = g->sh, sw = g->sw, ph = g->ph, pw = g->pw;
    long dh = g->dh, dw = g->dw, oh = g->oh, ow = g->ow;
    long b = part / c, ch = part % c;
    float *plane = g->out + (b * c + ch) * h * w;
    memset(plane, 0, (size_t)(h * w) * sizeof(float));
    for (long i = 0; i < kh; i++)
        for (long j = 0; j < kw; j++) {
            const float *col = g->src + ((ch * kh + i) * kw + j) * g->sc + b * oh * ow;
            long off = j * dw - pw; /* xx = z * sw + off */
            long lo = off >= 0 ? 0 : (-off + sw - 1) / sw;
            long hi = w - off <= 0 ? 0 : (w - off + sw - 1) / sw;
            hi = hi < ow ? hi : ow;
            for (long y = 0; y < oh; y++) {
                long yy = y * sh - ph + i * dh;
                if (yy < 0 || yy >= h)
                    continue;
                float *restrict row = plane + yy * w;
                const float *restrict src = col + y * ow;
                if (sw == 1)
                    for (long z = lo; z < hi; z++)
                        row[z + off] += src[z];
                else
                    for (long z = lo; z < hi; z++)
                        row[z * sw + off] += src[z];
            }
        }
    return 0;
}

int hbfp_col2im(const float *cols, long sp, long sc, long n, long c, long h, long w, long kh, long kw, long sh, long sw,
                long ph, long pw, long dh, long dw, long oh, long ow, float *out, int threads)
{
    conv_job g = {cols, n, c, h, w, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow, out, sp, sc};
    if (n * oh * ow * c * kh * kw < PARALLEL_ELEMENTS)
        threads = 1;
    if (sp == 1 && sc != 1)
        return hbfp_parallel(col2im_t_part, &g, n * c, threads);
    return hbfp_parallel(col2im_part, &g, n * h, threads);
}

/* ---- a stack of matrices transposed (a product's rows of output positions to an image and
   back) ------------------------------------------------------------------------------------ */

#define TRANSPOSE_BLOCK 32

typedef struct {
    const float *x;
    long batch, m, n, row_blocks;
    float *out;
} transpose_job;

/* Rows [i0, i0 + TRANSPOSE_BLOCK) of matrix b, all columns, in 32 x 32 blocks: a block's rows
   are read where they lie and its columns written as the output's rows, both within the cache
   (torch's strided copy of a transposed view goes element by element, several times slower). */
static int transpose_part(void *ctx, long part)
{
    const transpose_job *g = ctx;
    long b = part / g->row_blocks, i0 = part % g->row_blocks * TRANSPOSE_BLOCK;
    long i1 = i0 + TRANSPOSE_BLOCK < g->m ? i0 + TRANSPOSE_BLOCK : g->m, m = g->m, n = g->n;
    const float *x = g->x + b * m * n;
    float *out = g->out + b * m * n;
    for (long j0 = 0; j0 < n; j0 += TRANSPOSE_BLOCK) {
        long j1 = j0 + TRANSPOSE_BLOCK < n ? j0 + TRANSPOSE_BLOCK : n;
        long i = i0, j = j0;
#if defined(__AVX2__)
        /* 8 x 8 blocks in registers: eight rows in, eight columns out */
        for (i = i0; i + 8 <= i1; i += 8)
            for (j = j0; j + 8 <= j1; j += 8) {
                transpose8(x + i * n + j, n, out + j * m + i, m);
            }
        /* the block's edges: columns past the last whole 8, then rows past the last whole 8 */
        for (long ii = i0; ii < i; ii++)
            for (long jj = j; jj < j1; jj++)
                out[jj * m + ii] = x[ii * n + jj];
#endif
        for (long jj = j0; jj < j1; jj++)
            for (long ii = i; ii < i1; ii++)
                out[jj * m + ii] = x[ii * n + jj];
    }
    return 0;
}

int hbfp_transpose(const float *x, long batch, long m, long n, float *out, int threads)
{
    if (batch < 0 || m < 0 || n < 0)
        return HBFP_EINVAL;
    transpose_job g = {x, batch, m, n, (m + TRANSPOSE_BLOCK - 1) / TRANSPOSE_BLOCK, out};
    if (batch * m * n < PARALLEL_ELEMENTS)
        threads = 1;
    return hbfp_parallel(transpose_part, &g, batch * g.row_blocks, threads);
}

/* ---- a convolution's product a few images at a time ------------------------------------- */

typedef struct {
    const hbfp_operand *a, *b;
    long m, k, run_images, runs;
    const float *bias;
    float *out;
    int fold;
    unsigned csr; /* the caller's fp32 environment: the bias is added in it, as torch adds it */
    conv_job geo;
} runs_job;

/* Run `part`: images [b0, b1), positions [p0, p1) = [b0, b1) * OH*OW; its product over the
   whole tiles of positions [q0, q1) into this thread's buffer, then its images' part of the
   result from the buffer while it is in the cache. */
static int run_part(void *ctx, long part)
{
    const runs_job *r = ctx;
    const conv_job *g = &r->geo;
    long per_image = g->oh * g->ow, p = g->n * per_image, tile = r->b->tw;
    long b0 = part * r->run_images, b1 = b0 + r->run_images < g->n ? b0 + r->run_images : g->n;
    long p0 = b0 * per_image, p1 = b1 * per_image;
    long q0 = p0 / tile * tile, q1 = (p1 + tile - 1) / tile * tile;
    q1 = q1 < p ? q1 : p;
    long width = q1 - q0;
    float *cols = hbfp_thread_buffer(HBFP_BUFFER_RUN, (size_t)(r->m * width) * sizeof(float));
    if (cols == NULL)
        return HBFP_ENOMEM;
    hbfp_operand b = *r->b;
    b.codes = (const char *)b.codes + q0 * b.cs * b.code_bytes;
    b.exps += q0 / tile * b.ecs;
    hbfp_output o = {cols, width, 0, 0, NULL, 0, 0, NULL, NULL};
    int rc = hbfp_gemm(r->a, &b, &o, 1, r->m, width, r->k, 1);
    if (rc)
        return rc;
    const float *run = cols + (p0 - q0);
    if (r->fold) /* the patches' gradient (positions x C*KH*KW, by columns) onto the images */
        return hbfp_col2im(run, 1, width, b1 - b0, g->c, g->h, g->w, g->kh, g->kw, g->sh, g->sw, g->ph, g->pw, g->dh,
                           g->dw, g->oh, g->ow, r->out + b0 * g->c * g->h * g->w, 1);
    unsigned fp = hbfp_fp_state();
    hbfp_fp_leave(r->csr);
    for (long i = b0; i < b1; i++)
        for (long ch = 0; ch < r->m; ch++) {
            const float *restrict src = run + ch * width + (i - b0) * per_image;
            float *restrict dst = r->out + (i * r->m + ch) * per_image;
            if (r->bias == NULL) {
                memcpy(dst, src, (size_t)per_image * sizeof(float));
            } else {
                float bias = r->bias[ch];
                for (long j = 0; j < per_image; j++)
                    dst[j] = src[j] + bias;
            }
        }
    hbfp_fp_leave(fp);
    return 0;
}

int hbfp_conv_runs(const hbfp_operand *a, const hbfp_operand *b, long m, long k, long run_images, const float *bias,
                   long n, long c, long h, long w, long kh, long kw, long sh, long sw, long ph, long pw, long dh, long dw,
                   long oh, long ow, float *out, int fold, int threads)
{
    if (m < 0 || k < 0 || n < 0 || run_images < 1 || b->tw < 1 || oh < 0 || ow < 0 || !out ||
        (fold && (m != c * kh * kw || bias != NULL)))
        return HBFP_EINVAL;
    runs_job r = {a, b, m, k, run_images, (n + run_images - 1) / run_images, bias, out, fold, hbfp_fp_state(),
                  {NULL, n, c, h, w, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow, NULL}};
    return hbfp_parallel(run_part, &r, r.runs, threads);
}
