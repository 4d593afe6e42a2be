"""What Dynamo and Inductor are given while an ``offload`` context is active
(``hbfp.torch.compiled``): ``route``, the torch-function mode's work while Dynamo traces (the
routed functions' products as ``hbfp`` operators), and ``compiling``, Inductor's tables and
passes (the ATen products decomposed into ``hbfp`` operators, ``_EAGER_KERNELS`` kept as ATen
calls, ``HostProducts``).
"""

from __future__ import annotations

import contextlib
import sys
import threading

import torch

from . import aten as _aten
from . import counts as _report
from .compiled import _weights
from .compiled_aten import _DECOMPOSITIONS
from .compiled_routed import _routed_call
from .functional import _add_bias, _scaled_sum

__all__ = ["route", "compiling"]

ops = torch.ops.hbfp


# ---- the routed functions while Dynamo traces ---------------------------------------------------

def _mm2(a, b, label: str, storage: list[int]):
    save = torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)
    return ops.mm(a, b, label, storage, save, _weights(a, b))[0]


def _matmul(a, b, label: str, storage: list[int], fp32_out: bool = False):
    """``hbfp.torch.matmul``'s shapes (vectors, matrices, stacks broadcast) around
    ``hbfp::mm`` and ``hbfp::bmm``; ``fp32_out``: 16-bit operands' product as the device's
    fp32 result (a bias or an input is then added in fp32 and the sum rounded once)."""
    from .functional import _HALF

    if a.dim() == 0 or b.dim() == 0:
        raise ValueError("hbfp matmul takes vectors, matrices or stacks of matrices, not scalars")
    if a.dtype in _HALF or b.dtype in _HALF:  # as fp32 (exactly); the result rounded to their dtype
        y = _matmul(a.float(), b.float(), label, storage)
        return y if fp32_out else y.to(torch.promote_types(a.dtype, b.dtype))
    if b.dim() == 1:
        return _matmul(a, b[:, None], label, storage)[..., 0]
    if a.dim() == 1:
        return _matmul(a[None, :], b, label, storage)[..., 0, :]
    if a.dim() == 2 and b.dim() == 2:
        return _mm2(a, b, label, storage)
    if b.dim() == 2:
        lead = a.shape[:-1]
        return _mm2(a.reshape(-1, a.shape[-1]), b, label, storage).reshape(*lead, b.shape[-1])
    if storage:
        raise ValueError("a stored (wide) operand is a matrix, not a stack")
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a = a.expand(*batch, *a.shape[-2:]).reshape(-1, *a.shape[-2:])
    b = b.expand(*batch, *b.shape[-2:]).reshape(-1, *b.shape[-2:])
    weights = _weights(a, b)
    save = torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)
    out = ops.bmm(a, b, label, save, weights)[0]
    return out.reshape(*batch, *out.shape[-2:])


def _linear(x, weight, bias=None):
    from .storage import weight_storage

    storage = weight_storage(weight)
    stored = [] if storage is None else [storage.mantissa_bits, *storage.tile]
    if bias is None:
        return _matmul(x, weight.t(), "linear", stored)
    return _add_bias(_matmul(x, weight.t(), "linear", stored, fp32_out=True), bias, x.dtype, weight.dtype)


def _scaled(inp, a, b, *, beta=1, alpha=1):
    return _scaled_sum(_matmul(a, b, "addmm", [], fp32_out=True), inp, a.dtype, b.dtype, beta, alpha)


_COMPILED = {"linear": _linear, "matmul": lambda a, b: _matmul(a, b, "matmul", []), "addmm": _scaled}


def route(mode, func, args, kwargs):
    """``offload``'s torch-function mode while Dynamo traces: the routed functions' products
    as ``hbfp`` operators (``hbfp::mm``, ``hbfp::bmm``; ``hbfp::routed`` for the convolutions
    and ``bilinear``, computed by their eager routes); everything else as it is."""
    from .routes import _ROUTES, _applies

    _prepare()
    routed = _ROUTES.get(func)
    if routed is None or not getattr(routed, "compiled", True) or not _applies(args, kwargs):
        return func(*args, **kwargs)
    if routed.autocast and torch.is_autocast_enabled("cpu"):  # as autocast runs a product: in its dtype
        dtype = torch.get_autocast_dtype("cpu")
        args = [t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t for t in args]
        kwargs = {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.dtype == torch.float32 else v
                  for k, v in kwargs.items()}
    with torch.autocast("cpu", enabled=False):
        fn = _COMPILED.get(routed.name)
        return fn(*args, **kwargs) if fn is not None else _routed_call(routed.name, args, kwargs)


# ---- what offload sets while it is active -------------------------------------------------------

