r"""The operator figure of the reference README (``fig_readme.png``), redrawn.

For ``k = 2`` and :math:`x(s) = (3, 1, -1 + s, s)`, the left panel plots
:math:`\mathrm{topkmask}(x(s))_2 + \mathrm{topkmask}(x(s))_3` (1-based indices, i.e.
the entries ``1`` and ``-1 + s``) against ``s`` for the hard operator and for
:func:`~implicit_topk.soft_topk_mask` with ``p = 2`` (piecewise linear: kinks) and
``p = 4/3`` (continuously differentiable). Both soft curves are exactly 0 on an interval
of ``s`` (sparsity). The right panel does the same for the top-k in magnitude
(:func:`~implicit_topk.hard_topk_mag` and :func:`~implicit_topk.soft_topk_mag`).

Used by ``implicit-topk figure`` (``python -m implicit_topk figure``).
"""

from __future__ import annotations

import os
import typing

import numpy as np

K = 2
DEFAULT_L = 1.0
DEFAULT_S_RANGE = (-2.0, 6.0)
DEFAULT_PATH = os.path.join("docs", "operator_figure.png")
# (label, p) of the soft curves; p = None is the hard operator.
CURVES = (("hard", None), ("p = 2", 2.0), ("p = 4/3", 4.0 / 3.0))


def inputs(s):
  """The (len(s), 4) batch x(s) = (3, 1, -1 + s, s), float64 if enabled."""
  import jax.numpy as jnp

  s = jnp.asarray(s)
  return jnp.stack([jnp.full_like(s, 3.0), jnp.ones_like(s), s - 1.0, s], axis=-1)


def curves(s, *, l: float = DEFAULT_L, op: str = "mask"):
  """Curve values ``out(x(s))_2 + out(x(s))_3`` for each entry of :data:`CURVES`.

  Args:
    s: 1-D array of abscissae.
    l: regularization strength of the soft operators.
    op: ``"mask"`` (top-k mask) or ``"mag"`` (top-k in magnitude).

  Returns:
    A dict ``label -> numpy array`` (same length as ``s``).
  """
  import jax

  from implicit_topk import hard
  from implicit_topk import magnitude
  from implicit_topk import ops

  if op not in ("mask", "mag"):
    raise ValueError(f"op must be 'mask' or 'mag', got {op!r}")
  x = inputs(s)
  out = {}
  for label, p in CURVES:
    if p is None:
      y = hard.hard_topk_mask(x, K) if op == "mask" else hard.hard_topk_mag(x, K)
    elif op == "mask":
      y = typing.cast(jax.Array, ops.soft_topk_mask(x, K, regularization_strength=l, p=p))
    else:
      y = typing.cast(jax.Array, magnitude.soft_topk_mag(x, K, regularization_strength=l, p=p))
    out[label] = np.asarray(y[:, 1] + y[:, 2], np.float64)
  return out


def make_figure(path: str = DEFAULT_PATH, *, l: float = DEFAULT_L, num: int = 801,
                s_range=DEFAULT_S_RANGE, dpi: int = 120):
  """Draws both panels and saves them to ``path`` (PNG); returns the curve data.

  Args:
    path: output file; its directory is created if needed.
    l: regularization strength of the soft operators.
    num: number of values of ``s``.
    s_range: ``(s_min, s_max)``.
    dpi: resolution of the PNG.

  Returns:
    ``{"s": array, "mask": {label: array}, "mag": {label: array}}``.
  """
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  s = np.linspace(s_range[0], s_range[1], num)
  data = {"s": s, "mask": curves(s, l=l, op="mask"), "mag": curves(s, l=l, op="mag")}
  styles = {"hard": dict(color="0.3", ls="--", lw=1.5),
            "p = 2": dict(color="tab:blue", lw=2),
            "p = 4/3": dict(color="tab:orange", lw=2)}
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
  titles = {"mask": r"top-k mask: $\mathrm{topkmask}(x(s))_2 + \mathrm{topkmask}(x(s))_3$",
            "mag": r"top-k in magnitude: $\mathrm{topkmag}(x(s))_2 + \mathrm{topkmag}(x(s))_3$"}
  for ax, op in zip(axes, ("mask", "mag")):
    for label, _ in CURVES:
      ax.plot(s, data[op][label], label=label if label == "hard" else f"{label}, l = {l:g}",
              **styles[label])
    ax.axhline(0.0, color="0.8", lw=0.8, zorder=0)
    ax.set_xlabel("s")
    ax.set_title(titles[op], fontsize=9)
    ax.legend(fontsize=8, loc="best")
  fig.suptitle(r"$k = 2$, $x(s) = (3, 1, -1 + s, s)$", fontsize=10)
  fig.tight_layout()
  directory = os.path.dirname(path)
  if directory:
    os.makedirs(directory, exist_ok=True)
  fig.savefig(path, dpi=dpi)
  plt.close(fig)
  return data
