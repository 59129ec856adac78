"""Command line: ``python -m implicit_topk demo`` (also installed as ``implicit-topk``)."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      prog="implicit-topk", description="Sparse, differentiable top-k operators for JAX.")
  commands = parser.add_subparsers(dest="command", required=True)
  demo = commands.add_parser(
      "demo", help="print the seed examples, a gradient and a timing table",
      description="Runs soft_topk_mask on the reference README's inputs next to the hard "
                  "operators, prints gradients (reverse and forward mode) and times the "
                  "soft mask against the hard lax.top_k mask.")
  demo.add_argument("--no-timing", action="store_true", help="skip the timing table")
  args = parser.parse_args(argv)
  if args.command == "demo":
    from implicit_topk import demo as demo_module
    demo_module.main(timing=not args.no_timing)
  return 0


if __name__ == "__main__":
  sys.exit(main())