#: ATen operators with matrix products: none may remain in a graph compiled under offload.
_PRODUCT_OPERATORS = frozenset({
    *_aten._OPS, "_int_mm", "_weight_int8pack_mm", "_addmm_activation", "addr", "linear", "matmul", "einsum",
    "tensordot", "bilinear", "_trilinear", "convolution", "_convolution", "convolution_backward", "conv1d", "conv2d",
    "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "mkldnn_convolution", "mkldnn_rnn_layer",
    "lstm", "gru", "rnn_tanh", "rnn_relu", "_scaled_dot_product_attention_math",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_fused_attention_overrideable", "_scaled_dot_product_cudnn_attention",
    "scaled_dot_product_attention",
})


_CHECKS: dict = {}  # HostProducts by the pass it follows (made where Inductor is imported)


def _host_products_check(inner=None):
    """The ``HostProducts`` pass that runs after ``inner`` (a pass set before ``offload``)."""
    key = id(inner)
    if key in _CHECKS and _CHECKS[key][0] is inner:
        return _CHECKS[key][1]
    from pathlib import Path

    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    code = get_hash_for_files(tuple(sorted(str(f) for f in Path(__file__).parent.glob("*.py"))))  # hbfp.torch's

    class HostProducts(CustomGraphPass):
        """Inductor's last pass over each graph compiled under ``offload``: a matrix product
        that would run on the host (an operator with no route, operands that are not floating
        point) stops the compilation, naming it. Its uuid keys Inductor's caches: no graph
        compiled without offload, or by other code of this package, is reused under it."""

        def __call__(self, graph):
            if inner is not None:
                inner(graph)
            if not _active():
                return
            host = sorted({f"aten.{n.target._opname}" for n in graph.nodes
                           if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
                           and n.target.namespace == "aten" and n.target._opname in _PRODUCT_OPERATORS})
            if host:
                raise RuntimeError(f"under hbfp.torch.offload, this compiled graph would run matrix products on the "
                                   f"host: {', '.join(host)} (operands that are not floating point, or an operator "
                                   "without a route); run that code eagerly (torch.compiler.disable), where offload "
                                   "routes them or reports them")

        def uuid(self):
            inner_id = inner.uuid() if inner is not None and hasattr(inner, "uuid") else None
            return (code, _active(), inner_id)

    _CHECKS[key] = (inner, HostProducts())
    return _CHECKS[key][1]


#: Operators whose results depend on an order of fp32 operations that Inductor's kernels do
#: not keep (reductions, normalizations, softmax, the accumulation of an embedding's gradient):
#: under ``offload`` they stay calls of their ATen kernels in a compiled graph, neither
#: decomposed nor lowered, with their operands in the layout the eager code gives them.
_EAGER_KERNELS = (
    "sum.default", "sum.dim_IntList", "mean.default", "mean.dim", "prod.default", "prod.dim_int",
    "var.correction", "var_mean.correction", "std.correction", "std_mean.correction", "logsumexp.default",
    "linalg_vector_norm.default", "_softmax.default", "_log_softmax.default", "_softmax_backward_data.default",
    "_log_softmax_backward_data.default", "native_layer_norm.default", "native_layer_norm_backward.default",
    "native_group_norm.default", "native_group_norm_backward.default", "native_batch_norm.default",
    "native_batch_norm_backward.default", "_native_batch_norm_legit.default",
    "_native_batch_norm_legit_no_training.default", "_native_batch_norm_legit_functional.default",
    "embedding_dense_backward.default", "nll_loss_forward.default", "nll_loss_backward.default",
    "_adaptive_avg_pool2d.default", "_adaptive_avg_pool2d_backward.default", "avg_pool2d.default",
    "avg_pool2d_backward.default", "native_dropout.default", "native_dropout_backward.default",
    "threshold_backward.default",
)

def _active() -> bool:
    """Whether an ``offload`` context is active on this thread: read while Inductor traces and
    lowers a graph (which it does on the thread that runs the compiled code). Not whether it
    routes products now (its matmul precision): a compiled graph is reused whatever the
    precision, so its products are the device's, and ``_context`` refuses to run them under
    the precision 'highest'."""
    return bool(getattr(_aten._local, "routes", None))


def _decomposition_under_offload(op, offload, original):
    """A decomposition table's entry for ``op``: ``offload``'s (``NotImplemented``: none) where
    an ``offload`` context routes products, else the table's ``original`` one (or none)."""
    def decompose(*args, **kwargs):
        if _active():
            return offload(*args, **kwargs) if offload is not None else NotImplemented
        return original(*args, **kwargs) if original is not None else NotImplemented

    decompose.__name__ = f"hbfp_{op.name().replace('::', '_').replace('.', '_')}"
    return decompose


