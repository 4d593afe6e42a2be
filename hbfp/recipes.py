"""How each product of a training step is computed: a ``Recipe`` holds one ``ProductConfig``
per product (the forward one, ``grad_input`` = grad @ W^T, ``grad_weight`` = X^T @ grad) and
a seed for the stochastic roundings; ``offload`` and ``convert`` take one (a name of
``RECIPES`` or a ``Recipe``).

The default recipe rounds the forward operands to nearest (even) and the output gradients of
both backward products stochastically. Rounded to nearest, a gradient tile flushes every entry
below half a quantum of its largest one to zero: the output gradient of a classifier over many
classes (softmax minus one-hot) loses most of its small positive entries, a bias of the same
sign every step that AdamW turns into steps of full size (docs/torch.md, "Fidelity").
Stochastic rounding keeps every entry's expectation.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field

__all__ = ["ProductConfig", "Recipe", "RECIPES", "DEFAULT_RECIPE", "resolve", "RecipeInUse"]

ROUNDINGS = ("nearest_even", "toward_zero", "stochastic")
OUTPUTS = ("fp32", "bf16")


@dataclass(frozen=True)
class ProductConfig:
    """One product: ``format`` (a name of ``hbfp.contract.FORMATS``; None: the device's),
    ``rounding`` of its operands that are quantized for it (the forward's operands; a backward
    product's output gradient: the other operand is the forward's, as quantized there), and
    ``out``, the device's result format ("fp32", or "bf16": rounded to nearest even)."""

    format: str | None = None
    rounding: str = "nearest_even"
    out: str = "fp32"

    def __post_init__(self):
        from hbfp.contract import FORMATS

        if self.format is not None and self.format not in FORMATS:
            raise ValueError(f"format must be one of {', '.join(FORMATS)} or None (the device's), got {self.format!r}")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {self.rounding!r}")
        if self.out not in OUTPUTS:
            raise ValueError(f"out must be one of {OUTPUTS}, got {self.out!r}")


_NEAREST = ProductConfig()
_STOCHASTIC = ProductConfig(rounding="stochastic")


@dataclass(frozen=True)
class Recipe:
    """``forward``, ``grad_input`` and ``grad_weight`` products' configurations and the
    ``seed`` of their stochastic roundings (each product draws the next seed of its run)."""

    name: str
    forward: ProductConfig = _NEAREST
    grad_input: ProductConfig = _STOCHASTIC
    grad_weight: ProductConfig = _STOCHASTIC
    seed: int = 0

    @property
    def products(self) -> dict[str, ProductConfig]:
        return {"forward": self.forward, "grad_input": self.grad_input, "grad_weight": self.grad_weight}

    def formats(self) -> set[str]:
        """The formats the recipe names (empty: the device's throughout)."""
        return {c.format for c in self.products.values() if c.format is not None}

    def check(self, device) -> None:
        """Every named format must be the device's (a device computes in one format)."""
        have = format_name(device.format())
        for role, cfg in self.products.items():
            if cfg.format is not None and cfg.format != have:
                raise ValueError(f"recipe {self.name!r} runs its {role} products in {cfg.format}, but the device "
                                 f"computes in {have}: open a device of that format (e.g. emu:format={cfg.format})")

    def with_seed(self, seed: int) -> "Recipe":
        from dataclasses import replace

        return replace(self, seed=int(seed))


def _named(name, fmt, gradients):
    cfg = ProductConfig(format=fmt)
    grad = ProductConfig(format=fmt, rounding=gradients)
    return Recipe(name, cfg, grad, grad)


#: Named recipes. "default": the device's format, forward to nearest, gradients stochastic;
#: "nearest": every operand to nearest (the device's own default rounding).
RECIPES: dict[str, Recipe] = {r.name: r for r in (
    _named("default", None, "stochastic"),
    _named("nearest", None, "nearest_even"),
    _named("hbfp8", "HBFP8", "stochastic"),
    _named("hbfp8-nearest", "HBFP8", "nearest_even"),
    _named("mxint8", "MXINT8", "stochastic"),
    _named("mxint8-nearest", "MXINT8", "nearest_even"),
    _named("hbfp16", "HBFP16", "nearest_even"),
)}
DEFAULT_RECIPE = "default"


def resolve(recipe) -> Recipe:
    """A ``Recipe`` from a name of ``RECIPES``, a ``Recipe`` or None (the default)."""
    if recipe is None:
        return RECIPES[DEFAULT_RECIPE]
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, str) and recipe in RECIPES:
        return RECIPES[recipe]
    raise ValueError(f"recipe must be a hbfp.torch.Recipe or one of {', '.join(RECIPES)}, got {recipe!r}")


