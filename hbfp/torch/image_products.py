"""A 2-d convolution's products on an in-process device, over its positions without the fp32
patch matrix (``hbfp.torch.convolution``):

- ``_LazyPatches``: the patches' codes quantized from the image directly, and the input's
  gradient folded onto the image as the product makes it (``fold``);
- ``_ImageProduct``: the product made straight into the output's layout, with its bias;

each a few images at a time (``_run_images``), the runs side by side on the threads, so that
what reads a product's columns next finds them in the cache. The same sums, bits and counts as
the general path's products.
"""

from __future__ import annotations

import torch

from hbfp.recipes import ProductConfig, RecipeInUse

from .device import _device_work, _square


def _run_images(n: int, per_image: int, values: int) -> int:
    """The images a run of a product over a convolution's positions takes (``_product_by_images``):
    as many as keep a run's ``values`` fp32 values a position within ``_LazyPatches.FOLD_BYTES``."""
    return max(1, min(n, _LazyPatches.FOLD_BYTES // max(1, 4 * values * per_image)))


def _product_by_images(device, w, transpose_w: bool, rows, geometry: tuple, out, *, bias=None, fold: bool) -> None:
    """``op(W) @ rows^T`` a few images at a time (``_run_images``) into ``out``: ``w`` the codes
    and exponents of W as the product stores it (``transpose_w``: it reads them transposed),
    ``rows`` those of a matrix of positions (the patches, an output gradient) of the images of
    ``geometry`` (``kernels.conv_geometry``'s). A run's product covers the whole tile rows of
    ``rows`` that hold its positions, into a buffer of the thread that makes it (the runs side
    by side on the kernels' threads: a product of a few thousand columns does not split well
    over threads, runs do), then its images' part of ``out`` is made from the buffer while it
    is in the cache: with ``fold``, col2im of its columns onto the images' gradient; else its
    images' planes of the N x OUT x OH x OW output, plus ``bias`` (``hbfp.kernels`` native
    ``conv_runs``). Every column is its own sum, so ``out`` has the bits of the whole product's;
    the product is counted once, as ``_device_gemm`` counts it."""
    from hbfp.host import planner
    from hbfp.host.device import check_product_size
    from hbfp.host.protocol import code_bytes
    from hbfp.kernels import _code_bound, default_threads

    from . import counts as _report
    from .device import _compiled_cpu

    lib, fmt = _compiled_cpu(), device.format()
    (ca, ea), (cr, er) = w, rows
    fa = fmt
    if transpose_w:
        ca, ea, fa = ca.t(), ea.t(), fmt.transposed()
    (m, k), p = ca.shape, cr.shape[0]
    check_product_size(m, p, k, code_bytes=code_bytes(fmt.mantissa_bits))
    n, per_image = geometry[0], geometry[12] * geometry[13]
    if p != n * per_image:  # the kernel reads n * per_image rows of positions
        raise ValueError(f"a convolution of {n} images of {per_image} positions takes {n * per_image} rows of "
                         f"positions, got {p}")
    with _device_work():
        bounds = _code_bound(ca.numpy(), fa), _code_bound(cr.numpy(), fmt)  # of the whole operands
        lib.conv_runs(ca, ea, fa, cr.t(), er.t(), fmt.transposed(), _run_images(n, per_image, m),
                      None if bias is None else bias.detach().contiguous(), geometry, out, fold, default_threads(),
                      *bounds)
    _report.count_device(m * k * p)
    device.count_tensors_product(m, p, k, transpose_w, True, planner.OUT_CODES["fp32"])


class _LazyPatches:
    """The patches of a convolution of ``x`` that a product reads as codes only: quantized from
    the image directly (``hbfp.kernels.im2col_quantize``: no fp32 patch matrix), with the
    rounding and the seed the product would give the patch matrix itself."""

    def __init__(self, x, kernel, stride, padding, dilation):
        self.x, self.geometry = x.detach(), (kernel, stride, padding, dilation)
        self.grad = None  # the image's gradient, where ``fold`` made it

    @staticmethod
    def applies(device, x) -> bool:
        from hbfp import kernels

        return (device.in_process and _square(device) and x.dtype == torch.float32
                and x.device.type == "cpu" and kernels._conv_lib(x) is not None)

    @torch.compiler.disable
    def codes(self, device, cfg: ProductConfig, in_use: RecipeInUse):
        from hbfp import kernels

        seed = in_use.seed(cfg)  # as _operand draws it: one a quantization
        with _device_work():
            return kernels.im2col_quantize(self.x, *self.geometry, device.format(cfg.rounding), seed=seed)

    #: The columns of a product over a convolution's positions made at a time (``fold``'s patch
    #: gradient, ``_ImageProduct``'s output): about this many bytes (at least an image's), so
    #: that what reads them next (col2im, the copy into the image's layout) finds them in the
    #: cache the product wrote, and a product has runs enough to share evenly over the threads
    #: (each run one thread's). The CNN step of ../shared/checks/faster.py at 2 threads: 16.4
    #: and 16.5 ms against 16.9 and 17.9 with 2 MiB (the forward's 4 runs of 8 images), the
    #: same at one thread.
    FOLD_BYTES = 512 << 10

    @staticmethod
    def folds(device, grad: torch.Tensor, cfg: ProductConfig) -> bool:
        """Whether ``fold`` makes the patches' gradient of this product (``grad`` the output's)."""
        from .device import _compiled_cpu

        return (cfg.out == "fp32" and device.in_process and _square(device) and grad.dtype == torch.float32
                and grad.device.type == "cpu" and _compiled_cpu() is not None)

    @torch.compiler.disable
    def fold(self, device, qw, transpose_w: bool, qg) -> None:
        """The image's gradient, ``col2im`` of the patches' gradient (``op(W) @ G^T``, C*KH*KW x
        positions: ``qw`` the codes of W^T as the product stores them, ``transpose_w`` whether it
        reads them transposed; ``qg`` the output gradient's codes), made a few images at a time:
        each run of images' columns (from the tile row before its first position to the one
        after its last) into one buffer, then summed onto those images, while the buffer is in
        the cache; the runs shared over the threads (``_product_by_images``'s ``shared``: each
        writes only its images' gradient). Every column is its own sum and every pixel adds its terms in the same order,
        so the gradient has the bits of the whole product's col2im; the product is counted once,
        as ``_device_gemm`` counts it. Kept for ``_Patches.backward`` (``grad``)."""
        from hbfp import kernels

        g = kernels.conv_geometry(tuple(self.x.shape), *self.geometry)
        grad = torch.empty(self.x.shape, dtype=torch.float32)
        _product_by_images(device, qw, transpose_w, qg, g, grad, fold=True)
        self.grad = grad


class _ImageProduct(torch.autograd.Function):
    """A 2-d convolution's product on an in-process device, made straight into its output
    (N, OUT, OH, OW) with its bias: W @ patches^T a few images at a time into a buffer (from the
    tile row of the patches before a run's first position to the one after its last), each run
    then added to the bias and laid out as the image's planes in one pass while the buffer is in
    the cache (``_product_by_images``); so the (OUT x positions) product, its sum with the bias and their copy into the
    image's layout, each a pass over memory, are not made. The same sums, the same bits, the same
    counts as ``HbfpMatmul``'s product (``out_t``), ``_add_bias`` and the copy; the backward makes
    the output gradient's (positions x OUT) view as the copy's backward does, the bias's
    gradient as the sum's (``sum_to_size`` of that view) and the products' as ``HbfpMatmul``."""

    @staticmethod
    def forward(ctx, a, b, bias, device, stored, patches, shape):
        from . import counts as _report
        from .autograd import HbfpMatmul
        from .config import recipe_in_use

        in_use = recipe_in_use()
        in_use.note(a, b)
        cfg = in_use.recipe.forward
        ctx.device, ctx.stored, ctx.in_use, ctx.patches = device, stored, in_use, patches
        ctx.op, ctx.lean = _report.current(), None
        HbfpMatmul._operands(ctx, a, b, cfg, in_use, True)
        ctx.bias_shape = None if bias is None else bias.shape
        from hbfp import kernels

        out = torch.empty(shape, dtype=torch.float32)
        g = kernels.conv_geometry(tuple(patches.x.shape), *patches.geometry)
        _product_by_images(device, ctx.qb, not ctx.transposed, ctx.qa, g, out, bias=bias, fold=False)
        return out

    @staticmethod
    def backward(ctx, grad):
        from . import counts as _report
        from .autograd import HbfpMatmul

        n, out_ch = grad.shape[:2]
        # as the backward of the copy into the image's layout makes it: (OUT x positions), then
        # its (positions x OUT) view, which the bias's sum and the products read
        g = grad.reshape(n, out_ch, -1).transpose(0, 1).reshape(out_ch, -1).t()
        grad_bias = None if ctx.bias_shape is None else g.sum_to_size(ctx.bias_shape)
        with _report.routing(ctx.op or "matmul"):
            grad_a, grad_b = HbfpMatmul._backward(ctx, g)[:2]
        return grad_a, grad_b, grad_bias, None, None, None, None

    @staticmethod
    def applies(device, x, weight, bias, groups: int) -> bool:
        """Whether the product goes straight into the output: fp32 operands, one group, a
        recipe whose forward product returns its fp32 sums (``_LazyPatches`` applying)."""
        from .config import recipe_in_use

        return (groups == 1 and weight.dtype == torch.float32 and (bias is None or bias.dtype == torch.float32)
                and recipe_in_use().recipe.forward.out == "fp32")
