"""The GPU program of the default, checked on a CPU-only machine by lowering for CUDA.

Nothing runs on a GPU here: ``jax.jit(f).trace(x).lower(lowering_platforms=("cuda",))``
builds the StableHLO that XLA:GPU would compile. The default forward and backward of
``soft_topk_mask`` and ``soft_topk_mag`` must be the fused Triton kernel and, for the
backward, one more Triton call (the cotangent kernel), plus elementwise ops: no ``stablehlo.while`` (on XLA:GPU a loop with a data-dependent trip
count copies its predicate to the host every iteration) and no ``stablehlo.case`` (a
``cond`` does so once) outside the kernel. The default picks its solver per platform
with ``lax.platform_dependent``, which leaves ``stablehlo.case`` ops on a constant index
in the module (a map of the constant platform index, and a case on it), which XLA folds
before anything runs; every other case is refused. Rows longer than the kernel's limit go to the
threshold solver, whose loop is the documented exception (64 x 1e4 below). Also: the
default exports for CPU and CUDA together from this host, and runs here.
"""

from __future__ import annotations

import contextlib
import re
from unittest import mock
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import implicit_topk as itk
from implicit_topk.kernels.gpu import pallas_threshold

TRITON = pallas_threshold.TRITON_TARGET


@contextlib.contextmanager
def _traced_as_on(host):
  """Traces inside run as on a ``host`` machine (``"gpu"``: the GPU solver is traced with
  the function, as on a GPU machine; ``"cpu"``: this machine, where the GPU branch is a
  deferred call traced at lowering). jit's caches know the real default device, not this
  stand-in, so they are cleared on both sides: the operators' inner jitted functions
  traced for one host must not be reused for the other."""
  jax.clear_caches()
  with mock.patch.object(itk.solvers, "target_platform", lambda: host):
    yield
  jax.clear_caches()


def _lower(fn, shape, dtype=jnp.float32, host="gpu"):
  """``fn`` traced as on a ``host`` machine (:func:`_traced_as_on`), lowered for CUDA."""
  x = jax.ShapeDtypeStruct(shape, dtype)
  with _traced_as_on(host):
    return jax.jit(fn).trace(x).lower(lowering_platforms=("cuda",)).as_text()


def _data_dependent_cases(text):
  """The ``stablehlo.case`` ops of the module whose branch could depend on data.

  ``lax.platform_dependent`` lowers to a pair of cases: one that maps the platform index
  to the kept branch (every region returns a constant), and one on that case's result;
  in a backward pass the platform index reaches them as a function argument. Both fold
  away once the (constant) platform index is known, before anything runs. Any other case
  (e.g. a ``lax.cond`` on a computed predicate) is returned."""
  from jax._src.interpreters import mlir as jmlir
  from jax._src.lib.mlir import ir

  def constant_map(op):
    for region in op.regions:
      for block in region.blocks:
        ops = [inner.operation for inner in block.operations]
        if ops[-1].name != "stablehlo.return" or any(
            inner.name != "stablehlo.constant" for inner in ops[:-1]):
          return False
        for value in ops[-1].operands:
          owner = value.owner
          if not isinstance(owner, ir.Operation) and hasattr(owner, "operation"):
            owner = owner.operation
          if not hasattr(owner, "name") or owner.name != "stablehlo.constant":
            return False
    return True

  found = []

  def walk(op):
    op = op.operation
    if op.name == "stablehlo.case" and not constant_map(op):
      owner = op.operands[0].owner
      owner = getattr(owner, "operation", owner)
      if not (hasattr(owner, "name") and owner.name == "stablehlo.case" and constant_map(owner)):
        found.append(str(op)[:200])
    for region in op.regions:
      for block in region.blocks:
        for inner in block.operations:
          walk(inner)

  with jmlir.make_ir_context():
    walk(ir.Module.parse(text).operation)
  return found


def _fwd_bwd(op):
  return lambda z: jax.grad(lambda u: jnp.sum(op(u) * jnp.cos(u)))(z)


