"""Sphinx configuration: the API reference from the docstrings, and the docs/ pages."""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "hdm_optax"
author = "hdm_optax authors"
extensions = [
  "sphinx.ext.autodoc",
  "sphinx.ext.napoleon",
  "sphinx.ext.mathjax",
  "myst_parser",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3
autodoc_member_order = "bysource"
autodoc_typehints = "description"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
html_theme = "alabaster"
# Links to files outside docs/ (README.md, experiments/, results/) are
# repository links, not documents of this build.
suppress_warnings = ["myst.xref_missing"]
napoleon_use_ivar = True
# Methods inherited from other libraries (optimistix's minimiser interface)
# keep their own documentation there.
autodoc_inherit_docstrings = False
