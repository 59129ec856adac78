"""Argument checks shared by every public operator.

Each check raises with a message that names the argument and the allowed range.
Checks on values (k, l) run only when the value is concrete (a Python number or a
concrete array); under ``jit`` with a traced value they are skipped, as in jax.numpy.
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.export
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike


def as_float_input(x: ArrayLike, name: str = "x") -> jax.Array:
  """Returns ``x`` as a JAX array with a floating dtype, or raises TypeError."""
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(
        f"`{name}` must have a floating dtype (float16, bfloat16, float32 or "
        f"float64); got {x.dtype}. Cast it first, e.g. {name}.astype(jnp.float32)."
    )
  if x.ndim == 0:
    raise ValueError(f"`{name}` must have at least one dimension; got a scalar.")
  return x


def shown(value: Any) -> str:
  """A value as a user would write it in an error message: NumPy and JAX scalars as
  plain numbers (``2``, not ``np.int64(2)``), small arrays as nested lists, larger ones
  by shape, dtype and first entries; anything else by its ``repr``."""
  if isinstance(value, (str, bytes, bool, numbers.Number)) and not isinstance(value, np.generic):
    return repr(value)
  try:
    array = np.asarray(value)
  except Exception:  # pylint: disable=broad-except
    return repr(value)
  if array.dtype == object:
    return repr(value)
  if array.ndim == 0:
    return repr(array.item())
  if array.size <= 8:
    return repr(array.tolist())
  head = ", ".join(repr(v) for v in array.ravel()[:4].tolist())
  return f"an array of shape {array.shape} and dtype {array.dtype} ({head}, ...)"


def compute_dtype(dtype: Any) -> np.dtype:
  """float32/float64 compute in their own precision; half types in float32."""
  dtype = jnp.dtype(dtype)
  if dtype in (jnp.dtype(jnp.float32), jnp.dtype(jnp.float64)):
    return dtype
  return jnp.dtype(jnp.float32)


def canonicalize_axis(axis: int, ndim: int, name: str = "axis") -> int:
  """Maps a possibly negative ``axis`` into [0, ndim), or raises ValueError."""
  if not isinstance(axis, numbers.Integral) or isinstance(axis, bool):
    raise TypeError(f"`{name}` must be an int; got {shown(axis)} ({type(axis).__name__}).")
  if not -ndim <= axis < ndim:
    raise ValueError(
        f"`{name}`={axis} is out of range for an input with {ndim} dimension(s); "
        f"allowed: {-ndim} <= {name} < {ndim}."
    )
  return int(axis) % ndim


def _concrete(value: Any) -> np.ndarray | None:
  """Returns a NumPy view of ``value`` if it is concrete, else None (a tracer)."""
  if isinstance(value, jax.core.Tracer):
    return None
  try:
    return np.asarray(value)
  except Exception:  # pylint: disable=broad-except
    return None


concrete = _concrete


K_RULE = ("0 <= k <= n: k = n selects the whole row (a mask of ones), k = 0 nothing "
          "(a mask of zeros)")


def check_k(k: ArrayLike, n: int, *, integer: bool = False, allow_zero: bool = True,
            allow_n: bool = True, name: str = "k") -> None:
  """Checks the library's one rule for ``k``, ``0 <= k <= n``, when k is concrete.

  ``k = n`` selects the whole row and ``k = 0`` nothing, for every operator where that
  means something. ``allow_zero=False`` asks for ``k > 0`` (an output that is a
  distribution) and ``allow_n=False`` for ``k < n`` (the peers' methods that need
  it); ``integer`` asks for a Python int (``k`` fixes a static size or a loop length).
  """
  if integer and not (isinstance(k, numbers.Integral) and not isinstance(k, bool)):
    raise TypeError(f"`{name}` must be a Python int here (it fixes a static size); "
                    f"got {shown(k)} ({type(k).__name__}).")
  value = _concrete(k)
  if value is None:
    return
  if not _is_real(value.dtype):
    raise TypeError(f"`{name}` must be a real number; got {shown(k)}.")
  low_ok = value >= 0 if allow_zero else value > 0
  if jax.export.is_symbolic_dim(n):  # a symbolic row length (jax.export): no upper check
    high_ok = np.ones_like(low_ok)
  else:
    high_ok = value <= n if allow_n else value < n
  if not np.all(low_ok & high_ok):
    bound = f"0 {'<=' if allow_zero else '<'} {name} {'<=' if allow_n else '<'} n"
    raise ValueError(f"`{name}` must satisfy {bound} with n={n} (the size of the reduced "
                     f"axis); got {shown(k)}.")


def check_k_per_row(k: ArrayLike, counts: Any, what: str, name: str = "k") -> None:
  """Checks ``k <= counts`` entrywise (``counts``: per-row sizes, e.g. a segment's size or
  a row's number of valid entries) when ``k`` is concrete; ``what`` names the bound."""
  value = _concrete(k)
  if value is None:
    return
  counts = np.asarray(counts)
  try:
    value, counts = np.broadcast_arrays(value, counts)
  except ValueError:
    return  # the shape check reports it
  bad = value > counts
  if np.any(bad):
    index = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ValueError(
        f"`{name}` must satisfy 0 <= {name} <= {what}; at index {index} {name} = "
        f"{shown(value[index])} but the bound is {int(counts[index])}.")


def check_count(value: Any, name: str) -> int:
  """Checks a static count: a Python int >= 1."""
  if not (isinstance(value, numbers.Integral) and not isinstance(value, bool)):
    raise TypeError(f"`{name}` must be a Python int (it fixes a static shape); got {shown(value)} ({type(value).__name__}).")
  if value < 1:
    raise ValueError(f"`{name}` must be >= 1; got {shown(value)}.")
  return int(value)


def _is_real(dtype) -> bool:
  """An integer or real floating dtype, bfloat16 included (NumPy does not count it as a
  number)."""
  return bool(jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating))