MASK = lambda k: (lambda u: itk.soft_topk_mask(u, k, regularization_strength=0.5))
MAG = lambda k: (lambda u: itk.soft_topk_mag(u, k, regularization_strength=0.5))
CELLS = [(name, shape, k) for name in ("mask", "mag")
         for shape, k in (((16384, 8), 2.0), ((16384, 64), 2.0), ((16384, 256), 8.0),
                          ((64, 1000), 10.0))]


@pytest.mark.parametrize("name,shape,k", CELLS, ids=[f"{c[0]}-{c[1][0]}x{c[1][1]}" for c in CELLS])
def test_default_forward_and_backward_lower_to_the_kernel_without_host_round_trips(name, shape, k):
  """Forward and backward: one Triton call each (the fused kernel, then the cotangent
  kernel of ``kernels/gpu/pallas_derivatives.py``); forward mode: the fused kernel and
  the tangent kernel."""
  op = (MASK if name == "mask" else MAG)(k)
  # forward+backward holds the forward; the forward alone, and forward mode, for one cell
  checks = [(_fwd_bwd(op), "forward+backward", 2)]
  if shape == (16384, 64):
    checks.append((op, "forward", 1))
    checks.append((lambda z: jax.jvp(op, (z,), (jnp.cos(z),))[1], "forward mode", 2))
  for fn, what, calls in checks:
    text = _lower(fn, shape)
    assert text.count(TRITON) == calls, (what, text.count(TRITON))
    assert "stablehlo.while" not in text, what
    assert not _data_dependent_cases(text), what
    assert "stablehlo.sort" not in text and "top_k" not in text.lower().replace("topk", ""), what
    assert set(re.findall(r'custom_call @"?([^\s("]+)', text)) == {TRITON}, what


def test_lowered_for_cuda_on_a_cpu_machine_the_backward_recomputes_the_forward_kernel():
  """Traced here (a CPU machine), the GPU branch is a deferred call: lowered for CUDA,
  forward+backward is the fused kernel, then the backward's own forward kernel and the
  cotangent kernel (the transposed deferred call recomputes the forward); still no
  loop and no data-dependent case. Traced on a GPU machine, the backward reuses the
  forward's outputs (the test above)."""
  text = _lower(_fwd_bwd(MASK(2.0)), (16384, 64), host="cpu")
  assert text.count(TRITON) == 3 and "stablehlo.while" not in text
  assert not _data_dependent_cases(text)
  assert _lower(MASK(2.0), (16384, 64), host="cpu").count(TRITON) == 1


def test_shard_map_over_a_batch_sharded_input_lowers_to_the_kernels():
  """The gradient inside shard_map (a batch-sharded input): the forward kernel and the
  cotangent kernel, chosen per platform there too (no data-dependent case)."""
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  mesh = jax.make_mesh((1,), ("b",))
  fn = jax.jit(jax.shard_map(_fwd_bwd(MASK(2.0)), mesh=mesh, in_specs=P("b"), out_specs=P("b")))
  x = jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=NamedSharding(mesh, P("b")))
  with _traced_as_on("gpu"):
    text = fn.trace(x).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count(TRITON) == 2 and "stablehlo.while" not in text
  assert not _data_dependent_cases(text)


BUDGET_CELLS = (((16384, 8), 2.0, 3), ((16384, 256), 8.0, 12))


@pytest.mark.parametrize("host", ["gpu", "cpu"])
@pytest.mark.parametrize("shape,k,m", BUDGET_CELLS, ids=["16384x8", "16384x256"])
def test_a_budgeted_mask_lowers_for_cuda_without_host_round_trips(shape, k, m, host):
  """``max_support`` (the router recipe, ``standardize=True``): on a GPU the pure-JAX
  budget path (its m+1 largest values by masked maxima, or ``lax.top_k`` at n = 256;
  two closed forms), forward+backward and forward mode, with no loop and no
  data-dependent case (``lax.cond``), traced on a GPU machine or here; never the CPU
  kernel's call."""
  op = lambda u: itk.soft_topk_mask(u, k, regularization_strength=0.5, max_support=m,
                                    standardize=True)
  for fn, what in ((_fwd_bwd(op), "forward+backward"),
                   (lambda z: jax.jvp(op, (z,), (jnp.cos(z),))[1], "forward mode")):
    text = _lower(fn, shape, host=host)
    assert "stablehlo.while" not in text and "stablehlo.sort" not in text, what
    assert not _data_dependent_cases(text), what
    assert not re.findall(r'custom_call @"?([^\s("]+)', text), what


