"""Command line: ``implicit-topk {demo,figure,bench,check}`` (also ``python -m implicit_topk``).

* ``demo``: the README's first command: the soft top-k mask next to the hard one, the
  top-k in magnitude, a soft sort and rank, a loss and its gradient, and a timing table;
* ``figure``: writes the operator figure (``./implicit_topk_figure.png`` by default);
* ``bench``: runs ``benchmarks/bench_topk.py`` with a progress bar (options after
  ``bench`` are passed through, e.g. ``implicit-topk bench --quick``); writes into
  ``./implicit_topk_bench/`` by default;
* ``check``: runs the proofs' checking scripts (``proofs/*.py``) and prints a
  pass/fail table; the exit code is 1 if any fails.

Outputs go to the current directory unless ``--out`` says otherwise: the results committed
in the checkout (``docs/operator_figure.png``, ``benchmarks/results/``) change only when
``--out`` names them. ``bench`` and ``check`` need the source checkout (``benchmarks/``,
``proofs/``), found next to the package, in the current directory, or given by ``--repo``.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import warnings

FIGURE_OUT = os.path.join(".", "implicit_topk_figure.png")
BENCH_OUT = os.path.join(".", "implicit_topk_bench") + os.sep

_EPILOG_BENCH = """\
Every option not listed above is passed to benchmarks/bench_topk.py, e.g.
  implicit-topk bench --quick
  implicit-topk bench --sizes 1e3,1e4 --batches 1 --solvers threshold --out /tmp/bench
