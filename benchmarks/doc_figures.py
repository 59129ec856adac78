#!/usr/bin/env python
"""Every speed figure of README.md and docs/, from the committed results files.

The figures live between markers, and this script writes what is between them from
the JSON files of ``benchmarks/results/`` (and, for the examples' timings,
``examples/results/``):

* **blocks**: the lines between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->``, for
  ``NAME`` in :data:`BLOCKS` (the README's benchmark tables and the paragraph that sums
  them up, the comparison tables, ...);
* **inline figures**: the text between ``<!-- fig:SPEC -->`` and ``<!-- /fig -->``
  inside a sentence, where ``SPEC`` says where the figure comes from (``|``-separated):

  - ``ratio|STEM|CELL|CONTENDER``: the ratio (contender time / hard mask time) of a
    cell of ``bench_topk.py``'s JSON ``STEM.json``, as its tables print it (``1.75x``);
  - ``ms|STEM|CELL|CONTENDER``: that contender's median time (``4.08``, milliseconds);
  - ``value|STEM|PATH|FORMAT[|SCALE]``: any number of a results file: ``PATH`` is dotted,
    a list is indexed by position (``rows.0``) or by ``[key=value,...]`` (the one
    element with those fields);
    a key may contain dots (the longest matching key wins); the value, times ``SCALE``,
    is written with the Python format ``FORMAT``.

``python benchmarks/doc_figures.py`` rewrites every marked figure of README.md and
docs/**/*.md; ``--check`` writes nothing and exits with status 1 if any file differs
from what the results give (``tests/test_doc_figures.py`` runs the same comparison and
also fails on speed figures outside the markers). An unknown block name or a
specification that does not resolve is an error, never a silent blank.

Usage::

    python benchmarks/doc_figures.py            # rewrite the marked figures
    python benchmarks/doc_figures.py --check    # compare only
    python benchmarks/doc_figures.py --list     # the marked figures and their values
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
from typing import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import readme_table  # noqa: E402  (benchmarks/ is on sys.path)
from bench_topk import _fmt_ms, _fmt_ratio  # noqa: E402

RESULT_DIRS = (os.path.join(ROOT, "benchmarks", "results"), os.path.join(ROOT, "examples", "results"))
INLINE = re.compile(r"<!-- fig:(?P<spec>[^>]*?) -->(?P<text>.*?)<!-- /fig -->", re.S)
BLOCK = re.compile(r"<!-- (?P<name>[\w-]+):start -->\n(?P<body>.*?)<!-- (?P=name):end -->", re.S)


def doc_files(root: str = ROOT) -> list[str]:
  """README.md and every Markdown page under docs/."""
  files = [os.path.join(root, "README.md")]
  files += sorted(glob.glob(os.path.join(root, "docs", "**", "*.md"), recursive=True))
  return [f for f in files if os.path.isfile(f)]


def load_results(dirs=RESULT_DIRS) -> dict:
  """Every ``*.json`` of the results folders, by file stem."""
  results = {}
  for folder in dirs:
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
      stem = os.path.splitext(os.path.basename(path))[0]
      if stem in results:
        raise ValueError(f"two results files named {stem}.json")
      with open(path) as f:
        results[stem] = json.load(f)
  return results


# ---------------------------------------------------------------- lookups


def _source(results, stem):
  if stem not in results:
    raise KeyError(f"no results file {stem}.json in {', '.join(os.path.relpath(d, ROOT) for d in RESULT_DIRS)}")
  return results[stem]


def matrix_record(results, stem, cell, contender):
  """The record of ``contender`` in the cell named ``cell`` of a bench_topk.py JSON."""
  for c in _source(results, stem)["cells"]:
    if c["name"] == cell:
      for r in c["records"]:
        if r["contender"] == contender:
          return r
      raise KeyError(f"{stem}.json: cell {cell!r} has no contender {contender!r}")
  raise KeyError(f"{stem}.json: no cell {cell!r}")


def _select(node, part):
  match = re.fullmatch(r"(?P<key>[^\[\]]*)(?:\[(?P<filter>[^\]]*)\])?", part)
  if match is None:
    raise KeyError(f"bad path element {part!r}")
  if match["key"] and isinstance(node, list) and match["key"].isdigit():
    node = node[int(match["key"])]
  elif match["key"]:
    node = node[match["key"]]
  if match["filter"] is not None:
    conditions = dict(item.split("=", 1) for item in match["filter"].split(","))
    found = [e for e in node if all(str(e.get(k)) == v for k, v in conditions.items())]
    if len(found) != 1:
      raise KeyError(f"[{match['filter']}] selects {len(found)} elements, not one")
    node = found[0]
  return node


def _split_path(node, path):
  """The first element of a dotted ``path`` and the rest. A dict's key may hold dots
  itself (``"soft auto p=4/3"``, ``"lax.scan"``): the longest key of ``node`` that the
  path starts with, up to a dot or the end, wins."""
  if isinstance(node, dict):
    for end in sorted({i for i, ch in enumerate(path) if ch == "."} | {len(path)}, reverse=True):
      head = path[:end]
      key = re.sub(r"\[[^\]]*\]$", "", head)
      if key in node and (end == len(path) or path[end] == "."):
        return head, path[end + 1:]
  head, _, rest = path.partition(".")
  return head, rest


def value(results, stem, path):
  """The number at the dotted ``path`` of ``stem.json`` (see the module docstring)."""
  node = _source(results, stem)
  rest = path
  while rest:
    part, rest = _split_path(node, rest)
    try:
      node = _select(node, part)
    except (KeyError, IndexError, TypeError) as e:
      raise KeyError(f"{stem}.json: {path!r} does not resolve at {part!r} ({e})") from None
  return node


def inline_figure(spec: str, results) -> str:
  """The text of the inline figure ``<!-- fig:spec -->``."""
  kind, *args = spec.split("|")
  if kind == "ratio" and len(args) == 3:
    return _fmt_ratio(matrix_record(results, *args)["ratio"])
  if kind == "ms" and len(args) == 3:
    return _fmt_ms(matrix_record(results, *args)["median_s"])
  if kind == "value" and len(args) in (3, 4):
    stem, path, fmt = args[:3]
    scale = float(args[3]) if len(args) == 4 else 1.0
    return fmt.format(value(results, stem, path) * scale)
  raise ValueError(f"inline figure {spec!r}: expected ratio|STEM|CELL|CONTENDER, "
                   "ms|STEM|CELL|CONTENDER or value|STEM|PATH|FORMAT[|SCALE]")


# ---------------------------------------------------------------- blocks


def _range(values, fmt) -> str:
  lo, hi = min(values), max(values)
  lo_text, hi_text = fmt(lo), fmt(hi)
  return lo_text if lo_text == hi_text else f"{lo_text.rstrip('x')}-{hi_text}"


def _ratio_fmt(v):
  return f"{v:.2g}x" if v < 10 else f"{v:.0f}x"


def _default_ratios(result, p="4/3"):
  """{cell name: ratio of the default solver at p} for the cells where it ran."""
  default = result["meta"].get("default_solver", "auto")
  out = {}
  for cell in result["cells"]:
    for r in cell["records"]:
      if r["contender"] == f"soft {default} p={p}" and "ratio" in r:
        out[cell["name"]] = r["ratio"]
  return out


def bench_summary(results) -> str:
  """The README's paragraph under the two benchmark tables."""
  percall, ingraph = results["cpu_matrix"], results["cpu_matrix_ingraph"]
  runs = (percall, ingraph)
  loads = [(r["meta"].get("loadavg_start") or [float("nan")])[0] for r in runs]
  cores = percall["meta"].get("cpu_count", "?")
  ratios = [_default_ratios(r) for r in runs]
  cells = {c["name"]: c for c in percall["cells"]}
  above = [name for name in cells if any(rt.get(name, 0) > 2 for rt in ratios)]
  rows = [name for name in above if cells[name]["batch"] > 1]
  single = [name for name in above if cells[name]["batch"] == 1]

  def both(name):
    return (f"{_fmt_ratio(ratios[0][name])} per call, {_fmt_ratio(ratios[1][name])} "
            "in graph" if name in ratios[0] and name in ratios[1] else "")

  parts = []
  if rows:
    per_row = [matrix_record(results, "cpu_matrix", name, "hard fwd")["median_s"] / cells[name]["batch"]
               for name in rows]
    parts.append(", ".join(f"`{name}` ({both(name)})" for name in rows)
                 + f", where the hard mask costs {_range([t * 1e9 for t in per_row], lambda v: f'{v:.0f}')} "
                 "ns a row and the kernel's fixed work per row (bracket, a few Newton passes, "
                 "the mask write) does not fit in twice that (`python benchmarks/profile_native.py` "
                 "times each stage)")
  if single:
    parts.append(", ".join(f"`{name}` ({both(name)})" for name in single)
                 + ", single rows where the two custom calls' fixed cost is the time")
  large = [name for name, c in cells.items() if c["group"] == "large"]
  large_ratios = [rt[name] for rt in ratios for name in large if name in rt]
  faster = []
  for r in runs:
    for cell in r["cells"]:
      by = {x["contender"]: x for x in cell["records"]}
      a, t = by.get("soft auto p=4/3", {}), by.get("soft threshold p=4/3", {})
      if "median_s" in a and "median_s" in t:
        faster.append(t["median_s"] / a["median_s"])
  text = (f"From these two runs ({cores} cores, load average {min(loads):.2g} and "
          f"{max(loads):.2g} at start), the default solver (on CPU the native kernel) at "
          "`p = 4/3` is within 2x of the hard mask ")
  if parts:
    text += "in every cell but these: " + "; and ".join(parts) + ". "
  else:
    text += "in every cell. "
  if large_ratios:
    text += (f"On the large cells (from 64 x 1e5 entries) it takes "
             f"{_range(large_ratios, _ratio_fmt)} the hard mask's time; ")
  text += (f"in every cell it is {_range(faster, _ratio_fmt)} faster than the pure-JAX "
           "`\"threshold\"` solver.")
  return _wrap(text)


