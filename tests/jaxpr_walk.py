"""The primitives a jaxpr runs, every nested program included: the sub-jaxprs of loops,
conditionals, custom rules and calls (``ClosedJaxpr`` and wrappers peeled), and the
lowering of JAX's "hijax" primitives (``call_hi_primitive``, whose program is its
``_prim.expand``, traced here: jax 0.11 hides sorts and Pallas calls inside them), and
the branches of ``implicit_topk``'s per-platform selection (traced only when lowered:
traced here at the equation's operand types). Tests
that prove a program never sorts, or that it runs a kernel, read them through this."""

import jax

from implicit_topk.kernels.gpu import platform_select


def primitive_names(jaxpr) -> set:
  """The names of every primitive in ``jaxpr`` (a ``Jaxpr``), nested programs included."""
  names = set()
  for eqn in jaxpr.eqns:
    names.add(eqn.primitive.name)
    for inner in _nested_programs(eqn):
      names |= primitive_names(inner)
  return names


def _nested_programs(eqn):
  if eqn.primitive is platform_select.platform_select_p:
    yield from platform_select.branch_jaxprs(eqn).values()
  for value in eqn.params.values():
    for item in value if isinstance(value, (list, tuple)) else [value]:
      inner = item
      while not hasattr(inner, "eqns") and hasattr(inner, "jaxpr"):
        inner = inner.jaxpr  # ClosedJaxpr, and the wrappers of call primitives
      if hasattr(inner, "eqns"):
        yield inner
  hi = eqn.params.get("_prim")
  if hi is not None and hasattr(hi, "expand") and hasattr(hi, "in_avals_flat"):
    from jax._src import hijax  # pylint: disable=g-import-not-at-top
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in hi.in_avals_flat]
    expand = lambda *flat: hi.expand(*hijax.tree_unflatten(hi.in_tree, flat))
    yield jax.make_jaxpr(expand)(*avals).jaxpr
