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
