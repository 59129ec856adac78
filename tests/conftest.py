"""Test configuration: float64 available everywhere (tests pick float32 explicitly)."""

import jax

jax.config.update("jax_enable_x64", True)