def _wrap(text: str, width: int = 90) -> str:
  words, lines, line = text.split(), [], ""
  for w in words:
    if line and len(line) + 1 + len(w) > width:
      lines.append(line)
      line = w
    else:
      line = f"{line} {w}" if line else w
  return "\n".join(lines + [line]) + "\n"


def _sort_records(results):
  return _source(results, "cpu_soft_sort")["records"]


def torchsort_table(results) -> str:
  """docs/comparison.md: soft_sort and soft_rank against torchsort."""
  recs = _sort_records(results)
  by = {(r["operator"], r["contender"], r["batch"], r["n"]): r for r in recs}
  shapes = []
  for r in recs:
    key = (r["batch"], r["n"])
    if r["operator"] in ("soft_sort", "soft_rank") and r["contender"] == "implicit_topk" and key not in shapes:
      shapes.append(key)
  lines = ["| operator | batch x n | `implicit_topk` (default) | `implicit_topk`, `solver=\"pav\"` "
           "| torchsort, 1 thread | torchsort, default threads |",
           "|---|---|---:|---:|---:|---:|"]
  for batch, n in shapes:
    for op in ("soft_sort", "soft_rank"):
      cells = [by.get((op, c, batch, n))
               for c in ("implicit_topk", "implicit_topk pav", "torchsort 1 thread", "torchsort")]
      if cells[0] is None:
        continue
      text = [f"{c['seconds'] * 1e3:.2f} ms" if c and c.get("seconds") else (c or {}).get("status", "—")
              for c in cells]
      lines.append(f"| `{op}` | {batch} x {n} | " + " | ".join(text) + " |")
  return "\n".join(lines) + "\n"


