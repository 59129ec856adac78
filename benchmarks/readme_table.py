#!/usr/bin/env python
"""The README's benchmark table, from the JSON written by ``bench_topk.py``.

:func:`table` builds a compact Markdown table (cell, hard fwd ms, and the soft fwd+bwd /
hard fwd ratio of: the default solver at p = 4/3 and p = 2, the threshold solver and the
PAV solver at p = 4/3, and any other solver of the run at p = 4/3).
``benchmarks/doc_figures.py`` writes it into README.md, with every other speed figure of
the README and docs/, from the committed results; this script prints it, or, with
``--write FILE``, replaces the text between the lines ``<!-- bench-matrix:start -->`` and
``<!-- bench-matrix:end -->`` in FILE by it (for a JSON of ``--mode ingraph``:
``<!-- bench-matrix-ingraph:start -->`` and ``<!-- bench-matrix-ingraph:end -->``;
``--block NAME`` picks other markers), e.g. to see a new run's table before it is
committed. If FILE lacks the markers, says so and exits with status 1.

Usage::

    python benchmarks/readme_table.py                                  # print
    python benchmarks/readme_table.py /tmp/run.json                    # another run
    python benchmarks/doc_figures.py                  # README.md and docs/ from the results
"""

from __future__ import annotations

import argparse
import json
import os
import sys

BLOCKS = {"percall": "bench-matrix", "ingraph": "bench-matrix-ingraph"}
START = "<!-- bench-matrix:start -->"
END = "<!-- bench-matrix:end -->"


def markers(block: str) -> tuple[str, str]:
  """The start and end lines of the README block named ``block``."""
  return f"<!-- {block}:start -->", f"<!-- {block}:end -->"
from bench_topk import _fmt_ms, _fmt_ratio  # noqa: E402  (the script's folder is on sys.path)

DEFAULT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                            "cpu_matrix.json")


def _entry(rec, bold_above=None):
  if rec is None:
    return "—"
  if "skipped" in rec:
    return "skipped"
  if "error" in rec:
    return "error"
  if "ratio" not in rec:
    return "—"
  text = _fmt_ratio(rec["ratio"])
  if bold_above is not None and rec["ratio"] > bold_above:
    text = f"**{text}**"
  return text


def table(result) -> str:
  meta = result["meta"]
  default = meta.get("default_solver", "auto")
  columns = [(f"{default} p=4/3", f"soft {default} p=4/3", 2.0),
             (f"{default} p=2", f"soft {default} p=2", 2.0),
             ("threshold p=4/3", "soft threshold p=4/3", None),
             ("pav p=4/3", "soft pav p=4/3", None)]
  shown = {key for _, key, _ in columns}
  extra = {r["contender"] for c in result["cells"] for r in c["records"]
           if r.get("p") is not None and abs(r["p"] - 4.0 / 3.0) < 1e-12}
  columns += [(key[len("soft "):], key, None) for key in sorted(extra - shown)]
  options = meta.get("options", {})
  reps = options.get("repeats", "?")
  ingraph = meta.get("mode") == "ingraph"
  how = (f", in graph (the op chained up to {options.get('chain', '?')} times inside one "
         "jit, time / chain length); median of {} interleaved runs" if ingraph
         else "; median of {} interleaved calls").format(reps)
  full = "cpu_matrix_ingraph.md` (`python benchmarks/bench_topk.py --mode ingraph`)" if ingraph \
      else "cpu_matrix.md` (`python benchmarks/bench_topk.py`)"
  lines = [
      f"Soft top-k mask forward+backward (`jax.grad`) time divided by the hard mask's "
      f"forward time (`lax.top_k` + scatter), both jitted{how}; float32 N(0, 1) "
      f"scores; {meta.get('backend', '?')}, "
      f"{meta.get('cpu_count', '?')} cores, jax {meta.get('jax', '?')}, "
      f"{meta.get('date', '?')[:10]}, load average {(meta.get('loadavg_start') or ['?'])[0]} "
      f"at start. **Bold**: the default solver (`{default}`) above 2x. Full table: "
      f"`benchmarks/results/{full}.",
      "",
      "| cell | strength | hard fwd (ms) | " + " | ".join(c[0] for c in columns) + " |",
      "|:---|---:|---:|" + "---:|" * len(columns),
  ]
  for cell in result["cells"]:
    by = {r["contender"]: r for r in cell["records"]}
    hard = by.get("hard fwd")
    hard_text = _fmt_ms(hard["median_s"]) if hard and "median_s" in hard else _entry(hard)
    row = [cell["name"], f"{cell['l']:g}", hard_text]
    row += [_entry(by.get(key), bold) for _, key, bold in columns]
    lines.append("| " + " | ".join(row) + " |")
  return "\n".join(lines) + "\n"


def replace_block(text: str, block: str, name: str = BLOCKS["percall"]) -> str | None:
  """``text`` with the lines between the markers of ``name`` replaced by ``block``;
  None if the markers are missing or out of order."""
  start, end = markers(name)
  i = text.find(start)
  j = text.find(end, i + len(start)) if i >= 0 else -1
  if i < 0 or j < 0:
    return None
  return text[:i + len(start)] + "\n" + block.rstrip("\n") + "\n" + text[j:]


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("json", nargs="?", default=DEFAULT_JSON,
                  help="bench_topk.py's JSON (default benchmarks/results/cpu_matrix.json)")
  ap.add_argument("--write", metavar="FILE", default=None,
                  help=f"replace the block between {START} and {END} in FILE (the "
                  "bench-matrix-ingraph markers for an in-graph JSON)")
  ap.add_argument("--block", default=None,
                  help="name of the marker pair (default: bench-matrix, or "
                  "bench-matrix-ingraph for a JSON of --mode ingraph)")
  opts = ap.parse_args(argv)
  with open(opts.json) as f:
    result = json.load(f)
  block = table(result)
  name = opts.block or BLOCKS[result["meta"].get("mode", "percall")]
  if opts.write is None:
    sys.stdout.write(block)
    return 0
  with open(opts.write) as f:
    text = f.read()
  new = replace_block(text, block, name)
  if new is None:
    start, end = markers(name)
    print(f"{opts.write}: markers {start} ... {end} not found; nothing written",
          file=sys.stderr)
    return 1
  with open(opts.write, "w") as f:
    f.write(new)
  print(f"updated the {name} block of {opts.write} from {opts.json}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
