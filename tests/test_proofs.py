"""Run each companion script of ``proofs/``; a script raises AssertionError on failure.

The scripts run in this process (``runpy``), so the library's compiled kernels and
JAX caches are shared between them. They need float64, which is turned on here (the
suite's conftest does the same) and again by the scripts themselves.
"""

import pathlib
import runpy

import jax
import pytest

pytestmark = pytest.mark.slow

jax.config.update("jax_enable_x64", True)

PROOFS = pathlib.Path(__file__).resolve().parents[1] / "proofs"
NAMES = [
    "threshold_form",
    "isotonic_dual",
    "implicit_gradient",
    "newton_finite_termination_p2",
    "limits",
    "dykstra_stopping",
    "regularizer_family",
    "magnitude_threshold",
    "grad_topk",
    "sparse_softmax",
    "fenchel_young",
    "pallas_certificate",
    "native_bracket",
    "native_magnitude_bracket",
    "standardized_strength",
    "dykstra_snap",
    "support_budget",
    "pallas_bounded_iteration",
    "complement_form",
    "float_range",
    "snap_to_entry",
]


@pytest.mark.parametrize("name", NAMES)
def test_proof_script(name, capsys):
    script = PROOFS / f"{name}.py"
    assert script.is_file(), f"missing {script}"
    assert (PROOFS / f"{name}.md").is_file(), f"missing the derivation {name}.md"
    runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out
    assert out.rstrip().endswith(f"{name}: OK"), out


def test_every_proof_script_is_run():
    """A proposition added to proofs/ without its name here would never be checked."""
    scripts = {p.stem for p in PROOFS.glob("*.py") if not p.stem.startswith("_")}
    assert scripts == set(NAMES), scripts ^ set(NAMES)