def ott_table(results) -> str:
  """docs/comparison.md: soft_topk_values against ott-jax's soft top-k sort."""
  recs = _sort_records(results)
  by = {(r["contender"], r["batch"], r["n"]): r for r in recs if r["operator"] == "soft_topk_values"}
  shapes = sorted({(b, n) for (c, b, n), r in by.items() if c == "ott-jax" and r.get("seconds")},
                  key=lambda s: (s[1], s[0]))
  lines = ["| batch x n | `implicit_topk` | ott-jax |", "|---|---:|---:|"]
  for batch, n in shapes:
    ours, ott = by[("implicit_topk", batch, n)], by[("ott-jax", batch, n)]
    lines.append(f"| {batch} x {n} | {ours['seconds'] * 1e3:.2f} ms | {ott['seconds'] * 1e3:.2f} ms |")
  return "\n".join(lines) + "\n"


def pav_summary(results) -> str:
  """docs/guides/choosing.md: the PAV solver's ratios in its committed run."""
  recs = _source(results, "cpu_pav_workqueue")["records"]
  soft = [r for r in recs if r["method"] == "soft pav p=4/3" and "fwd_bwd_ratio" in r]
  def pick(cond):
    return [r["fwd_bwd_ratio"] for r in soft if cond(r)]
  big = pick(lambda r: r["batch"] == 64 and r["n"] >= 10_000)
  mid = pick(lambda r: r["batch"] == 64 and r["n"] == 1000)
  single = pick(lambda r: r["batch"] == 1 and r["n"] <= 10_000)
  return _wrap(
      "`\"pav\"` is not in the current benchmark matrix; an earlier committed run "
      "(`benchmarks/results/cpu_pav_workqueue.md`: `k = n/100`, strength 0.1, a shared "
      f"2-core CPU) has its forward+backward at `p = 4/3` at {_range(big, _ratio_fmt)} the hard "
      f"mask for 64 rows of 1e4 or 1e5 entries, {_range(mid, _ratio_fmt)} for 64 rows of 1e3 "
      f"and {_range(single, _ratio_fmt)} on single rows of up to 1e4.")