def _public_operators():
  """One call of every public operator (and of ``max_support`` in each mask form) on a
  (4, 8) input."""
  labels = jnp.array([1, 3, 0, 2])
  ids = lambda u: jnp.arange(u.size) // 8
  tree = lambda u: {"a": u, "b": u[:, :3]}
  return {
      "soft_topk_mask": lambda u: itk.soft_topk_mask(u, 2.0),
      "soft_topk_mask entropy": lambda u: itk.soft_topk_mask(u, 2.0, regularizer=itk.Entropy()),
      "soft_topk_mask where": lambda u: itk.soft_topk_mask(u, 2.0, where=u > -1),
      "soft_topk_mask max_support p=3": lambda u: itk.soft_topk_mask(u, 2.0, p=3.0, max_support=3),
      "soft_topk_mask max_support float16": lambda u: itk.soft_topk_mask(
          u.astype(jnp.float16), 2.0, max_support=3).astype(u.dtype),
      "soft_topk_mag": lambda u: itk.soft_topk_mag(u, 2.0),
      "hard_topk_mask": lambda u: itk.hard_topk_mask(u, 2),
      "hard_topk_mag": lambda u: itk.hard_topk_mag(u, 2),
      "segment_soft_topk_mask": lambda u: itk.segment_soft_topk_mask(u.reshape(-1), ids(u), 2.0, num_segments=4),
      "segment_soft_topk_mask max_support": lambda u: itk.segment_soft_topk_mask(
          u.reshape(-1), ids(u), 2.0, num_segments=4, max_support=3),
      "tree_soft_topk_mask": lambda u: itk.tree_soft_topk_mask(tree(u), 4.0)["a"],
      "tree_soft_topk_mask max_support": lambda u: itk.tree_soft_topk_mask(
          tree(u), 4.0, max_support=6)["a"],
      "tree_soft_topk_mag": lambda u: itk.tree_soft_topk_mag(tree(u), 4.0)["a"],
      "soft_sort": itk.soft_sort,
      "soft_rank": itk.soft_rank,
      "soft_quantile": lambda u: itk.soft_quantile(u, 0.5),
      "soft_topk_values": lambda u: itk.soft_topk_values(u, 2),
      "permutahedron_argmax": lambda u: itk.permutahedron_argmax(u, jnp.arange(8.0, dtype=u.dtype)),
      "grad_topk": lambda u: itk.grad_topk(u, 2),
      "iterative_softmax_topk": lambda u: itk.iterative_softmax_topk(u, 2),
      "sparse_softmax": lambda u: itk.sparse_softmax(u, 2),
      "topk_cross_entropy": lambda u: itk.topk_cross_entropy(u, labels, p_k=[0.5, 0.5]),
      "topk_fenchel_young_loss": lambda u: itk.topk_fenchel_young_loss(
          u, jax.nn.one_hot(labels, 8), 2),
      "smooth_topk_svm_loss": lambda u: itk.smooth_topk_svm_loss(u, labels, 2),
      "soft_error_loss": lambda u: itk.soft_error_loss(u, labels),
  }