def format_name(fmt) -> str:
    """The contract's name of a format ("HBFP8"), or its parameters."""
    from hbfp.contract import FORMATS

    for name, f in FORMATS.items():
        if (f.mantissa_bits, f.tile) == (fmt.mantissa_bits, fmt.tile):
            return name
    return f"BFP{fmt.mantissa_bits} {fmt.tile[0]}x{fmt.tile[1]}"


#: How many ``offload`` contexts have read each weight's memory (its storage, weakly): where a
#: context's stream of seeds starts (``RecipeInUse.continuing``).
_CONTEXTS_OF_WEIGHT = None


def _contexts_of_weight():
    global _CONTEXTS_OF_WEIGHT
    if _CONTEXTS_OF_WEIGHT is None:
        from torch.utils.weak import WeakIdKeyDictionary

        _CONTEXTS_OF_WEIGHT = WeakIdKeyDictionary()
    return _CONTEXTS_OF_WEIGHT


def _weight_of(x):
    """The weight ``x`` is or is a view of (a leaf tensor that requires grad), else None."""
    base = getattr(x, "_base", None)
    w = base if base is not None else x
    return w if getattr(w, "requires_grad", False) and w.is_leaf else None


def stream_seed(seed: int, n: int, generation: int = 0) -> int:
    """The seed of the ``n``-th stochastic rounding (from 1) of a stream started from a recipe's
    ``seed``, in a model's ``generation``-th context (``RecipeInUse.continuing``)."""
    return (seed * 0x9E3779B1 + n * 0x85EBCA77 + generation * 0xC2B2AE3D) & 0xFFFFFFFF


@dataclass
class RecipeInUse:
    """A recipe in use: its products' configurations and the stream of seeds of its stochastic
    roundings (one per quantization, in the order they happen: the same run gives the same
    seeds).

    ``continuing`` (``offload``'s, unless it is given a seed): the stream goes on where the
    model's last context left it, so that a loop entering a context per step does not round
    every step with the same seeds. A model is known by its weights' memory: the stream's
    generation, fixed at its first stochastic rounding, is the most contexts any weight read so
    far has been read in before (``note``); on exit (``finish``) each weight the context read
    counts one context more. So two copies of a model (a compiled one beside the eager one)
    start alike whatever else ran on the device, and generation 0, a model's first context,
    gives the seeds of a fresh stream."""

    recipe: Recipe
    continuing: bool = False
    _count: itertools.count = field(default_factory=lambda: itertools.count(1), repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _generation: int | None = field(default=None, repr=False)
    _most: int = field(default=0, repr=False)  # the most contexts of a weight noted so far
    _noted: object = field(default=None, repr=False)  # the storages of the weights read (weak keys)

    def note(self, *operands) -> None:
        """Operands of a product about to be quantized: the weights among them (leaf tensors
        that require grad, or views of them)."""
        if self.continuing:
            self.note_weights(*(w for w in map(_weight_of, operands) if w is not None))

    def note_weights(self, *weights) -> None:
        """Weights a product reads (a compiled graph's, known when it was traced)."""
        if not self.continuing:
            return
        counts = _contexts_of_weight()
        with self._lock:
            if self._noted is None:
                from torch.utils.weak import WeakIdKeyDictionary

                self._noted = WeakIdKeyDictionary()
            for w in weights:
                storage = w.untyped_storage()
                if storage not in self._noted:
                    self._noted[storage] = True
                    self._most = max(self._most, counts.get(storage, 0))

    def finish(self) -> None:
        """The context ends: each weight it read counts one more context."""
        if self._noted is None:
            return
        counts = _contexts_of_weight()
        with self._lock:
            for storage in list(self._noted.keys()):
                counts[storage] = counts.get(storage, 0) + 1
            self._noted = None

    def seed(self, cfg: ProductConfig) -> int | None:
        """The seed of the next quantization under ``cfg`` (None where it rounds to nearest
        or toward zero)."""
        if cfg.rounding != "stochastic":
            return None
        with self._lock:
            n = next(self._count)
            if self._generation is None:
                self._generation = self._most if self.continuing else 0
            g = self._generation
        return stream_seed(self.recipe.seed, n, g)
