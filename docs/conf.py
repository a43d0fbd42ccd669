"""Sphinx configuration of quern's documentation site (``make docs`` builds it into ``site/``)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "_ext"))

project = "quern"
author = "the quern authors"
copyright = "2026, the quern authors"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "sphinxarg.ext",
    "quern_refs",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
exclude_patterns = ["_build"]

html_theme = "furo"
html_title = "quern"

napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
# The page's own headings make its table of contents, not every documented class and method (Sphinx's behaviour
# before 5.2): the reference pages list hundreds of objects, which made the sidebar a second index, and building
# those entries was half of the build's time (76 s -> 35 s of CPU on the project's 2-core machine).
toc_object_entries = False
nitpicky = True
# classes of other libraries that quern's classes derive from, without an inventory here
nitpick_ignore = [("py:class", "torch.utils.data.dataset.IterableDataset")]
