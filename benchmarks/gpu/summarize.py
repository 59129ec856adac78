"""The GPU runs' JSON lines (``ingraph_matrix.py``'s ``gpu.jsonl``, ``diag.py``'s
``diag.jsonl``) as one results file for the docs (``benchmarks/doc_figures.py`` reads
``benchmarks/results/*.json``).

Usage: ``python benchmarks/gpu/summarize.py OUT.json MATRIX.jsonl DIAG.jsonl COMMIT
[--before MATRIX.jsonl DIAG.jsonl COMMIT]``. Cells are keyed ``BxN_kK`` (``16384x64_k2``);
``ratio`` is the default's forward+backward over the hard ``lax.top_k`` mask's forward,
in graph (each op chained 50 times inside one jit); ``ingraph_budget`` (keyed
``16384x8_k2_m3_l0.5_std``) has ``max_support``'s too, and ``over_plain``, its
forward+backward over the plain mask's."""

import argparse
import json


def _key(cell: str) -> str:
  shape, k = cell.split()[:2]
  return f"{shape}_k{k.split('=')[1]}"


def _budget_key(cell: str) -> str:
  """``16384x8 k=2 m=3 l=0.5 std`` -> ``16384x8_k2_m3_l0.5_std``."""
  shape, *rest = cell.split()
  return "_".join([shape] + [part.replace("=", "") for part in rest])


def run_summary(matrix_path, diag_path, commit):
  out = {"commit": commit, "ingraph": {}, "ingraph_mag": {}, "ingraph_budget": {},
         "percall": {}, "passes": {}}
  for line in open(matrix_path):
    r = json.loads(line)
    what = r.get("what")
    if what == "env":
      out.update(device=r["device"], jax=r["jax"])
    elif what == "pallas_correctness":
      out["max_abs_err_vs_float64"] = max(r.get("max_abs_err", {}).values(), default=None)
    elif what in ("ingraph", "ingraph_mag"):
      us, ratio = r["us"], r["ratio"]
      fb = "auto fb"
      if fb in us and isinstance(us[fb], float):
        out[what][_key(r["cell"])] = {"hard_fwd_us": round(us["hard fwd"], 1),
                                      "default_fb_us": round(us[fb], 1),
                                      "ratio": ratio[fb]}
    elif what == "ingraph_budget":
      us = r["us"]
      if all(isinstance(us.get(name), float) for name in ("hard fwd", "plain fb", "max_support fb")):
        out[what][_budget_key(r["cell"])] = {
            "hard_fwd_us": round(us["hard fwd"], 1), "plain_fb_us": round(us["plain fb"], 1),
            "budget_fb_us": round(us["max_support fb"], 1),
            "ratio": round(us["max_support fb"] / us["hard fwd"], 3),
            "over_plain": round(us["max_support fb"] / us["plain fb"], 3)}
    elif what == "percall":
      out["percall"][_key(r["cell"])] = {"hard_fwd_us": round(r["hard_us"], 1),
                                         "default_fb_us": round(r["auto_fb_us"], 1),
                                         "ratio": r["ratio"]}
  for line in open(diag_path):
    r = json.loads(line)
    if "cell" in r and "passes mean/max" in r["us"]:
      kind, shape, k = r["cell"].split()[:3]
      mean, most = r["us"]["passes mean/max"]
      out["passes"][f"{kind}_{shape}_k{k.split('=')[1]}"] = {"mean": mean, "max": most}
  return out


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("out")
  parser.add_argument("matrix")
  parser.add_argument("diag")
  parser.add_argument("commit")
  parser.add_argument("--before", nargs=3)
  args = parser.parse_args()
  summary = run_summary(args.matrix, args.diag, args.commit)
  if args.before:
    summary["before"] = run_summary(*args.before)
  with open(args.out, "w") as f:
    json.dump(summary, f, indent=1)
    f.write("\n")


if __name__ == "__main__":
  main()