def test_every_public_operator_lowers_for_cuda_traced_as_on_a_gpu():
  """Forward+backward of each public operator, traced as on a GPU machine and lowered for
  CUDA: none raises (``max_support`` did: its per-platform choice named a GPU ``"gpu"``)
  and none holds a CPU kernel's call."""
  failed, cpu_calls = {}, {}
  for name, op in _public_operators().items():
    fn = lambda z, op=op: jax.grad(lambda u: jnp.sum(op(u) * jnp.cos(jnp.sum(u))))(z)
    try:
      text = _lower(fn, (4, 8))
    except Exception as exc:  # pylint: disable=broad-except
      failed[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
      continue
    calls = set(re.findall(r'custom_call @"?([^\s("]+)', text)) - {TRITON}
    if calls:
      cpu_calls[name] = calls
  assert not failed, failed
  assert not cpu_calls, cpu_calls


def test_long_rows_lower_to_the_chunked_kernel():
  """64 x 1e4: one program per row, the row read in chunks (rows of 4096 < n <= 65536)."""
  text = _lower(_fwd_bwd(MASK(100.0)), (64, 10_000))
  assert text.count(TRITON) == 1 and "stablehlo.while" not in text
  assert not _data_dependent_cases(text)


@pytest.mark.slow
@pytest.mark.parametrize("name,shape", [("mag", (64, 10_000)), ("mask", (8, 65_536))])
def test_long_rows_lower_to_the_chunked_kernel_sweep(name, shape):
  text = _lower(_fwd_bwd((MASK if name == "mask" else MAG)(10.0)), shape)
  assert text.count(TRITON) == 1 and "stablehlo.while" not in text
  assert not _data_dependent_cases(text)


def test_rows_longer_than_the_kernels_take_the_threshold_solver():
  """Beyond 65536 entries the pure-JAX threshold solver runs (its while loop is visible
  at the XLA level: the documented exception)."""
  text = _lower(MASK(100.0), (2, 70_000))
  assert TRITON not in text and "stablehlo.while" in text


def test_the_kernel_uses_blocks_of_1024_entries_and_4_warps():
  text = _lower(MASK(2.0), (16384, 64))
  assert re.search(r"num_warps\D{0,8}4\b", text), "num_warps = 4"
  # 1024 entries per program, at most 128 rows (the Triton IR itself is serialized in the module)
  rows = {n: pallas_threshold.block_rows(16384, n, interpret=False) for n in (8, 64, 256, 1024, 4096)}
  assert rows == {8: 128, 64: 16, 256: 4, 1024: 1, 4096: 1}


def test_native_on_a_gpu_backend_is_refused_by_name(monkeypatch):
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  with pytest.raises(ValueError, match="solver='native' runs on the CPU only.*'pallas', 'threshold'"):
    itk.soft_topk_mask(jnp.ones((2, 4)), 2.0, solver="native")
  with pytest.raises(ValueError, match="solver='pav' runs on the CPU only"):
    itk.soft_topk_mag(jnp.ones((2, 4)), 2.0, solver="pav")


def test_auto_is_chosen_per_platform_at_lowering():
  solver = itk.solvers.make_solver("auto", itk.problems.CappedSimplex(), row_length=64)
  assert {p: solver.for_platform(p).name for p in ("cpu", "cuda", "rocm", "tpu")} == {
      "cpu": "native", "cuda": "pallas", "rocm": "pallas", "tpu": "threshold"}
  long_rows = itk.solvers.make_solver("auto", itk.problems.CappedSimplex(), row_length=10_000)
  assert long_rows.for_platform("cuda").name == "pallas"
  too_long = itk.solvers.make_solver("auto", itk.problems.CappedSimplex(), row_length=70_000)
  assert too_long.for_platform("cuda").name == "threshold"
  assert itk.solvers.make_solver("auto", itk.problems.CappedSimplex(), sharded=True).name == "threshold"


def test_export_safety_checks_name_the_triton_target():
  names = {str(check) for check in itk.export_safety_checks()}
  assert any(TRITON in name for name in names), names


def test_default_exports_for_cpu_and_cuda_and_runs_here():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(8, 64)), jnp.float32)
  for op in (MASK(2.0), MAG(2.0)):
    fn = jax.jit(_fwd_bwd(op))
    exported = jax.export.export(fn, platforms=("cpu", "cuda"),
                                 disabled_checks=itk.export_safety_checks())(x)
    assert TRITON in exported.mlir_module()
    restored = jax.export.deserialize(exported.serialize())
    itk.register_kernels(restored)
    np.testing.assert_allclose(np.asarray(restored.call(x)), np.asarray(fn(x)), rtol=0, atol=1e-6)


