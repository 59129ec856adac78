"""Start-up and export: ``import implicit_topk`` compiles nothing, the CPU kernels are built
on first use (one target per family, dtype and entry rule), an exported function finds
its kernels through ``register_kernels(exported)``, symbolic shapes export, a missing
numba gives a clear error, and the package's modules import one another without a
circle."""

from __future__ import annotations

import ast
import logging
import os
import subprocess
import sys
import textwrap
import time

import jax
from jax import export
import jax.numpy as jnp
import numpy as np
import pytest

import implicit_topk as itk
from implicit_topk.kernels.cpu import registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLOW = pytest.mark.slow
PACKAGE = os.path.join(ROOT, "implicit_topk")


def _python(script: str, *args: str) -> str:
  env = {k: v for k, v in os.environ.items() if k != "JAX_ENABLE_X64"}
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  done = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], env=env,
                        cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-4000:]
  return done.stdout


def test_import_compiles_and_registers_nothing():
  out = _python("""
      import sys
      import implicit_topk
      from implicit_topk.kernels.cpu import registry
      assert "numba" not in sys.modules, "import implicit_topk imported numba"
      assert registry.registered_targets() == (), registry.registered_targets()
      print("clean")
  """)
  assert out.strip() == "clean"


def _module_imports(path: str) -> set[str]:
  """The implicit_topk modules that ``path`` imports at module level (not inside
  functions: those run at call time, after every module is loaded)."""
  tree = ast.parse(open(path).read())
  found = set()
  for node in tree.body:
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("implicit_topk"):
      found.add(node.module)
      found.update(f"{node.module}.{a.name}" for a in node.names)
    elif isinstance(node, ast.Import):
      found.update(a.name for a in node.names if a.name.startswith("implicit_topk"))
  return found


