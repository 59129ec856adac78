#!/usr/bin/env bash
# Packaging check (also run by .ci/run): build the sdist and the wheel, check their
# metadata with twine, install the wheel into a fresh venv (not the checkout) and import
# it, print its version and run the command line's --help there.
#
#   .ci/check_package.sh            # uses `python` (the active venv, with build + twine)
#   PYTHON=.venv/bin/python .ci/check_package.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
tmp="$(mktemp -d "${TMPDIR:-/tmp}/implicit_topk_pkg.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT

# Without --sdist/--wheel, build makes the sdist and then the wheel from the unpacked sdist,
# so a file missing from the sdist shows up as a broken wheel.
echo "== build (sdist, then the wheel from it) into $tmp/dist"
"$PYTHON" -m build --outdir "$tmp/dist" . > "$tmp/build.log" 2>&1 \
  || { cat "$tmp/build.log"; exit 1; }
ls -l "$tmp/dist"
wheel="$(ls "$tmp"/dist/*.whl)"
sdist="$(ls "$tmp"/dist/*.tar.gz)"

echo "== contents"
"$PYTHON" - "$wheel" "$sdist" <<'PY'
import sys, tarfile, zipfile
wheel, sdist = sys.argv[1:]
names = zipfile.ZipFile(wheel).namelist()
need = ["implicit_topk/__init__.py", "implicit_topk/py.typed",
        "implicit_topk/kernels/cpu/__init__.py", "implicit_topk/kernels/cpu/native_threshold.py",
        "implicit_topk/kernels/gpu/__init__.py", "implicit_topk/kernels/gpu/pallas_threshold.py"]
missing = [n for n in need if n not in names]
missing += [] if any(n.endswith(".dist-info/licenses/LICENSE") for n in names) else ["LICENSE"]
meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
for line in ("License-Expression: Apache-2.0", "License-File: LICENSE"):
  if line not in meta:
    missing.append(f"METADATA line {line!r}")
leaked = [n for n in names if n.split("/")[0] in ("tests", "benchmarks", "proofs", "examples", "docs")]
snames = tarfile.open(sdist).getnames()
for suffix in ("/LICENSE", "/README.md", "/CHANGELOG.md", "/pyproject.toml", "/implicit_topk/py.typed"):
  if not any(n.endswith(suffix) for n in snames):
    missing.append(f"sdist {suffix}")
if missing or leaked:
  sys.exit(f"wheel/sdist check failed: missing {missing}, unexpected {leaked}")
print(f"wheel: {len(names)} files, py.typed and LICENSE present; sdist: {len(snames)} entries")
PY

echo "== twine check"
"$PYTHON" -m twine check --strict "$tmp"/dist/*

echo "== install the wheel into a fresh venv"
python3 -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install --quiet --disable-pip-version-check "$wheel"
# Run from the temp dir so that the checkout's implicit_topk/ cannot shadow the install.
(
  cd "$tmp"
  "$tmp/venv/bin/python" -c "import implicit_topk, sys; print('installed', implicit_topk.__version__, 'from', implicit_topk.__file__); sys.exit(0 if '/venv/' in implicit_topk.__file__ else 1)"
  # the default CPU kernel, built from the installed sources on first use
  "$tmp/venv/bin/python" -c "import jax.numpy as jnp, implicit_topk as itk; print('native mask', itk.soft_topk_mask(jnp.array([3.0, 1.0, 2.0]), 1.5, solver='native'))"
  "$tmp/venv/bin/implicit-topk" --help > "$tmp/help.txt"
  head -3 "$tmp/help.txt"
)
echo "check_package: OK"
