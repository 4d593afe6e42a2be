"""``nn.LSTM`` under ``offload``, a layer at a time: the input projection of every time step as
one product, the recurrence as one product per step, and the weight gradient of the recurrence
as one product over all steps (as cuDNN computes it), with the cell's elementwise work on the
host in fp32, one call a step (``hbfp.kernels.lstm_cell``, forward and backward). On the emu's
lean path a layer's steps are one call of the compiled kernels each way (``lstm_steps``: each
step's quantization, product and cell in a C loop, the seeds drawn before it in the loop's order).

ATen's own LSTM (what the ATen-level routing sees with oneDNN off) runs each cell as a dozen
operators, each recorded for autograd, and each step's weight gradient as a product of its own
(K = the batch: 32 rows of a 24-row tile grid). Here a step costs one product and one cell call
forward, the same backward; the recurrent weight is quantized once a pass (nearest, as every
forward operand), each step's gate gradient once (the backward configuration's rounding). The
cell's sigmoid and tanh are fp32 formulas of its own (src/cell.c), within 4 ulp of torch's.

The products are the recipe's: forward ones (input projection, h @ W_hh^T) under ``forward``;
the step's hidden gradient (dG @ W_hh, W_hh as the forward read it) under ``grad_input``; the
recurrent weight's gradient dG^T @ H (H: the hidden states the steps read, as one matrix,
rounded as forward operands are) under ``grad_weight``; the input projection's backward
products are ``HbfpMatmul``'s. The gates are torch's order (input, forget, cell, output).

Taken: unidirectional LSTMs without projections (``proj_size`` 0), padded or not, dropout
between layers as ``F.dropout``; anything else (packed sequences, bidirectional, projections,
autocast) goes to ATen's LSTM, whose products the ATen-level routing takes."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["applies", "layers"]


def applies(args, kwargs) -> bool:
    """Whether ``layers`` takes these arguments of ``torch.lstm``: its padded form (input, hx,
    weights, has_biases, num_layers, dropout, train, bidirectional, batch_first), fp32 CPU
    tensors, one direction, no projections, autocast off."""
    if kwargs or len(args) != 9 or not isinstance(args[1], (tuple, list)) or torch.is_autocast_enabled("cpu"):
        return False
    x, hx, weights, has_biases, num_layers, _, _, bidirectional, _ = args
    per = 4 if has_biases else 2
    if bidirectional or not isinstance(x, torch.Tensor) or x.dim() != 3 or len(weights) != per * num_layers:
        return False
    if x.numel() == 0:  # (ATen's LSTM says what is wrong with an empty sequence or batch)
        return False
    tensors = [x, *hx, *weights]
    if any(not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
        return False
    hidden = weights[1].shape[1]  # W_hh: 4H x H (a projection would make it 4H x P)
    return weights[1].shape[0] == 4 * hidden and all(h.shape[-1] == hidden for h in hx)


def layers(device, x, hx, weights, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    """``torch.lstm``'s (output, h_n, c_n) of these arguments on ``device``, layer by layer
    (time-major inside: each step's rows contiguous)."""
    from .functional import matmul

    h0, c0 = hx
    per = 4 if has_biases else 2
    if batch_first:
        x = x.transpose(0, 1)
    hs, cs = [], []
    for layer in range(num_layers):
        w = weights[per * layer: per * layer + per]
        w_ih, w_hh = w[0], w[1]
        # x @ W_ih^T + (b_ih + b_hh): every step's input projection and both biases, one product
        xp = matmul(x.contiguous(), w_ih.t(), device)
        if has_biases:
            xp = xp + (w[2] + w[3])
        x, h, c = _Recurrence.apply(xp, h0[layer], c0[layer], w_hh, device)
        hs.append(h)
        cs.append(c)
        if dropout and train and layer < num_layers - 1:
            x = F.dropout(x, dropout, True)
    return (x.transpose(0, 1).contiguous() if batch_first else x), torch.stack(hs), torch.stack(cs)


def _lean(device, x: torch.Tensor, in_use):
    """(``_Lean``, the compiled kernels) where a step's products take the lean path (its
    quantizations and products, the general path's bits, seeds and counts), else None."""
    from .device import _compiled_cpu
    from .lean import _Lean, _fp32_results

    if x.dtype != torch.float32 or x.device.type != "cpu" or not _fp32_results(in_use.recipe):
        return None
    lean, lib = _Lean.of(device), _compiled_cpu()
    return None if lean is None or lib is None else (lean, lib)


class _Recurrence(torch.autograd.Function):
    """One LSTM layer's recurrence over the projected inputs ``xp`` (T x B x 4H, biases
    included) from ``h0``, ``c0`` (B x H) with ``w_hh`` (4H x H): the outputs (T x B x H), the
    last hidden and cell states. A step is one product and one call of the cell's elementwise
    work (``hbfp.kernels.lstm_cell``), forward and backward."""

    @staticmethod
    def forward(ctx, xp, h0, c0, w_hh, device):
        from hbfp import kernels

        from . import counts as _report
        from .autograd import _operand, _product
        from .config import recipe_in_use
        from .device import _device_work

        in_use = recipe_in_use()
        fwd = in_use.recipe.forward
        hid = w_hh.shape[1]
        with _device_work():
            xp = xp.detach().contiguous()
            acts = torch.empty_like(xp)                # the gates after their nonlinearities
            cell = xp.new_empty(*xp.shape[:2], hid)    # c_t
            tanh_c = torch.empty_like(cell)            # tanh(c_t)
            out = torch.empty_like(cell)               # h_t
            q_w = _operand(device, w_hh.detach().t(), fwd, in_use)  # once for every step
            h, c = h0.detach().contiguous(), c0.detach().contiguous()
            lean = _lean(device, xp, in_use)
            rows, steps = h.shape[0], xp.shape[0]
            if lean is not None:  # every step in one call (src/cell.c), the same quantizations and products
                keys = [lean[0].key(fwd, in_use) for _ in range(steps)]
                for _ in range(steps):
                    lean[0].count(rows, 4 * hid, hid)
                lean[1].lstm_steps(q_w, lean[0].fmt["nearest_even"], lean[0].qmax(), xp, h, c, lean[0].fmt[fwd.rounding],
                                   keys, acts, cell, tanh_c, out, kernels.default_threads())
                if steps:
                    h, c = out[-1], cell[-1]
            else:
                for x_t, a_t, c_t, tc_t, h_t in zip(xp.unbind(0), acts.unbind(0), cell.unbind(0), tanh_c.unbind(0),
                                                    out.unbind(0)):
                    p = _product(device, _operand(device, h, fwd, in_use), q_w, fwd, in_use)
                    kernels.lstm_cell(p, x_t, c, a_t, c_t, tc_t, h_t)
                    h, c = h_t, c_t
        ctx.device, ctx.in_use, ctx.q_w = device, in_use, q_w
        ctx.op = _report.current()
        ctx.save_for_backward(h0, c0, w_hh, acts, cell, tanh_c, out)
        return out, h.clone(), c.clone()

    @staticmethod
    def backward(ctx, d_out, d_h, d_c):
        from hbfp import kernels

        from . import counts as _report
        from .autograd import _operand, _product
        from .device import _device_work

        h0, c0, w_hh, acts, cell, tanh_c, out = ctx.saved_tensors
        device, in_use = ctx.device, ctx.in_use
        gi, gw, fwd = in_use.recipe.grad_input, in_use.recipe.grad_weight, in_use.recipe.forward
        steps, hid = acts.shape[0], w_hh.shape[1]
        need_h0 = ctx.needs_input_grad[1]
        with _report.routing(ctx.op or "lstm"), _device_work():
            d_gates = torch.empty_like(acts)  # the gradient of the gates before their nonlinearities
            d_out = d_out.contiguous()
            lean = _lean(device, acts, in_use)
            q_wt = (ctx.q_w[0].t(), ctx.q_w[1].t())
            if lean is not None:  # every step in one call (src/cell.c), the same quantizations and products
                dh, dc = d_h.contiguous().clone(), d_c.contiguous().clone()  # written: the gradients of h0, c0
                keys = [lean[0].key(gi, in_use) for t in range(steps - 1, -1, -1) if t or need_h0]
                for _ in keys:
                    lean[0].count(acts.shape[1], hid, 4 * hid, transpose_b=True)
                lean[1].lstm_steps_backward(q_wt, lean[0].fmt["nearest_even"], lean[0].qmax(), acts,
                                            c0.detach().contiguous(), cell, tanh_c, d_out, need_h0, lean[0].fmt[gi.rounding],
                                            keys, dh, dc, d_gates, kernels.default_threads())
            else:
                c_prev = [c0.detach().contiguous(), *cell.unbind(0)[:-1]]
                dc_bufs = (torch.empty_like(d_c), torch.empty_like(d_c))
                dh, dc = d_h.contiguous(), d_c.contiguous()
                steps_ = list(zip(acts.unbind(0), tanh_c.unbind(0), d_out.unbind(0), d_gates.unbind(0)))
                for t in range(steps - 1, -1, -1):
                    a_t, tc_t, dy_t, dg_t = steps_[t]
                    dc_prev = dc_bufs[t % 2]
                    kernels.lstm_cell_backward(a_t, c_prev[t], tc_t, dy_t, dh, dc, dg_t, dc_prev)
                    dc = dc_prev
                    if t or need_h0:  # dh_{t-1} = dG_t @ W_hh (W_hh as the forward read it)
                        dh = _product(device, _operand(device, dg_t, gi, in_use), ctx.q_w, gi, in_use, transpose_b=True)
            d_w = None
            if ctx.needs_input_grad[3]:
                # dW_hh = sum_t dG_t^T h_{t-1}: one product over every step (K = steps x batch)
                prev = torch.cat([h0.detach()[None], out[:-1]]).reshape(-1, hid)
                d_w = _product(device, _operand(device, d_gates.reshape(-1, 4 * hid), gw, in_use),
                               _operand(device, prev, fwd, in_use), gw, in_use, transpose_a=True)
        return d_gates, (dh if need_h0 else None), (dc.clone() if ctx.needs_input_grad[2] else None), d_w, None


