"""Old argument names kept working for one release, with a DeprecationWarning.

Version 0.2.0 gave every operator and loss one name and one default for the
regularization strength, ``regularization_strength=1.0`` (the name fast-soft-sort and
torchsort use); the old ``l=`` keyword still works until 0.3.0. CHANGELOG.md lists every
renamed argument.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep

DEFAULT_STRENGTH = 1.0
REMOVED_IN = "0.3.0"


def warn(message: str) -> None:
  """A DeprecationWarning attributed to the first caller outside this package (the user's
  line), however many of the package's frames (decorators, helpers) lie in between."""
  frame: Any = sys._getframe(1)  # the caller of warn(): stacklevel 2
  level = 2
  while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR):
    frame, level = frame.f_back, level + 1
  warnings.warn(message, DeprecationWarning, stacklevel=level)


def renamed_argument(new_value: Any, old_value: Any, *, new: str, old: str, function: str,
                     new_default: Any = None) -> Any:
  """Returns the value of argument ``new``, or of its deprecated former name ``old``.

  ``old_value`` is None when the caller did not pass ``old``. Passing both (``new``
  other than ``new_default``) is an error; passing ``old`` alone warns with a
  DeprecationWarning that names the replacement, attributed to the public function's
  caller (:func:`warn`).
  """
  if old_value is None:
    return new_value
  if new_value is not new_default and not _equal(new_value, new_default):
    raise TypeError(f"{function}() got both `{new}` and its deprecated former name `{old}`; "
                    f"pass `{new}` only.")
  warn(f"{function}(): `{old}` is deprecated and will be removed in {REMOVED_IN}; "
       f"use `{new}` instead.")
  return old_value


def strength(regularization_strength: Any, l: Any, function: str) -> Any:
  """``regularization_strength``, or the deprecated ``l=`` if the caller passed it."""
  return renamed_argument(regularization_strength, l, new="regularization_strength", old="l",
                          function=function, new_default=DEFAULT_STRENGTH)


def _equal(a: Any, b: Any) -> bool:
  try:
    return bool(a == b)
  except Exception:  # an array or a tracer: not the default
    return False
