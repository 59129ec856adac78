"""Soft top-k along a reduced axis split over 8 host devices (issues 16 and 33).

``tests/sharded_check.py`` runs in a subprocess (host devices must be configured before
JAX starts, ``XLA_FLAGS=--xla_force_host_platform_device_count=8``): jit with
``NamedSharding(mesh, P(None, "d"))`` on Auto and Explicit meshes, ``shard_map`` with
``axis_name="d"``, pytrees with differently sharded leaves; results, ``jax.grad`` and
``jax.jvp`` equal to the unsharded computation, and the compiled HLO has all-reduces and
no all-gather, all-to-all or collective-permute. Under jit on an Auto mesh the default
CPU solver (the native kernel, a custom call) is custom-partitioned
(``implicit_topk.kernels.cpu.partitioning``): a split reduced axis runs the threshold
iteration with psum, a split batch the kernel per device.

The slow group's first test (one subprocess) checks the issue's case (x of shape (4, 8192), k =
40.5, l = 0.1) for the mask and the magnitude operator (forward, grad, jvp), float64
rows with the sigmoid regularizer, a batch-sharded input (the kernel per device, no
collective), a 2-D mesh splitting both axes, that the HLO check sees the gather of the
unpartitioned kernel, and shard_map on a small row; the slow group runs every
operator, regularizer kind, shape, dtype and mesh.
"""

import pathlib

import pytest

import device_checks

SCRIPT = pathlib.Path(__file__).with_name("sharded_check.py")


def _run(*groups):
  return device_checks.run_script(SCRIPT, *groups, timeout=1800)


@pytest.mark.slow  # 8 host devices in a subprocess: 80 s of CPU, more than the default run can spend
def test_issue_case_and_shard_map_without_gather():
  report = _run("fast")  # asserts that every check is OK
  for line in ("jit[auto] mask (4, 8192) float32 fwd HLO", "jit[auto] mask (4, 8192) float32 grad HLO",
               "jit[auto] mag (4, 8192) float32 fwd HLO", "jit[auto] mag (4, 8192) float32 grad HLO",
               "jit[auto] mask (4, 8192) float32 jvp:", "jit[auto] mag (4, 64) float64 grad:",
               "jit[auto native] mask (4, 8192) float32 grad HLO",
               "jit[auto native] mask_p1.5 (4, 64) float64 jvp HLO",
               "batch-sharded mask grad HLO", "2-D mesh mag grad HLO",
               "unpartitioned kernel: the HLO check sees its gather", "shard_map mask (4, 64) fwd HLO",
               "error replicated input"):
    assert line in report, (line, report)
  assert report.count("OK  ") >= 50, report


# One subprocess per group, so that pytest-xdist can run them side by side (one 4-minute
# test at the end of the run kept the other worker idle; every operator under jit took
# 480 s of one worker in CI's run; now two groups of half the cases). Not repeated here: the
# "errors" group (the default run's "fast" group runs it) and "jit_native" (every
# operator with solver="native": on CPU the default solver lowers to the same kernel
# calls, which "jit_float32" and "jit_float64" check; "fast" checks solver="native"
# itself, the derivative kernels' sharded forms included; 100-240 s of one worker).
_SLOW_GROUPS = {
    "jit_float32": "jit[auto] mask_laplace (4, 8192) float32 jvp",
    "jit_float64": "jit[auto] mask_laplace (4, 64) float64 jvp",
    "jit_threshold": "jit[auto threshold] mag (4, 8192) float64 grad",
    "jit_explicit": "jit[explicit] mag (4, 8192) float32 grad HLO",
    "shard_map": "shard_map mask (4, 8192) where",
    "tree": "tree_mag sharded HLO",
}


@pytest.mark.slow
@pytest.mark.parametrize("group", list(_SLOW_GROUPS))
def test_every_operator_shape_dtype_and_mesh(group):
  report = _run(group)
  assert _SLOW_GROUPS[group] in report, report
