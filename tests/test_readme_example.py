"""The README's first python block runs, and prints what its comments say.

Every top-level expression of the block whose comment holds bracketed numbers
(``# [0. 0.0554 1. 0.9446]  ...``) is evaluated and compared with those numbers
(to 1e-3). The block runs in a fresh interpreter with JAX's defaults (float32, as a
newcomer runs it; the suite's conftest turns float64 on in this process). Also
checked: some soft mask shown is fractional and every gradient shown is non-zero, so
the example cannot drift back to a hard mask with zero gradients, and the block runs with
DeprecationWarning as an error (it uses the 0.2.0 names: ``regularization_strength``, not
``l``). Every python block of README.md, docs/operators.md and docs/scaling.md calls the
library with the 0.2.0 names (scanned here; tests/test_readme_blocks.py runs every README
block, docs/scaling.md's fragments need 8 devices and free names).
"""

import io
import json
import os
import pathlib
import re
import subprocess
import sys
import tokenize

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS_WITH_CODE = (README, ROOT / "docs" / "operators.md", ROOT / "docs" / "scaling.md")

# Runs the block statement by statement; prints [{"line", "src", "values"}] for the expressions.
_RUNNER = r"""
import ast, json, sys
import numpy as np
import jax

code = sys.stdin.read()
env, out = {}, []
for stmt in ast.parse(code).body:
    src = ast.get_source_segment(code, stmt)
    if isinstance(stmt, ast.Expr):
        value = eval(compile(ast.Expression(stmt.value), "<README>", "eval"), env)
        leaves = [np.asarray(v, dtype=np.float64).ravel() for v in jax.tree_util.tree_leaves(value)]
        dtypes = sorted({str(np.asarray(v).dtype) for v in jax.tree_util.tree_leaves(value)})
        out.append({"line": stmt.end_lineno, "src": src, "dtypes": dtypes,
                    "values": np.concatenate(leaves).tolist() if leaves else []})
    else:
        exec(compile(ast.Module([stmt], []), "<README>", "exec"), env)
print(json.dumps(out))
"""


def first_python_block(text):
  blocks = python_blocks(text)
  assert blocks, "README.md has no ```python block"
  return blocks[0]


def python_blocks(text):
  """The code of every ```python block (indented ones too, with the indent removed)."""
  out = []
  for m in re.finditer(r"^([ \t]*)```python\n(.*?)^\1```", text, flags=re.S | re.M):
    indent = m.group(1)
    out.append("".join(line[len(indent):] if line.startswith(indent) else line
                       for line in m.group(2).splitlines(keepends=True)))
  return out


# Keyword arguments deprecated in 0.2.0 (removed in 0.3.0): the strength `l=` and soft_sort's `topk=`.
_DEPRECATED_KWARG = re.compile(r"[(,]\s*(l|topk)\s*=(?!=)")


def comments_by_line(code):
  """{line number: comment text} for every comment of the block."""
  out = {}
  for tok in tokenize.generate_tokens(io.StringIO(code).readline):
    if tok.type == tokenize.COMMENT:
      out[tok.start[0]] = tok.string
  return out


def shown_numbers(comment):
  """The numbers inside the square brackets of a comment ([] if it shows none)."""
  groups = re.findall(r"\[([^\]]*)\]", comment)
  return [float(v) for g in groups for v in re.findall(r"-?\d+(?:\.\d*)?(?:e-?\d+)?", g)]


def run_block(code):
  env = dict(os.environ, JAX_ENABLE_X64="0", JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
  proc = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", _RUNNER], input=code, capture_output=True, text=True,
                        env=env, cwd=README.parent, timeout=120)
  assert proc.returncode == 0, f"the README block fails:\n{proc.stderr[-3000:]}"
  return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # 13 s: a fresh interpreter runs the block (CI's slow group runs it)
def test_readme_first_block_matches_its_comments():
  code = first_python_block(README.read_text())
  comments = comments_by_line(code)
  results = run_block(code)
  checked = 0
  fractional_masks, gradients = [], []
  for r in results:
    shown = shown_numbers(comments.get(r["line"], ""))
    if "float64" in r["dtypes"]:
      raise AssertionError(f"{r['src']!r} ran in float64; the README shows the float32 default")
    if shown:
      assert len(shown) == len(r["values"]), (r["src"], shown, r["values"])
      np.testing.assert_allclose(r["values"], shown, atol=1e-3, rtol=0, err_msg=r["src"])
      checked += 1
    values = np.asarray(r["values"])
    if "soft_topk_mask" in r["src"] and not re.search(r"\bjax\.(grad|jvp|vjp|jacobian)", r["src"]):
      if np.any((values > 0) & (values < 1)):
        fractional_masks.append(r["src"])
    if re.search(r"\bjax\.(grad|jvp|vjp)", r["src"]):
      gradients.append(r["src"])
      assert np.any(values != 0), f"the README shows a zero derivative: {r['src']!r}"
  assert checked >= 5, f"only {checked} README lines show their values"
  assert fractional_masks, "no soft mask in the README example has an entry strictly in (0, 1)"
  assert len(gradients) >= 2, "the README example should show a reverse and a forward derivative"


def test_shown_numbers():
  assert shown_numbers("# [0. 0.0554 1. 0.9446]  fractional, still sparse") == [0, 0.0554, 1, 0.9446]
  assert shown_numbers("# [0. 0. 1. 1.], [-5. 0. 3. 0.]  hard") == [0, 0, 1, 1, -5, 0, 3, 0]
  assert shown_numbers("# real k (p = 2), no values") == []


def test_code_blocks_use_the_0_2_names():
  for path in DOCS_WITH_CODE:
    blocks = python_blocks(path.read_text())
    assert blocks, f"{path.name} has no ```python block"
    for code in blocks:
      for line in code.splitlines():
        assert not _DEPRECATED_KWARG.search(line), (
            f"{path.name} calls the library with a deprecated keyword (use "
            f"regularization_strength= / k=): {line.strip()!r}")


def test_deprecated_keyword_pattern():
  assert _DEPRECATED_KWARG.search("itk.soft_topk_mask(x, k=2, l=1e-2)")
  assert _DEPRECATED_KWARG.search("soft_sort(x, topk=3)")
  assert _DEPRECATED_KWARG.search("f(x,l = 0.1)")
  assert not _DEPRECATED_KWARG.search("soft_topk_mask(x, 2, regularization_strength=0.1)")
  assert not _DEPRECATED_KWARG.search("jax.jit(lambda z: z)(x)  # l == 1")