def _mosaic_gpu():
  try:
    from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  except ImportError as exc:  # pragma: no cover
    pytest.skip(f"this jax has no Pallas Mosaic GPU backend: {exc}")
  return plgpu


@pytest.mark.slow
def test_mosaic_gpu_lowers_row_reductions_but_not_the_kernel_body():
  """Issue 32 item 6, measured with the jax of this environment (docs/guides/choosing.md):
  Pallas' Mosaic GPU backend lowers for CUDA on a CPU-only machine a block of 128 rows
  with row sums (WGMMA register layout, swizzled shared-memory tiles) inside a
  data-dependent ``while_loop``, but not the kernel's body, which is the problems' own
  ``jax.numpy`` code: it stops at a primitive the backend does not implement
  (``is_finite``; then ``sqrt``, ``erf_inv`` and per-row constants of the splat layout)
  and at float64 (no TMA transfer of f64). When this test fails, a newer jax lowers more:
  look again at a Mosaic GPU option for ``solver="pallas"``."""
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  plgpu = _mosaic_gpu()
  rows = plgpu.Layout.WGMMA.reduce(1)
  spec = plgpu.BlockSpec(transforms=(plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128)))

  def call(kernel, x, *, in_specs=None):
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape[:1], x.dtype),
                          in_specs=in_specs or [spec],
                          compiler_params=plgpu.CompilerParams())(x)

  def loop(x_ref, o_ref):  # a bisection-like loop on per-row values, with row sums
    v = plgpu.load(x_ref, (), layout=plgpu.Layout.WGMMA)

    def body(carry):
      lam, pending = carry
      wide = jax.lax.broadcast_in_dim(lam, v.shape, (0,))
      phi = jnp.sum(jnp.maximum(v - wide, 0.0), axis=-1) - 2.0
      return lam + 0.5 * phi, pending & (jnp.abs(phi) > 1e-3)

    lam = plgpu.layout_cast(jnp.zeros(v.shape[:1], v.dtype), rows)
    o_ref[...] = jax.lax.while_loop(lambda c: jnp.sum(jnp.where(c[1], 1, 0)) > 0, body,
                                    (lam, lam == 0))[0]

  x = jax.ShapeDtypeStruct((128, 64), jnp.float32)
  text = jax.jit(lambda z: call(loop, z)).trace(x).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text and "stablehlo.while" not in text

  def body(x_ref, o_ref):  # the kernel body's first non-portable step
    v = x_ref[...]
    o_ref[...] = jnp.sum(jnp.where(jnp.isfinite(v), v, jnp.zeros_like(v)), axis=-1)

  with pytest.raises(NotImplementedError, match="is_finite"):
    jax.jit(lambda z: call(body, z)).trace(x).lower(lowering_platforms=("cuda",))
  with pytest.raises(Exception, match="f64"):
    jax.jit(lambda z: pl.pallas_call(
        lambda x_ref, o_ref: o_ref.__setitem__(Ellipsis, x_ref[...] * 2),
        out_shape=jax.ShapeDtypeStruct(z.shape, z.dtype),
        compiler_params=plgpu.CompilerParams())(z)).trace(
            jax.ShapeDtypeStruct((128, 64), jnp.float64)).lower(lowering_platforms=("cuda",))


def test_lowering_for_a_gpu_silences_only_jax_notice_that_triton_is_deprecated():
  """jax 0.11 warns at every Triton lowering; users of the default get no such warning,
  and every other DeprecationWarning still reaches them."""
  jax.clear_caches()  # lowered afresh (pytest reset the filters after earlier lowerings)
  _lower(MASK(2.0), (8, 64))
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always", append=True)
    warnings.warn("The Pallas Triton backend is deprecated and will be removed in a future "
                  "JAX version. To keep using Pallas on GPU, ...", DeprecationWarning)
    warnings.warn("another deprecation", DeprecationWarning)
    warnings.warn("The Pallas Triton backend is deprecated and will be removed in a future "
                  "JAX version.", UserWarning)
  assert [(str(w.message)[:20], w.category) for w in seen] == [
      ("another deprecation", DeprecationWarning), ("The Pallas Triton ba", UserWarning)]