Run `implicit-topk bench --bench-help` for the benchmark's own options.
Writes ./implicit_topk_bench/<backend>_matrix[_<tag>].{md,json,png} (in the current
directory) by default; --out PATH writes PATH.{md,json,png} (or, for an existing directory
or a PATH ending in /, the same names inside it). The results committed in the checkout
(benchmarks/results/) change only with an explicit --out benchmarks/results/."""


def _parser():
  parser = argparse.ArgumentParser(
      prog="implicit-topk",
      description="Sparse, differentiable top-k operators for JAX: demo, figure, "
                  "benchmarks and proof checks.",
      epilog="Run `implicit-topk <command> --help` for the options of each command.")
  commands = parser.add_subparsers(dest="command", required=True, metavar="command")

  demo = commands.add_parser(
      "demo", help="a tour: soft vs hard top-k, magnitude, sort and rank, a loss, timings",
      description="Prints the soft top-k mask next to the hard one on a small vector "
                  "(a fractional entry with a non-zero gradient), the top-k in "
                  "magnitude, a soft sort and a soft rank, a top-k loss with its gradient, "
                  "and a timing table (soft forward+backward against the hard lax.top_k "
                  "mask forward: repeats, median, interquartile range, load average). "
                  "The operators are those of Sander et al. (2023), 'Fast, differentiable "
                  "and sparse top-k: a convex analysis perspective', ICML. Under a minute "
                  "on 2 CPU cores.")
  demo.add_argument("--no-timing", action="store_true", help="skip the timing table")

  fig = commands.add_parser(
      "figure", help="write the operator figure (PNG)",
      description="For k = 2 and x(s) = (3, 1, -1 + s, s), plots "
                  "topkmask(x(s))_2 + topkmask(x(s))_3 against s for the hard operator "
                  "and soft_topk_mask with p = 2 (kinks) and p = 4/3 (smooth), and the "
                  "same for the top-k in magnitude (second panel).",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  fig.add_argument("--out", default=FIGURE_OUT,
                   help="output PNG path (the committed figure is docs/operator_figure.png: "
                        "pass it explicitly to regenerate it)")
  fig.add_argument("--regularization-strength", type=float, default=1.0,
                   dest="regularization_strength",
                   help="regularization strength of the soft operators")
  # Deprecated alias of --regularization-strength (0.1.x); hidden from the help.
  fig.add_argument("--l", type=float, default=None, dest="l", help=argparse.SUPPRESS)
  fig.add_argument("--num", type=int, default=801, help="number of values of s")
  fig.add_argument("--s-range", type=float, nargs=2, default=(-2.0, 6.0),
                   metavar=("SMIN", "SMAX"), help="range of s")
  fig.add_argument("--dpi", type=int, default=120, help="PNG resolution")

  bench = commands.add_parser(
      "bench", help="run the benchmark suite (progress bar, Markdown/JSON/PNG report)",
      description="Times soft_topk_mask (pav, threshold, dykstra) against the hard "
                  "lax.top_k mask, jnp.sort and jaxopt's projection, forward and "
                  "forward+backward, under jit (benchmarks/bench_topk.py).",
      epilog=_EPILOG_BENCH, formatter_class=argparse.RawDescriptionHelpFormatter,
      allow_abbrev=False)
  bench.add_argument("--out", default=BENCH_OUT,
                     help="output path without extension, or a directory (ending in /) "
                          "for <backend>_matrix[_<tag>].{md,json,png} (default: "
                          f"{BENCH_OUT})")
  bench.add_argument("--repo", default=None,
                     help="source checkout holding benchmarks/ (default: found "
                          "automatically)")
  bench.add_argument("--bench-help", action="store_true",
                     help="show benchmarks/bench_topk.py's own options and exit")

  check = commands.add_parser(
      "check", help="run the proofs' checking scripts, print a pass/fail table",
      description="Runs every proofs/*.py (each in its own Python process; files "
                  "starting with '_' are helpers) and prints a table of PASS/FAIL and "
                  "times. A script passes if it exits with 0 and its last line is "
                  "'<name>: OK'. Exit code 1 if any fails.",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  check.add_argument("--only", default=None,
                     help="comma-separated script names to run (e.g. limits,grad_topk)")
  check.add_argument("--list", action="store_true", help="list the scripts and exit")
  check.add_argument("--timeout", type=float, default=600.0,
                     help="seconds allowed per script")
  check.add_argument("--repo", default=None,
                     help="source checkout holding proofs/ (default: found automatically)")
  return parser


def _figure_strength(args) -> float:
  if args.l is not None:
    warnings.warn("implicit-topk figure: --l is deprecated, use --regularization-strength "
                  "(--l will be removed in 0.3.0)", DeprecationWarning, stacklevel=2)
    print("implicit-topk figure: --l is deprecated, use --regularization-strength",
          file=sys.stderr)
    return args.l
  return args.regularization_strength


def _cmd_figure(args):
  strength = _figure_strength(args)
  try:
    import matplotlib  # noqa: F401  (the figure's only dependency beyond the library's)
  except ImportError:
    print("implicit-topk figure: needs matplotlib, which is not installed: "
          "pip install matplotlib (or pip install \"implicit-topk[bench]\")", file=sys.stderr)
    return 2
  import jax
  jax.config.update("jax_enable_x64", True)
  from implicit_topk import figure
  # figure.make_figure takes regularization_strength= (0.2.0) or l= (0.1.x).
  params = inspect.signature(figure.make_figure).parameters
  name = "regularization_strength" if "regularization_strength" in params else "l"
  figure.make_figure(args.out, **{name: strength}, num=args.num,
                     s_range=tuple(args.s_range), dpi=args.dpi)
  print(f"wrote {args.out}")
  return 0


def _cmd_bench(args, rest):
  from implicit_topk import cli_tools
  if args.bench_help:
    rest = ["--help"]
  else:
    rest = list(rest) + ["--out", args.out]
  try:
    cli_tools.run_bench(rest, repo=args.repo)
  except FileNotFoundError as exc:
    print(f"implicit-topk bench: {exc}", file=sys.stderr)
    return 2
  except SystemExit as exc:  # the benchmark's argparse (--help or a bad option)
    return exc.code if isinstance(exc.code, int) else 0
  return 0


def _cmd_check(args):
  from implicit_topk import cli_tools
  try:
    root = cli_tools.repo_root(args.repo)
  except FileNotFoundError as exc:
    print(f"implicit-topk check: {exc}", file=sys.stderr)
    return 2
  names = cli_tools.discover_proofs(root)
  if args.list:
    print("\n".join(names))
    return 0
  if args.only:
    wanted = [n.strip().removesuffix(".py") for n in args.only.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in names]
    if unknown:
      print(f"implicit-topk check: unknown scripts {unknown}; available: {names}",
            file=sys.stderr)
      return 2
    names = wanted
  rows = []
  for i, name in enumerate(names, 1):
    print(f"[{i}/{len(names)}] {name} ...", end="", flush=True)
    ok, seconds, detail = cli_tools.run_check(name, root, args.timeout)
    print(f" {'PASS' if ok else 'FAIL'} ({seconds:.1f}s)", flush=True)
    rows.append((name, ok, seconds, detail))
  print()
  print(cli_tools.check_table(rows))
  failed = [r[0] for r in rows if not r[1]]
  print(f"\n{len(rows) - len(failed)}/{len(rows)} passed"
        + (f"; failed: {', '.join(failed)}" if failed else ""))
  return 1 if failed else 0


def main(argv=None) -> int:
  parser = _parser()
  args, rest = parser.parse_known_args(argv)
  if rest and args.command != "bench":
    parser.error(f"unrecognized arguments: {' '.join(rest)}")
  if args.command == "demo":
    from implicit_topk import demo as demo_module
    demo_module.main(timing=not args.no_timing)
    return 0
  if args.command == "figure":
    return _cmd_figure(args)
  if args.command == "bench":
    return _cmd_bench(args, rest)
  return _cmd_check(args)


if __name__ == "__main__":
  sys.exit(main())
