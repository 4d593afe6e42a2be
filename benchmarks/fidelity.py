"""Why HBFP8 with AdamW diverged on a language model, measured (``make fidelity``).

Trains the character-level MLP language model of ``hbfp train`` (``hbfp.train``, "charlm":
Python's documentation, 5 epochs of 200 batches, here of 128 windows) with AdamW and with SGD, in FP32 and in
HBFP8 on ``emu`` under recipes that differ in one thing each:

- "nearest": every operand rounded to nearest (the device's own rounding), HBFP16 master
  weights; and the same with fp32 master weights (is it the wide storage?);
- stochastic rounding of the output gradient in the grad_input product only, in the
  grad_weight product only (which product needs it?);
- "default": stochastic rounding of the output gradient in both backward products.

Prints the validation loss of each (nats per character) beside FP32's, and the share of the
output layer's weight-gradient entries that HBFP8 zeroes where FP32's are not (one batch of a
partly trained model).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def _zeroed_shares(steps: int = 300) -> dict[str, float]:
    """Share of the output layer's weight-gradient entries that HBFP8 makes zero where FP32's
    are not, per recipe ("nearest", "default"), on one batch of the model after ``steps`` FP32
    AdamW steps (at initialization every probability is about 1/vocabulary and none flushes)."""
    import copy

    import hbfp.torch as ht
    from hbfp import host
    from hbfp import train as tr

    text, _, chars = tr.load_text_split()
    gen = torch.Generator().manual_seed(0)
    model = tr.make_model("charlm", 0, len(chars))
    opt = torch.optim.AdamW(model.parameters(), lr=tr.LEARNING_RATES["adamw"], weight_decay=0.01)
    for _ in range(steps):
        x, y = tr._lm_batch("charlm", text, torch.randint(0, len(text) - 40, (tr.LM_BATCH,), generator=gen))
        opt.zero_grad()
        tr._loss("charlm", model, x, y).backward()
        opt.step()
    x, y = tr._lm_batch("charlm", text, torch.randint(0, len(text) - 40, (tr.LM_BATCH,), generator=gen))
    opt.zero_grad()
    tr._loss("charlm", model, x, y).backward()
    fp32 = model[-1].weight.grad
    shares = {}
    for recipe in ("nearest", "default"):
        hb = ht.convert(copy.deepcopy(model), host.open("emu"), recipe=recipe)
        hb.zero_grad()
        tr._loss("charlm", hb, x, y).backward()
        g = hb[-1].weight.grad
        shares[recipe] = float(((g == 0) & (fp32 != 0)).sum() / (fp32 != 0).sum())
    return shares


def main(argv=None) -> int:
    import hbfp.torch as ht
    from hbfp import host
    from hbfp import train as tr

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch", type=int, default=128,
                    help="batch size (default 128: where rounding to nearest diverges; hbfp train uses 64)")
    ap.add_argument("--optimizers", nargs="+", default=["adamw", "sgd"], choices=tr.OPTIMIZERS)
    args = ap.parse_args(argv)

    nearest, sr = ht.ProductConfig(), ht.ProductConfig(rounding="stochastic")
    variants = [
        ("nearest", "hbfp16", ht.RECIPES["nearest"]),
        ("nearest, fp32 master weights", "fp32", ht.RECIPES["nearest"]),
        ("stochastic grad_input only", "hbfp16", ht.Recipe("sr-grad-input", nearest, sr, nearest)),
        ("stochastic grad_weight only", "hbfp16", ht.Recipe("sr-grad-weight", nearest, nearest, sr)),
        ("default: stochastic gradients", "hbfp16", ht.RECIPES["default"]),
    ]
    print("charlm (hbfp.train): validation loss in nats per character after "
          f"{args.epochs} x {tr.LM_STEPS_PER_EPOCH} batches of {args.batch}; seed 0")
    print(f"{'optimizer':>9}  {'run':<32} {'val loss':>9} {'vs FP32':>8} {'seconds':>8}")
    for optimizer in args.optimizers:
        t0 = time.perf_counter()
        fp32 = tr.train("charlm", "fp32", epochs=args.epochs, optimizer=optimizer, progress=False,
                        batch_size=args.batch)
        print(f"{optimizer:>9}  {'FP32':<32} {fp32.val_loss:>9.4f} {'':>8} {time.perf_counter() - t0:>8.1f}", flush=True)
        for name, storage, recipe in variants:
            t0 = time.perf_counter()
            r = tr.train("charlm", "hbfp8", device=host.open("emu"), epochs=args.epochs, optimizer=optimizer,
                         progress=False, recipe=recipe, weight_storage=storage, batch_size=args.batch)
            gap = 100 * (r.val_loss - fp32.val_loss) / fp32.val_loss
            print(f"{optimizer:>9}  {name:<32} {r.val_loss:>9.4f} {gap:>+7.1f}% {time.perf_counter() - t0:>8.1f}",
                  flush=True)
    shares = _zeroed_shares()
    print("\noutput layer's weight-gradient entries that HBFP8 zeroes where FP32's are not (one batch, after 300 FP32 "
          f"AdamW steps): nearest {100 * shares['nearest']:.1f}%, default (stochastic) {100 * shares['default']:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
