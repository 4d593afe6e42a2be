"""What the products of ``hbfp.torch`` follow on this thread: the matmul precision and the
recipe in use.

- ``set_matmul_precision("highest" | "hbfp8" | ...)``, modelled on
  ``torch.set_float32_matmul_precision``: ``offload`` sets its device's format's name
  (``"hbfp8"``, ``"mxint8"``) while it is active and restores the previous value on exit,
  exceptions included.
- The recipe in use (``use_recipe``, ``current_recipe``; ``hbfp.recipes``): per product
  (forward, grad_input, grad_weight) the format, the rounding and the output format, with the
  stream of seeds its stochastic roundings draw (``recipe_in_use``).
"""

from __future__ import annotations

import contextlib
import threading

from hbfp.recipes import Recipe, RecipeInUse
from hbfp.recipes import resolve as _resolve_recipe

__all__ = ["PRECISIONS", "set_matmul_precision", "get_matmul_precision", "matmul_precision", "use_recipe",
           "current_recipe", "recipe_in_use"]


#: "highest": fp32 products by PyTorch; a format's name in lower case ("hbfp8", "mxint8",
#: "hbfp16"): products on the hbfp device, in that format (``offload`` sets its device's).
PRECISIONS = ("highest", "hbfp8", "hbfp16", "mxint8")

#: This thread's: ``precision``, ``in_use`` (the recipe in use) and ``on_device`` (inside the
#: device's own work: ``hbfp.torch.device._device_work``).
_state = threading.local()


def set_matmul_precision(precision: str) -> None:
    if precision not in PRECISIONS and not precision.startswith("bfp"):
        raise ValueError(f"matmul precision must be one of {PRECISIONS}, got {precision!r}")
    _state.precision = precision


def get_matmul_precision() -> str:
    return getattr(_state, "precision", "highest")


@contextlib.contextmanager
def matmul_precision(precision: str):
    """``set_matmul_precision`` for the body of a ``with`` block, restored on exit (exceptions
    included)."""
    previous = get_matmul_precision()
    set_matmul_precision(precision)
    try:
        yield
    finally:
        set_matmul_precision(previous)


def recipe_in_use() -> RecipeInUse:
    """The recipe in use on this thread (``offload``, ``use_recipe``; else the default's
    stream of seeds)."""
    r = getattr(_state, "in_use", None)
    return r if r is not None else _DEFAULT_IN_USE


def current_recipe() -> Recipe:
    return recipe_in_use().recipe


_DEFAULT_IN_USE = RecipeInUse(_resolve_recipe(None))


@contextlib.contextmanager
def _using(in_use: RecipeInUse | None):
    """``in_use`` is this thread's recipe in use in the body (None: unchanged)."""
    if in_use is None:
        yield
        return
    previous = getattr(_state, "in_use", None)
    _state.in_use = in_use
    try:
        yield
    finally:
        _state.in_use = previous


@contextlib.contextmanager
def use_recipe(recipe=None, seed: int | None = None):
    """Products issued in the body follow ``recipe`` (a name of ``RECIPES`` or a ``Recipe``;
    ``seed`` replaces its seed), with a fresh stream of seeds; restored on exit."""
    r = _resolve_recipe(recipe)
    with _using(RecipeInUse(r if seed is None else r.with_seed(seed))):
        yield current_recipe()


def _routing_active() -> bool:
    """Whether ``offload``'s routes take products now: a precision other than 'highest', and
    not the device's own work."""
    return get_matmul_precision() != "highest" and not getattr(_state, "on_device", False)