def _module_graph() -> dict[str, set[str]]:
  modules = {}
  for folder, _, files in os.walk(PACKAGE):
    for name in files:
      if name.endswith(".py"):
        path = os.path.join(folder, name)
        dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
        modules[dotted.removesuffix(".__init__")] = path
  return {m: {d for d in _module_imports(p) if d in modules and d != m}
          for m, p in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
  state: dict[str, int] = {}
  stack: list[str] = []

  def visit(node):
    state[node] = 1
    stack.append(node)
    for nxt in sorted(graph[node]):
      if state.get(nxt) == 1:
        return stack[stack.index(nxt):] + [nxt]
      if nxt not in state:
        found = visit(nxt)
        if found:
          return found
    stack.pop()
    state[node] = 2
    return None

  for node in sorted(graph):
    if node not in state:
      found = visit(node)
      if found:
        return found
  return None


def test_no_import_circle_between_the_package_modules():
  # A package's __init__ importing its submodules is not a circle; the edges from a
  # submodule back to its own package are (they are how circles used to form).
  graph = _module_graph()
  for module, deps in graph.items():
    graph[module] = {d for d in deps if not module.startswith(d + ".")}
  assert _cycle(graph) is None, _cycle(graph)


def test_the_circle_check_finds_a_circle():
  assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_kernel_modules_are_in_their_rooms():
  kernels = os.path.join(PACKAGE, "kernels")
  assert sorted(d for d in os.listdir(kernels) if os.path.isdir(os.path.join(kernels, d))
                and not d.startswith("__")) == ["cpu", "gpu"]
  for name in os.listdir(os.path.join(kernels, "gpu")):
    if name.endswith(".py"):
      assert "numba" not in open(os.path.join(kernels, "gpu", name)).read(), name


def test_every_target_names_a_function_of_its_module():
  import importlib
  for family, (solver, module, entry) in registry.FAMILIES.items():
    assert solver in ("native", "pav"), family
    for suffix in ("f32", "f64"):
      assert callable(getattr(importlib.import_module(f"implicit_topk.kernels.cpu.{module}"),
                              entry.format(suffix))), (family, suffix)
  names = registry.all_targets()
  assert len(names) == len(set(names)) == 2 * len(registry.FAMILIES)
  checked = {c.is_custom_call() for c in itk.export_safety_checks()}
  assert set(names) <= checked


def test_a_slow_build_is_announced_once_and_a_failed_one_names_the_way_out(monkeypatch, caplog):
  monkeypatch.setattr(registry, "SLOW_COMPILE_SECONDS", 0.05)
  with caplog.at_level(logging.INFO, logger="implicit_topk"):
    assert registry.build_announced("implicit_topk_x_float32", "native",
                                    lambda: time.sleep(0.3) or "handler") == "handler"
  messages = [r.getMessage() for r in caplog.records]
  assert sum("compiling the CPU kernel implicit_topk_x_float32" in m for m in messages) == 1
  assert any("compiled in" in m for m in messages)
  caplog.clear()
  with caplog.at_level(logging.INFO, logger="implicit_topk"):
    registry.build_announced("implicit_topk_y_float32", "pav", lambda: "fast")
  assert not any("compiling" in r.getMessage() for r in caplog.records)  # under the bar

  def broken():
    raise ImportError("No module named 'numba'")

  with pytest.raises(RuntimeError, match=r"solver='pav'.*solver='threshold'"):
    registry.build_announced("implicit_topk_z_float32", "pav", broken)


def test_unknown_targets_are_refused_by_name():
  with pytest.raises(ValueError, match="not a target of implicit_topk"):
    registry.ensure("implicit_topk_nothing_float32")


def test_without_numba_the_default_is_pure_jax_and_the_native_solver_says_what_to_use():
  out = _python("""
      import sys
      sys.modules["numba"] = None  # as if numba were not installed
      import jax.numpy as jnp, numpy as np
      import implicit_topk as itk
      x = jnp.array([[3.0, 1.0, 2.0, -1.0]])
      y = itk.soft_topk_mask(x, 2.0, regularization_strength=2.0, p=2.0)  # auto: threshold
      np.testing.assert_allclose(np.asarray(y), [[1.0, 0.25, 0.75, 0.0]], rtol=1e-6)
      try:
        itk.soft_topk_mask(x, 2.0, solver="native")
      except RuntimeError as error:
        print(error)
  """)
  assert "solver='native'" in out and "solver='threshold'" in out, out


_EXPORT_AND_CALL = """
    import sys
    import numpy as np
    import jax, jax.numpy as jnp
    from jax import export
    import implicit_topk as itk
    from implicit_topk.kernels.cpu import registry
    exported = export.deserialize(bytearray(open(sys.argv[1], "rb").read()))
    assert registry.registered_targets() == ()
    itk.register_kernels(exported)
    assert set(registry.registered_targets()) == set(registry.targets_called_by(exported))
    print(" ".join(registry.registered_targets()))
    x = jnp.linspace(-1.0, 2.0, 24).reshape(3, 8)
    print(float(jnp.sum(exported.call(x))))
"""


def test_register_kernels_builds_only_what_an_exported_function_calls(tmp_path):
  f = jax.jit(jax.grad(lambda x: jnp.sum(itk.soft_topk_mask(x, 2.5) * jnp.cos(x))))
  x = jnp.linspace(-1.0, 2.0, 24, dtype=jnp.float32).reshape(3, 8)
  path = tmp_path / "grad.jax"
  path.write_bytes(export.export(f, disabled_checks=itk.export_safety_checks())(x).serialize())
  names, total = _python(_EXPORT_AND_CALL, str(path)).split("\n")[:2]
  # the forward kernel and the reverse-mode kernel of p = 4/3: not the tangent kernel
  assert names.split() == ["implicit_topk_capped_simplex_cotangent_cubic_float32",
                           "implicit_topk_capped_simplex_float32"]
  np.testing.assert_allclose(float(total), float(jnp.sum(f(x))), rtol=1e-6)


_OPERATORS = {
    "soft_topk_mask": lambda x: itk.soft_topk_mask(x, 3.5, regularization_strength=0.5),
    "soft_topk_mag": lambda x: itk.soft_topk_mag(x, 3.5, regularization_strength=0.5),
    "soft_sort": lambda x: itk.soft_sort(x, regularization_strength=0.5),
    "soft_rank": lambda x: itk.soft_rank(x, regularization_strength=0.5),
}


def _exported(f, shape: str):
  spec = jax.ShapeDtypeStruct(export.symbolic_shape(shape), jnp.float32)
  blob = export.export(jax.jit(f), disabled_checks=itk.export_safety_checks())(spec).serialize()
  return export.deserialize(blob)


@pytest.mark.parametrize("name", ["soft_topk_mask", pytest.param("soft_topk_mag", marks=SLOW),
                                  pytest.param("soft_sort", marks=SLOW),
                                  pytest.param("soft_rank", marks=SLOW)])
def test_symbolic_batch_export_forward_and_gradient(name):
  op = _OPERATORS[name]
  grad = jax.grad(lambda x: jnp.sum(op(x) * jnp.cos(x)))
  rng = np.random.default_rng(3)
  for f in (op, grad):
    exported = _exported(f, "b, 16")
    for batch in (1, 5):
      x = jnp.asarray(rng.normal(size=(batch, 16)), jnp.float32)
      np.testing.assert_allclose(np.asarray(exported.call(x)), np.asarray(jax.jit(f)(x)),
                                 rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["soft_topk_mask", pytest.param("soft_topk_mag", marks=SLOW)])
def test_symbolic_row_length_export(name):
  op = _OPERATORS[name]
  exported = _exported(jax.grad(lambda x: jnp.sum(op(x) * jnp.cos(x))), "b, n")
  rng = np.random.default_rng(4)
  for shape in ((2, 7), (3, 40)):
    x = jnp.asarray(rng.normal(size=shape), jnp.float32)
    want = jax.grad(lambda z: jnp.sum(op(z) * jnp.cos(z)))(x)
    np.testing.assert_allclose(np.asarray(exported.call(x)), np.asarray(want), rtol=1e-6,
                               atol=1e-6)


def test_sorting_along_a_symbolic_axis_is_refused_by_name():
  with pytest.raises(ValueError, match="static length of the sorted axis"):
    _exported(_OPERATORS["soft_sort"], "b, n")
