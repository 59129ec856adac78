"""examples/magnitude_pruning.py and examples/pruning_schedule.py run (quick mode) and write
their tables, JSON and plots."""

import importlib.util
import json
import pathlib

import pytest

pytest.importorskip("sklearn")

pytestmark = pytest.mark.slow

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
EXAMPLE = EXAMPLES / "magnitude_pruning.py"


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


def test_pruning_schedule_quick(tmp_path):
  spec = importlib.util.spec_from_file_location("pruning_schedule", EXAMPLES / "pruning_schedule.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  result = module.main(["--quick", "--out", str(tmp_path)])
  assert result["methods"] == list(module.QUICK_METHODS)
  runs = result["runs"]
  for name in result["methods"]:
    for run in runs[name]:
      assert all(0.0 <= h["test_acc"] <= 1.0 for h in run["history"]), name
      assert all(0.0 < h["density"] <= 1.0 for h in run["history"]), name
  keep = result["options"]["keep"]
  for name in ("straight-through", "fixed mask"):  # exactly k nonzero weights throughout
    assert all(abs(h["density"] - keep) < 1e-3 for r in runs[name] for h in r["history"])
  # the soft density is at least the target; annealed, it ends below the constant strength's
  annealed, constant = runs["soft, l = 1 -> 0.05"][0], runs["soft, l = 0.4"][0]
  assert min(h["density"] for h in annealed["history"]) >= keep - 1e-3
  assert annealed["density_end"] < constant["density_end"]
  assert annealed["density_end"] < annealed["density_start"]
  strengths = [h["strength"] for h in annealed["history"]]
  assert strengths[0] == pytest.approx(1.0) and strengths[-1] == pytest.approx(0.05, rel=1e-5)
  assert module.geometric(2.0, 0.02, 5)[2] == pytest.approx(0.2)
  cal = result["calibration"]["Gaussian"]["0.05"]
  assert cal["2.0"] > cal["0.4"] > cal["0.02"] >= 0.05 - 1e-3  # density grows with l
  data = json.loads((tmp_path / "pruning_schedule_quick.json").read_text())
  assert data["methods"] == result["methods"]
  md = (tmp_path / "pruning_schedule_quick.md").read_text()
  assert "| soft, l = 1 -> 0.05 |" in md and "| straight-through |" in md
  if importlib.util.find_spec("matplotlib") is not None:
    assert (tmp_path / "pruning_schedule_quick.png").stat().st_size > 0
