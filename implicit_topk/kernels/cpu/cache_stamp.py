"""numba's disk cache kept in step with what each kernel module compiles in.

numba keys a cached function on the one source file that defines it (its modification
time and size). A handler of ``native_mask.py`` has the row solver of
``native_threshold.py`` compiled into it, so after an edit of ``native_threshold.py``
alone numba would load the old machine code. :func:`refresh` records, per kernel module
of this package, a hash of the sources of the package modules it imports (directly or
through others), in ``kernel_dependencies.json`` beside numba's files; where that hash
changed, it deletes the module's cache files, and numba compiles it again on first use.

Sources change only in a checkout (an editable install); an installed wheel's files
never do, and there :func:`refresh` finds every hash unchanged. It runs once per process,
before the first handler is built (:func:`implicit_topk.kernels.cpu.registry.ensure`).
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import pathlib
import threading
from typing import Any

_HERE = pathlib.Path(__file__).resolve().parent
_PACKAGE = "implicit_topk.kernels.cpu"
_STAMP_FILE = "kernel_dependencies.json"
_LOCK = threading.Lock()
_DONE = False
#: :func:`package_imports`' name for "the package as a whole" (``import
#: implicit_topk.kernels.cpu as k``, a ``*`` import): every module may be reached.
EVERY = "*"


def package_imports(source: str) -> set[str]:
  """The names ``source`` imports from this package, in every import form (modules, or
  names imported from the package itself; the caller keeps those that are modules):
  ``import pkg.a [as c]``, ``from pkg import a [as c]``, ``from pkg.a[.b] import f [as
  g]``, the relative ``from . import a [as c]`` and ``from .a import f [as g]``, inside
  functions too; :data:`EVERY` where the package itself is bound to a name (its
  attributes can reach any module). Source that does not parse: :data:`EVERY`."""
  try:
    tree = ast.parse(source)
  except (SyntaxError, ValueError):
    return {EVERY}
  names = set()

  def within(module: str) -> str | None:
    """``module`` relative to the package: "" for the package itself, the first
    component below it, or None outside it."""
    if module == _PACKAGE:
      return ""
    return module[len(_PACKAGE) + 1:].split(".")[0] if module.startswith(_PACKAGE + ".") else None

  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        below = within(alias.name)
        if below is not None:
          names.add(below or EVERY)
        elif _PACKAGE.startswith(alias.name + "."):  # import implicit_topk [as t]: its attributes
          names.add(EVERY)
    elif isinstance(node, ast.ImportFrom):
      if node.level:  # relative: this package's directory (level 1) or above it
        below = (node.module or "").split(".")[0] if node.level == 1 else None
        if node.level > 1:
          names.add(EVERY)
      else:
        below = within(node.module or "")
        if below is None and _PACKAGE.startswith((node.module or "") + "."):
          # from implicit_topk.kernels import cpu [as c]
          names.update(EVERY for alias in node.names
                       if _PACKAGE == f"{node.module}.{alias.name}" or alias.name == "*")
      if below:
        names.add(below)
      elif below == "":
        names.update(EVERY if alias.name == "*" else alias.name for alias in node.names)
  return names


def dependency_hashes(directory: pathlib.Path = _HERE) -> dict[str, str]:
  """Per module of ``directory``: a hash of the sources of the modules it imports from
  this package, transitively (its own source is numba's stamp already)."""
  sources = {p.stem: p.read_text(encoding="utf-8") for p in sorted(directory.glob("*.py"))}
  direct = {}
  for name, text in sources.items():
    imported = package_imports(text)
    direct[name] = set(sources) if EVERY in imported else imported & sources.keys()
  hashes = {}
  for name in sources:
    seen, todo = set(), list(direct[name])
    while todo:
      dep = todo.pop()
      if dep not in seen and dep != name:
        seen.add(dep)
        todo.extend(direct[dep])
    digest = hashlib.sha256()
    for dep in sorted(seen):
      digest.update(dep.encode() + b"\0" + sources[dep].encode() + b"\0")
    hashes[name] = digest.hexdigest()[:16]
  return hashes


def _cache_directory(directory: pathlib.Path) -> pathlib.Path | None:
  """Where numba caches the functions of ``directory``'s modules (its own locators, in
  its order: ``NUMBA_CACHE_DIR``, the in-tree ``__pycache__``, the user-wide cache)."""
  try:
    from numba.core import caching
  except ImportError:
    return None
  def probe():  # numba's locators read a function's first line number only
    pass
  source = str(directory / "registry.py")
  locator_classes: list[Any] = list(caching.CacheImpl._locator_classes)  # pylint: disable=protected-access
  for locator_class in locator_classes:
    try:
      locator = locator_class.from_function(probe, source)
    except Exception:  # pylint: disable=broad-except
      continue
    if locator is not None:
      return pathlib.Path(locator.get_cache_path())
  return None


def stale_modules(old: dict[str, str], new: dict[str, str]) -> set[str]:
  """The modules whose dependencies changed (all of them when nothing was recorded)."""
  return {name for name, digest in new.items() if old.get(name) != digest}


def refresh(directory: pathlib.Path = _HERE, cache: pathlib.Path | None = None) -> set[str]:
  """Deletes the numba cache files of the kernel modules whose dependencies changed
  since the last call, records the new hashes, and returns those modules' names. Once
  per process for the package itself; best effort (an unwritable cache is left alone)."""
  global _DONE
  own = directory == _HERE and cache is None
  with _LOCK:
    if own and _DONE:
      return set()
    _DONE = _DONE or own
    cache = _cache_directory(directory) if cache is None else cache
    if cache is None or not cache.is_dir():
      return set()
    stamp = cache / _STAMP_FILE
    try:
      old = json.loads(stamp.read_text(encoding="utf-8"))
    except (OSError, ValueError):
      old = {}
    new = dependency_hashes(directory)
    stale = stale_modules(old, new)
    try:
      for path in cache.iterdir():
        if path.suffix in (".nbi", ".nbc") and path.name.split(".", 1)[0] in stale:
          path.unlink(missing_ok=True)
      temporary = stamp.with_suffix(f".{os.getpid()}.tmp")
      temporary.write_text(json.dumps(new, indent=1, sort_keys=True), encoding="utf-8")
      os.replace(temporary, stamp)
    except OSError:
      return set()
    return stale
