"""tests/gradcheck.py, the first-derivative check most derivative tests use: it passes
on correct derivatives (arrays, scalars, pytrees, several arguments) and fails on a
derivative 0.1% off in either mode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gradcheck import check_grads

X = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5)))


def test_correct_derivatives_pass():
  check_grads(lambda x: jnp.sin(x) * x[..., :1], (X,), eps=1e-6, atol=1e-8, rtol=1e-8)
  check_grads(lambda a, x: {"y": a * jnp.tanh(x), "s": jnp.sum(x) ** 2}, (0.7, X))
  check_grads(lambda tree: tree["a"] @ tree["b"].T, ({"a": X, "b": 2.0 * X},), modes=("rev",))


def _off_by(factor, mode):
  """sum(sin(x)) with its derivative in ``mode`` multiplied by ``factor``."""
  if mode == "rev":
    f = jax.custom_vjp(lambda x: jnp.sum(jnp.sin(x)))
    f.defvjp(lambda x: (jnp.sum(jnp.sin(x)), x), lambda x, g: (g * jnp.cos(x) * factor,))
  else:
    f = jax.custom_jvp(lambda x: jnp.sum(jnp.sin(x)))
    f.defjvp(lambda p, t: (jnp.sum(jnp.sin(p[0])), jnp.sum(jnp.cos(p[0]) * t[0]) * factor))
  return f


@pytest.mark.parametrize("mode", ["fwd", "rev"])
def test_a_derivative_off_by_a_thousandth_fails(mode):
  check_grads(_off_by(1.0, mode), (X,), modes=(mode,), eps=1e-6, atol=1e-6, rtol=1e-6)
  with pytest.raises(AssertionError):
    check_grads(_off_by(1.001, mode), (X,), modes=(mode,), eps=1e-6, atol=1e-6, rtol=1e-6)
