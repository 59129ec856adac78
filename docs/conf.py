"""Sphinx configuration of the implicit_topk documentation.

Build (from the repository root)::

    python -m sphinx -W --keep-going -b html docs docs/_build/html

Nothing is fetched at build time (no intersphinx inventories), so the build works
offline; MathJax is loaded by the reader's browser.
"""

from __future__ import annotations

import os
import sys

# The package is importable from the source checkout even without `pip install -e .`.
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

import implicit_topk  # noqa: E402  pylint: disable=wrong-import-position

project = "implicit_topk"
author = "the implicit_topk authors"
copyright = "the implicit_topk authors"  # pylint: disable=redefined-builtin
release = implicit_topk.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "myst_parser",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# Markdown pages: $...$ / $$...$$ math, ::: fences, heading anchors for cross-links.
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence"]
myst_heading_anchors = 3

# API pages: Google-style docstrings (Args / Returns / Example), signatures as written.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
autodoc_default_options = {"exclude-members": "__init__, __new__"}
add_module_names = False

html_theme = "alabaster"
html_title = f"implicit_topk {release}"
html_static_path: list[str] = []
html_theme_options = {
    "description": "Sparse, differentiable top-k, sort and rank operators for JAX",
    "page_width": "1100px",
    "sidebar_width": "240px",
}


# docs/softjax.md (the comparison with SoftJAX) is written separately. Until it exists,
# the blocks of docs/comparison.md between `<!-- softjax-page -->` and
# `<!-- /softjax-page -->` (its link and toctree entry) are left out, so the build
# passes with and without it.
_SOFTJAX_PAGE = os.path.exists(os.path.join(os.path.dirname(os.path.abspath(__file__)), "softjax.md"))


def _drop_softjax_blocks(app, docname, source):  # pylint: disable=unused-argument
  if docname != "comparison" or _SOFTJAX_PAGE:
    return
  import re  # pylint: disable=import-outside-toplevel
  source[0] = re.sub(r"<!-- softjax-page -->.*?<!-- /softjax-page -->", "", source[0], flags=re.S)


def setup(app):
  app.connect("source-read", _drop_softjax_blocks)
