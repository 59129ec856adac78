"""Importing the package: no jaxopt (it is unmaintained and warns on import) until the
``implicit_diff_backend="jaxopt"`` route is asked for; that route still works."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import implicit_topk as itk

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_IMPORT_SCRIPT = textwrap.dedent("""
    import sys
    assert "jaxopt" not in sys.modules, "jaxopt imported before implicit_topk"
    import implicit_topk
    assert implicit_topk.soft_topk_mask is not None
    assert "jaxopt" not in sys.modules, sorted(m for m in sys.modules if "jaxopt" in m)
    print("IMPORT OK")
""")


def _run_python(*args):
  env = dict(os.environ)
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  env.pop("PYTHONWARNINGS", None)
  return subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True,
                        text=True, timeout=300)


def test_import_emits_no_deprecation_warning_and_skips_jaxopt():
  proc = _run_python("-W", "error::DeprecationWarning", "-c", _IMPORT_SCRIPT)
  assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-5000:]}"
  assert "IMPORT OK" in proc.stdout, proc.stdout


@pytest.mark.slow
def test_the_check_above_can_fail():
  """The subprocess check sees a DeprecationWarning raised at import (jaxopt's own)."""
  proc = _run_python("-W", "error::DeprecationWarning", "-c", "import jaxopt")
  assert proc.returncode != 0 and "DeprecationWarning" in proc.stderr, proc.stderr[-2000:]


# the backend imports jaxopt, which warns that it is unmaintained (expected here)
@pytest.mark.filterwarnings("ignore:JAXopt is no longer maintained:DeprecationWarning")
@pytest.mark.parametrize("solver", ("threshold", pytest.param("pav", marks=pytest.mark.slow)))
def test_jaxopt_backend_gradient_equals_lax(solver):
  """The lazily imported jaxopt backend gives the lax backend's gradients (float64)."""
  assert jax.config.jax_enable_x64  # conftest.py
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(3, 9)))
  w = jnp.asarray(rng.normal(size=(3, 9)))
  k = jnp.array([1.5, 3.5, 7.0])

  def loss(backend):
    def f(x, k, l):
      y = itk.soft_topk_mask(x, k, regularization_strength=l, solver=solver, implicit_diff_backend=backend)
      return jnp.sum(w * y)
    return jax.grad(f, argnums=(0, 1, 2))

  # one jit for both backends (compiling the solver dominates the runtime)
  grads = jax.jit(lambda x, k, l: {b: loss(b)(x, k, l) for b in ("lax", "jaxopt")})(x, k, 0.6)
  chex.assert_type(jax.tree.leaves(grads), jnp.float64)
  chex.assert_shape([grads["jaxopt"][0], grads["jaxopt"][1], grads["jaxopt"][2]],
                    [(3, 9), (3,), ()])
  chex.assert_trees_all_close(grads["jaxopt"], grads["lax"], rtol=0, atol=1e-10)
  assert np.abs(np.asarray(grads["lax"][0])).max() > 1e-2  # not vacuous
  assert "jaxopt" in sys.modules  # the backend did import it