def softjax_skipped(results) -> str:
  """docs/softjax.md: the SoftJAX calls the benchmark stopped timing, and why."""
  rows = _source(results, "softjax")["rows"]
  took = re.compile(r"one call took (?P<s>[\d.]+) s \(> (?P<limit>[\d.]+) s\)")
  limit, neural, pav = None, [], []
  for r in rows:
    m = took.fullmatch(r.get("skipped", ""))
    if not m:
      continue
    limit = float(m["limit"])
    shape = f"{r['b']} x {r['n']:,}"
    (pav if "fast_soft_sort" in r["contender"] else neural).append((float(m["s"]), shape))
  neural_timed = [f"{b} x {n:,}" for n, b in sorted({(r["n"], r["b"]) for r in rows
                   if "neuralsort" in r["contender"] and r.get("median_ms") is not None})]
  text = (f"SoftJAX's NeuralSort default is in the table where one call took under {limit:g} s "
          f"({', '.join(neural_timed)})")
  if neural:
    shapes = sorted({s for _, s in neural}, key=lambda s: [int(v.replace(',', '')) for v in s.split(' x ')])
    text += (f"; at {' and '.join(shapes)} one call took "
             f"{min(v for v, _ in neural):.1f} to {max(v for v, _ in neural):.1f} s and it was not "
             "timed further")
  text += ", and where `b n^2` exceeds 1e9 it was not run. "
  for seconds, shape in pav:
    text += (f"SoftJAX's PAV rank (`fast_soft_sort`, `c0`) took {seconds:.0f} s for one call at "
             f"{shape} and was not timed further: its PAV is a sequential `lax.fori_loop` with a "
             "nested `lax.while_loop`, vectorized over rows with `jax.vmap`. ")
  load = _source(results, "softjax")["meta"]
  loads = [load["load_start"][0], load["load_end"][0]] + [r["load_before"] for r in rows]
  text += (f"The load average ({min(loads):.0f} to {max(loads):.0f} on "
           f"{load['machine']['cores']} cores, from other jobs) inflates every absolute time.")
  return _wrap(text)


def topk_loss_strength(results) -> str:
  """docs/guides/choosing.md: examples/topk_loss_strength.py's table."""
  result = _source(results, "topk_loss_strength")
  lines = ["| loss | test top-1 | test top-5 | no gradient, start | no gradient, end |",
           "|:---|---:|---:|---:|---:|"]
  for r in result["summary"]:
    lines.append(f"| {r['method']} | {r['top1']:.3f} | {r['top5']:.3f} | "
                 f"{r['no_grad_start']:.0%} | {r['no_grad_end']:.0%} |")
  return "\n".join(lines) + "\n"


#: Block name -> function(results) -> the Markdown between the markers.
BLOCKS: dict[str, Callable[[dict], str]] = {
    "bench-matrix": lambda results: readme_table.table(results["cpu_matrix"]),
    "bench-matrix-ingraph": lambda results: readme_table.table(results["cpu_matrix_ingraph"]),
    "bench-summary": bench_summary,
    "torchsort-table": torchsort_table,
    "ott-table": ott_table,
    "pav-summary": pav_summary,
    "softjax-skipped": softjax_skipped,
    "topk-loss-strength": topk_loss_strength,
}


# ---------------------------------------------------------------- rendering


def render(text: str, results) -> str:
  """``text`` with every marked block and inline figure written from ``results``."""
  def block(m):
    name = m["name"]
    if name not in BLOCKS:
      raise KeyError(f"unknown figure block {name!r} (known: {', '.join(BLOCKS)})")
    body = BLOCKS[name](results)
    return f"<!-- {name}:start -->\n{body.rstrip(chr(10))}\n<!-- {name}:end -->"

  text = BLOCK.sub(block, text)
  return INLINE.sub(lambda m: f"<!-- fig:{m['spec']} -->{inline_figure(m['spec'], results)}<!-- /fig -->",
                    text)


def marked_spans(text: str) -> list[tuple[int, int]]:
  """The character spans of the marked blocks and inline figures of ``text``."""
  return [m.span() for m in BLOCK.finditer(text)] + [m.span() for m in INLINE.finditer(text)]


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--check", action="store_true", help="write nothing; status 1 if a file differs")
  ap.add_argument("--list", action="store_true", help="print every marked figure and its value")
  opts = ap.parse_args(argv)
  results = load_results()
  stale = []
  for path in doc_files():
    with open(path, encoding="utf-8") as f:
      text = f.read()
    new = render(text, results)
    rel = os.path.relpath(path, ROOT)
    if opts.list:
      for m in BLOCK.finditer(text):
        print(f"{rel}: block {m['name']}")
      for m in INLINE.finditer(new):
        print(f"{rel}: {m['text']}  <- {m['spec']}")
    if new != text:
      stale.append(rel)
      if not opts.check:
        with open(path, "w", encoding="utf-8") as f:
          f.write(new)
  verb = "differ from the results" if opts.check else "updated"
  print(f"{len(stale)} file(s) {verb}" + (f": {', '.join(stale)}" if stale else ""))
  return 1 if (opts.check and stale) else 0


if __name__ == "__main__":
  sys.exit(main())
