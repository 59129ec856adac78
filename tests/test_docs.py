"""The documentation: the Sphinx site builds without warnings, and every docstring
example of the public modules runs (doctest).

Slow group (`python -m pytest -q -m slow`). The site build needs the `docs` extra
(`pip install -e ".[docs]"`: sphinx and myst-parser) and is skipped without it.
"""

from __future__ import annotations

import doctest
import importlib
import inspect
import json
import os
import pkgutil
import re
import subprocess
import sys
import types

import pytest

import implicit_topk

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")


def _public_modules() -> list[str]:
  """The modules that define the names of ``implicit_topk.__all__``.

  A name that is itself a module (``losses``, ``baselines``, ``problems``) brings the
  module, its submodules and the modules defining its own ``__all__``.
  """
  names = {"implicit_topk"}
  for name in implicit_topk.__all__:
    obj = getattr(implicit_topk, name)
    if isinstance(obj, types.ModuleType):
      names.add(obj.__name__)
      if hasattr(obj, "__path__"):
        for info in pkgutil.iter_modules(obj.__path__, obj.__name__ + "."):
          names.add(info.name)
      for member in getattr(obj, "__all__", ()):
        module = getattr(getattr(obj, member), "__module__", None)
        if module and module.startswith("implicit_topk"):
          names.add(module)
    else:
      names.add(obj.__module__)
  return sorted(names)


MODULES = _public_modules()


def _public_function_modules() -> set[str]:
  """Modules defining a public function: one in ``implicit_topk.__all__`` or in the
  ``__all__`` of the public submodules (``losses``, ``baselines``, ``problems``)."""
  objs = [getattr(implicit_topk, name) for name in implicit_topk.__all__]
  for obj in list(objs):
    if isinstance(obj, types.ModuleType):
      objs += [getattr(obj, name) for name in getattr(obj, "__all__", ())]
  return {obj.__module__ for obj in objs if inspect.isfunction(obj)}


# The docstring examples assume JAX's defaults (float32); tests/conftest.py turns on
# float64 in this process, so the examples run in a fresh interpreter, all modules in one.
_DOCTEST_SCRIPT = r"""
import contextlib, doctest, importlib, io, json, sys
results = {}
for name in sys.argv[1:]:
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    r = doctest.testmod(importlib.import_module(name),
                        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  results[name] = {"failed": r.failed, "attempted": r.attempted, "report": buf.getvalue()[-4000:]}
print("DOCTEST-RESULTS " + json.dumps(results))
"""


@pytest.fixture(scope="module")
def doctest_results():
  env = {k: v for k, v in os.environ.items() if k != "JAX_ENABLE_X64"}
  proc = subprocess.run([sys.executable, "-c", _DOCTEST_SCRIPT, *MODULES], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=1800, check=False)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("DOCTEST-RESULTS ")]
  assert lines, proc.stdout[-3000:] + proc.stderr[-3000:]
  return json.loads(lines[-1][len("DOCTEST-RESULTS "):])


# One worker runs every case (pyproject: --dist loadgroup): the fixture runs the doctests
# of all modules in one subprocess, which a second worker would repeat.
@pytest.mark.slow
@pytest.mark.xdist_group("doctest")
@pytest.mark.parametrize("module_name", MODULES)
def test_docstring_examples(module_name, doctest_results):
  result = doctest_results[module_name]
  assert result["failed"] == 0, (
      f"{result['failed']} of {result['attempted']} examples failed in {module_name}:\n"
      + result["report"])
  if module_name in _public_function_modules():
    assert result["attempted"] > 0, f"{module_name} has public functions but no docstring example"


@pytest.mark.slow
def test_sphinx_build_has_no_warnings(tmp_path):
  pytest.importorskip("sphinx")
  pytest.importorskip("myst_parser")
  out = tmp_path / "html"
  proc = subprocess.run(
      [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
       "-d", str(tmp_path / "doctrees"), DOCS, str(out)],
      cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
  assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
  for page in ("index", "api", "examples", "comparison", "scaling", "guides/choosing",
               "guides/implicit_vs_unrolled", "guides/routing", "guides/pruning"):
    assert (out / f"{page}.html").exists(), page
  api = (out / "api.html").read_text()
  for name in implicit_topk.__all__:
    assert name in api, f"{name} is missing from the API reference"


def _python_blocks(path: str) -> list[str]:
  with open(path, encoding="utf-8") as f:
    return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


@pytest.mark.slow
def test_routing_recipe_equinox_runs():
  """The Equinox router recipe of docs/guides/routing.md trains (loss decreases)."""
  pytest.importorskip("equinox")
  pytest.importorskip("optax")
  blocks = [b for b in _python_blocks(os.path.join(DOCS, "guides", "routing.md"))
            if "import equinox" in b]
  assert len(blocks) == 1
  code = blocks[0].replace("for step in range(100):", "losses = []\nfor step in range(100):")
  code += "  losses.append(float(loss))\n"
  namespace: dict = {}
  exec(compile(code, "routing.md (Equinox)", "exec"), namespace)  # pylint: disable=exec-used
  losses = namespace["losses"]
  assert losses[-1] < losses[0]


@pytest.mark.slow
def test_quick_start_values():
  """The values printed in the quick start of docs/index.md."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  itk = implicit_topk
  x = jnp.array([-5., -2., 3., 1.])
  np.testing.assert_allclose(itk.soft_topk_mask(x, k=2, regularization_strength=1e-2), [0, 0, 1, 1])
  np.testing.assert_allclose(itk.soft_topk_mask(x, k=2, regularization_strength=5.0),
                             [0, 0.0554, 1, 0.9446], atol=1e-4)
  np.testing.assert_allclose(itk.soft_topk_mask(x, k=1.5, p=2.0), [0, 0, 1, 0.5], atol=1e-6)
  f = lambda x: itk.soft_topk_mask(x, k=2, regularization_strength=5.0)
  np.testing.assert_allclose(jax.grad(lambda x: f(x)[3])(x), [0, -0.0757, 0, 0.0757], atol=1e-4)
  np.testing.assert_allclose(jax.jvp(f, (x,), (jnp.array([0., 1., 0., 0.]),))[1],
                             [0, 0.0757, 0, -0.0757], atol=1e-4)
  np.testing.assert_allclose(itk.soft_topk_mag(x, k=2, regularization_strength=1e-2), [-5, 0, 3, 0])
  np.testing.assert_allclose(itk.soft_rank(jnp.array([5., 1., 2.]), regularization_strength=1.0),
                             [3, 1, 2], atol=1e-5)
  np.testing.assert_allclose(itk.soft_sort(jnp.array([5., 1., 2.]), regularization_strength=1.0),
                             [5 / 3, 8 / 3, 11 / 3], atol=1e-5)
