"""Test configuration: float64 available everywhere (tests pick float32 explicitly), and
the Hypothesis profile.

The default profile ``derandomized`` draws the same examples on every run (a test suite
that gates a merge must not pass or fail by luck); ``HYPOTHESIS_PROFILE=explore`` draws
fresh random examples on each run, to hunt for new failures.
"""

import os

import jax
from hypothesis import settings

jax.config.update("jax_enable_x64", True)

settings.register_profile("derandomized", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "derandomized"))


# Host (numba) PAV kernels compile on first use, about 12 s per kernel and dtype, in every
# pytest-xdist worker. The default run compiles the kernels of the default mask (p = 4/3)
# through solver="pav" and the permutahedron cross-checks; the kernels' own tests
# (test_pav_kernels.py) and those of other host kernels (other p, entropy, the magnitude
# kernels) run in the slow group.
_HOST_PAV_KEPT_FAST = ("tests/test_soft_topk_mask.py::",
                       "tests/test_fuzz.py::test_fast_mask_vs_reference[pav-p4/3]",
                       "tests/test_permutahedron_solvers.py::")


def pytest_collection_modifyitems(config, items):
  import pytest
  for item in items:
    uses_host_pav = "pav" in item.nodeid.replace("pav_jax", "")
    if uses_host_pav and not item.nodeid.startswith(_HOST_PAV_KEPT_FAST):
      item.add_marker(pytest.mark.slow)