def check_positive(value: Any, name: str) -> None:
  """Checks value > 0 (finite) when value is concrete."""
  concrete = _concrete(value)
  if concrete is None:
    return
  if not _is_real(concrete.dtype):
    raise TypeError(f"`{name}` must be a positive real number; got {shown(value)}.")
  if not np.all(np.isfinite(concrete) & (concrete > 0)):
    raise ValueError(f"`{name}` must be finite and > 0; got {shown(value)}.")


def max_strength(dtype: Any) -> float:
  """The largest regularization strength ``l`` a dtype supports: ``1 / tiny`` of its
  compute dtype (2^1022 for float64, 2^126 for float32 and the half types). XLA on CPU
  divides by ``l`` through its reciprocal, and flushes a subnormal reciprocal to 0."""
  return float(1.0 / np.finfo(compute_dtype(dtype)).tiny)


def check_strength(l: Any, dtype: Any, name: str = "regularization_strength") -> None:
  """Checks ``min_strength(dtype) <= l < max_strength(dtype)`` when ``l`` is concrete.

  ``name`` is the argument's public name in the error message (the regularization
  strength ``l`` is ``regularization_strength`` in every public signature).
  """
  check_positive(l, name)
  concrete = _concrete(l)
  lower, upper = min_strength(dtype), max_strength(dtype)
  if concrete is not None:  # (in float64: a float32 l beside a float64 bound would cast it)
    concrete = np.asarray(concrete, np.float64)
  if concrete is not None and not np.all((concrete >= lower) & (concrete < upper)):
    raise ValueError(
        f"`{name}` must satisfy {lower:.4g} <= {name} < {upper:.4g} (both {name} and "
        f"1 / {name} normal {compute_dtype(dtype).name} numbers: XLA reads subnormal numbers "
        f"as 0) for {jnp.dtype(dtype).name} input; got {shown(l)}.")


def strength_in_range(l: jax.Array) -> jax.Array:
  """``min_strength <= l < max_strength`` elementwise, for a traced ``l`` that was not
  checked before the call: an operator makes its rows NaN where this is False."""
  return (l >= min_strength(l.dtype)) & (l < max_strength(l.dtype))


def min_strength(dtype: Any) -> float:
  """The smallest regularization strength ``l`` a dtype supports: the smallest normal
  number of its compute dtype (XLA on CPU and GPU reads a subnormal ``l`` as 0)."""
  return float(np.finfo(compute_dtype(dtype)).tiny)


def check_p(p: Any) -> float:
  """Checks that the p-norm exponent is a static real number > 1."""
  if isinstance(p, jax.core.Tracer):
    raise TypeError("`p` must be a static Python float (it selects the solver kernel); got a tracer.")
  try:
    p = float(p)
  except (TypeError, ValueError):
    raise TypeError(f"`p` must be a real number > 1; got {shown(p)}.") from None
  if not (np.isfinite(p) and p > 1.0):
    raise ValueError(f"`p` must satisfy 1 < p < inf; got {shown(p)}.")
  return p


def check_choice(value: Any, name: str, choices: Any) -> Any:
  if value not in choices:
    raise ValueError(f"`{name}` must be one of {sorted(choices)}; got {shown(value)}.")
  return value


def check_maxiter(maxiter: Any) -> int:
  """Checks an iteration cap: an int >= 1."""
  if not (isinstance(maxiter, numbers.Integral) and not isinstance(maxiter, bool)
          and int(maxiter) >= 1):
    raise ValueError(f"`maxiter` must be an int >= 1; got {shown(maxiter)}.")
  return int(maxiter)


def check_tol(tol: Any) -> float:
  """Checks a tolerance: a finite real >= 0."""
  try:
    value = float(tol)
  except (TypeError, ValueError):
    raise TypeError(f"`tol` must be a real number >= 0; got {shown(tol)}.") from None
  if not (np.isfinite(value) and value >= 0):
    raise ValueError(f"`tol` must be finite and >= 0; got {shown(tol)}.")
  return value


def check_broadcast(value: Any, batch_shape: Any, name: str,
                    what: str = "the input's shape without the reduced axis",
                    target: str = "the batch shape") -> None:
  """Checks that ``value`` broadcasts to ``batch_shape`` (by default the input without
  its axis; ``target`` and ``what`` name the shape in the error)."""
  shape = np.shape(value)
  try:  # jax's rule: it also takes symbolic dimensions (jax.export)
    result = jnp.broadcast_shapes(shape, tuple(batch_shape))
  except ValueError:
    result = None
  if result != tuple(batch_shape):
    raise ValueError(
        f"`{name}` must be a scalar or broadcast to {target} {tuple(batch_shape)} "
        f"({what}); got shape {shape}.")
