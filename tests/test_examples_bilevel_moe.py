"""examples/bilevel_feature_selection.py, examples/moe_router.py and examples/router_budget.py
in quick mode."""

import importlib.util
import json
import math
import pathlib

import pytest

pytest.importorskip("sklearn")
pytest.importorskip("jaxopt")

pytestmark = pytest.mark.slow

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def _load(name):
  spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def bilevel(tmp_path_factory):
  out = tmp_path_factory.mktemp("bilevel")
  module = _load("bilevel_feature_selection")
  return module.main(["--quick", "--out", str(out)]), out


# The two tests of the `bilevel` fixture run on one worker (pyproject: --dist loadgroup),
# so the example runs once.
@pytest.mark.xdist_group("bilevel")
def test_bilevel_hypergradient_matches_finite_differences(bilevel):
  result, _ = bilevel
  rows = {r["method"][:3]: r for r in result["gradcheck"]}
  assert set(rows) == {"(a)", "(b)", "(c)"}
  # (a) implicit everywhere vs (c) central finite differences, float64, small case
  assert rows["(a)"]["rel_err_all"] < 1e-5
  assert rows["(a)"]["rel_err_theta"] < 1e-5 and rows["(a)"]["rel_err_k"] < 1e-5
  assert rows["(a)"]["rel_err_l"] < 1e-5
  assert result["gradcheck_info"]["n_fractional"] >= 2  # the gradient is not trivially 0
  for r in result["gradcheck"]:
    assert math.isfinite(r["rel_err_all"]) and r["time_ms"] > 0


@pytest.mark.xdist_group("bilevel")
def test_bilevel_beats_univariate_selection(bilevel):
  result, out = bilevel
  fixed = result["fixed_k"]
  assert len(fixed["hard"]["features"]) == fixed["k"]
  best = min(b["val_loss"] for b in fixed["baselines"].values())
  assert fixed["hard"]["val_loss"] < best
  assert fixed["soft_val_loss"] < best
  assert fixed["history"][-1]["val_loss"] < fixed["history"][0]["val_loss"]
  assert sum(1 for m in fixed["mask"] if m == 0.0) >= result["n_features"] - 3 * fixed["k"]
  learned = result["learned_k"]
  assert learned["k"] != learned["k_init"] and 1.0 < learned["k"] < result["n_features"] - 1
  data = json.loads((out / "bilevel_feature_selection_quick.json").read_text())
  assert data["fixed_k"]["k"] == fixed["k"]
  md = (out / "bilevel_feature_selection_quick.md").read_text()
  assert "(a) implicit" in md and "(b) unrolled" in md and "(c) central" in md
  if importlib.util.find_spec("matplotlib") is not None:
    assert (out / "bilevel_feature_selection_quick.png").stat().st_size > 0


def test_moe_router_quick(tmp_path):
  module = _load("moe_router")
  result = module.main(["--quick", "--steps", "40", "--out", str(tmp_path)])
  runs = result["runs"]
  assert set(runs) == set(module.VARIANTS)
  for name, run in runs.items():
    assert not run["any_nan"], name
    assert all(math.isfinite(h["train_loss"]) for h in run["history"]), name
    assert run["history"][-1]["train_loss"] < run["history"][0]["train_loss"], name
    assert run["final"]["acc"] > 0.5, name
    assert abs(sum(run["final"]["load"]) - 1.0) < 1e-6
  soft = runs["soft/sparse"]["final"]
  assert soft["zero_frac"] > 0.25  # sparse routing: exact zeros in the gates
  assert soft["nnz_per_token"] >= 2.0 - 1e-9  # at least k experts (the mask sums to k)
  assert runs["hard/sparse"]["final"]["zero_frac"] == pytest.approx(0.75)
  for name, t in result["throughput"].items():
    assert t["step_tok_s"] > 0 and t["fwd_tok_s"] > 0, name
  assert result["throughput"]["soft/sparse"]["expert_evals"] < \
      result["throughput"]["soft/dense"]["expert_evals"]
  md = (tmp_path / "moe_router_quick.md").read_text()
  for name in module.VARIANTS:
    assert f"| {name} |" in md
  assert json.loads((tmp_path / "moe_router_quick.json").read_text())["runs"]


def test_sparse_dispatch_equals_dense_without_drops():
  """With enough capacity, the capacity-buffer layer computes exactly the dense one."""
  import jax
  import jax.numpy as jnp

  module = _load("moe_router")
  params = module.init_params(jax.random.PRNGKey(0), 6, 5, 3, 4)
  x = jax.random.normal(jax.random.PRNGKey(1), (16, 6))
  for gate in ("soft", "hard"):
    outs = {}
    for compute in ("dense", "sparse"):
      f = lambda p: module.moe_forward(p, x, gate=gate, compute=compute, k=2, l=0.5, cap=16)  # noqa: E731
      out, _, _ = f(params)
      grad = jax.grad(lambda p: jnp.sum(f(p)[0] ** 2))(params)
      outs[compute] = (out, grad)
    assert jnp.allclose(outs["dense"][0], outs["sparse"][0], atol=1e-10)
    for key in params:
      assert jnp.allclose(outs["dense"][1][key], outs["sparse"][1][key], atol=1e-9), key


def test_router_budget_quick(tmp_path):
  """Routers at equal expert budgets: max_support holds the budget, the files are written."""
  module = _load("router_budget")
  result = module.main(["--quick", "--out", str(tmp_path)])
  assert result["routers"] == list(module.QUICK_ROUTERS)
  for name in result["routers"]:
    s = result["summary"][name]
    assert not s["any_nan"], name
    b = result["budget"][name]
    assert s["max_experts_init"] <= b and s["max_experts_final"] <= b, name
    assert len(s["test_loss"]["per_seed"]) == len(result["options"]["seeds"])
    assert 0.0 <= s["test_acc"]["mean"] <= 1.0
    t = result["step_time"][name]
    assert t["dense_ms"] > 0 and t["sparse_ms"] > 0
    assert len(t["dense_ms_all"]) == result["options"]["rounds"]
  # hard top-2 has no fractional mask entries; k = 2 with max_support=3: 2 or 3 experts
  # per token, some tokens with a gradient to the choice
  assert result["summary"]["hard top-2"]["fractional_final"]["mean"] == 0.0
  soft = result["summary"]["soft std k=2 m=3"]
  assert 2.0 <= soft["experts_final"]["mean"] <= 3.0
  assert soft["tokens_choice_gradient_final"]["mean"] > 0.0
  for name in result["routers"]:
    for run in result["runs"][name]:
      assert run["train_loss_last"] < run["train_loss_first"], name
  md = (tmp_path / "router_budget_quick.md").read_text()
  for name in result["routers"]:
    assert f"| {name} |" in md
  assert json.loads((tmp_path / "router_budget_quick.json").read_text())["summary"]
