"""examples/magnitude_pruning.py runs (quick mode) and writes its table, JSON and plot."""

import importlib.util
import json
import pathlib

import pytest

pytest.importorskip("sklearn")

pytestmark = pytest.mark.slow

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "magnitude_pruning.py"


def test_magnitude_pruning_quick(tmp_path):
  spec = importlib.util.spec_from_file_location("magnitude_pruning", EXAMPLE)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  results = module.main(["--quick", "--out", str(tmp_path)])
  data = json.loads((tmp_path / "magnitude_pruning_quick.json").read_text())
  assert set(data["mean"]) == set(module.METHODS)
  for method, by_keep in results.items():
    for keep, accuracies in by_keep.items():
      assert all(0.0 <= a <= 1.0 for a in accuracies), (method, keep)
  # at 10% of the weights, training with the sparsity in the loop beats pruning a dense net
  assert data["mean"]["soft"]["0.1"] > data["mean"]["dense"]["0.1"] + 0.2
  assert (tmp_path / "magnitude_pruning_quick.md").is_file()
  if importlib.util.find_spec("matplotlib") is not None:
    assert (tmp_path / "magnitude_pruning_quick.png").stat().st_size > 0
