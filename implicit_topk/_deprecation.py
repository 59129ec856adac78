"""Old argument names kept working for one release, with a DeprecationWarning.

Version 0.2.0 gave every operator and loss one name and one default for the
regularization strength, ``regularization_strength=1.0`` (the name fast-soft-sort and
torchsort use); the old ``l=`` keyword still works until 0.3.0. CHANGELOG.md lists every
renamed argument.
"""

from __future__ import annotations

import warnings
from typing import Any

DEFAULT_STRENGTH = 1.0
REMOVED_IN = "0.3.0"


def renamed_argument(new_value: Any, old_value: Any, *, new: str, old: str, function: str,
                     new_default: Any = None, stacklevel: int = 3) -> Any:
  """Returns the value of argument ``new``, or of its deprecated former name ``old``.

  ``old_value`` is None when the caller did not pass ``old``. Passing both (``new``
  other than ``new_default``) is an error; passing ``old`` alone warns with a
  DeprecationWarning that names the replacement, attributed to the public function's
  caller (``stacklevel``: 3 when called from the public function itself).
  """
  if old_value is None:
    return new_value
  if new_value is not new_default and not _equal(new_value, new_default):
    raise TypeError(f"{function}() got both `{new}` and its deprecated former name `{old}`; "
                    f"pass `{new}` only.")
  warnings.warn(f"{function}(): `{old}` is deprecated and will be removed in {REMOVED_IN}; "
                f"use `{new}` instead.", DeprecationWarning, stacklevel=stacklevel)
  return old_value


def strength(regularization_strength: Any, l: Any, function: str) -> Any:
  """``regularization_strength``, or the deprecated ``l=`` if the caller passed it."""
  return renamed_argument(regularization_strength, l, new="regularization_strength", old="l",
                          function=function, new_default=DEFAULT_STRENGTH, stacklevel=4)


def _equal(a: Any, b: Any) -> bool:
  try:
    return bool(a == b)
  except Exception:  # an array or a tracer: not the default
    return False