def _lowering_under_offload(op, original):
    """``lowerings[op]``: an ATen call of ``op`` where an ``offload`` context routes products,
    else Inductor's ``original`` lowering (or its implicit fallback, where it has none)."""
    from torch._inductor import lowering

    fallback = lowering.fallback_handler(op, add_to_fallback_set=False)

    def lower(*args, **kwargs):
        return (fallback if _active() or original is None else original)(*args, **kwargs)
    return lower


def _layout_under_offload(original):
    """The layout constraint of an ``_EAGER_KERNELS`` operator: its operands in the layout the
    traced (eager) code gives them where an ``offload`` context routes products."""
    from torch._inductor import lowering

    def constrain(node, *args, **kwargs):
        if _active():
            return lowering.constrain_to_fx_strides(node, *args, **kwargs)
        return original(node, *args, **kwargs) if original is not None else (args, kwargs)
    return constrain


_install_lock = threading.Lock()
_installed = {"done": False, "probed": False, "users": 0, "checking": False, "check": None}


def _install() -> None:
    """Puts ``offload``'s entries in Inductor's tables, once per process: each acts as described
    only on a thread where an ``offload`` context is active, and as Inductor's own entry
    elsewhere (so that graphs compiled without ``offload``, on any thread, stay as they were)."""
    from torch._inductor import decomposition, lowering

    eager = []
    for name in _EAGER_KERNELS:
        packet, overload = name.split(".")
        op = getattr(getattr(torch.ops.aten, packet, None), overload, None)
        if op is not None:
            eager.append(op)
    for table in (decomposition.decompositions, decomposition.fast_random_decomps()):
        for op, fn in _DECOMPOSITIONS.items():
            table[op] = _decomposition_under_offload(op, fn, table.get(op))
        for op in eager:
            if op in table:
                table[op] = _decomposition_under_offload(op, None, table[op])
    for op in eager:
        lowering.lowerings[op] = _lowering_under_offload(op, lowering.lowerings.get(op))
        lowering._maybe_layout_constraints[op] = _layout_under_offload(lowering._maybe_layout_constraints.get(op))


_PROBE = "dynamo's probe"


def _probe() -> bool:
    """Dynamo's first compilation in a process runs each Python operator once on one-element
    tensors (to learn its torch function): run here first, where torch's own kernels compute it
    (no ``offload`` context has replaced them yet), or where this thread's context routes it
    (then on the device, and not counted in ``report()``). False where neither holds (another
    thread's context replaced the kernels): to be run later."""
    try:
        from torch._dynamo.variables.builtin import populate_builtin_to_tensor_fn_map
    except ImportError:
        return True
    routes = getattr(_aten._local, "routes", None)
    if routes and routes[-1][1]():
        with _report.routing(_PROBE):
            populate_builtin_to_tensor_fn_map()
        _report.discard(_PROBE)
        return True
    if not routes and _aten._registration["users"] == 0:
        populate_builtin_to_tensor_fn_map()
        return True
    return False


def _prepare_locked() -> None:
    """Inductor set for compiling under ``offload`` (``_install`` once; the check while any
    context is active); with ``_install_lock`` held and a context active."""
    import torch._inductor.config as inductor_config

    if not _installed["done"]:
        _install()
        _installed["done"] = True
    if not _installed["probed"]:
        _installed["probed"] = _probe()
    if not _installed["checking"]:
        _installed["check"] = inductor_config.post_grad_custom_post_pass
        inductor_config.post_grad_custom_post_pass = _host_products_check(_installed["check"])
        _installed["checking"] = True


@torch.compiler.assume_constant_result  # run (not traced) where Dynamo meets it: before Inductor compiles
def _prepare() -> bool:
    """Dynamo traces code under ``offload`` (``route``): Inductor, which compiles what it traces
    next, is set for it (the first time in a process where Inductor was not in use when the
    ``offload`` context began)."""
    with _install_lock:
        if _installed["users"]:
            _prepare_locked()
    return True


@contextlib.contextmanager
def compiling():
    """While an ``offload`` context is active: Inductor decomposes the ATen products of a graph
    it compiles on this thread into ``hbfp`` operators and keeps ``_EAGER_KERNELS`` as ATen calls
    (``_install``), and checks every graph it compiles for products left on the host
    (``HostProducts``, Inductor's last pass while any context is active). Nothing of Inductor is
    imported where it is not in use: eager code under ``offload`` does not pay for it (``route``
    prepares it when Dynamo traces)."""
    with _install_lock:
        _installed["users"] += 1
        if "torch._inductor.compile_fx" in sys.modules:  # Inductor in use (torch.compile imports it)
            _prepare_locked()
    try:
        yield
    finally:
        with _install_lock:
            _installed["users"] -= 1
            if _installed["users"] == 0 and _installed["checking"]:
                import torch._inductor.config as inductor_config

                inductor_config.post_grad_custom_post_pass = _installed["check"]
                _installed["check"], _installed["checking"] = None, False
