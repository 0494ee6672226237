"""MkDocs hook: the site's home page is README.md itself, so the two never drift apart.

README.md links to the pages as ``docs/PAGE.md``, which is right from the repository's top
level; on the site the home page sits beside the pages, so those links lose their ``docs/``.
MkDocs then checks the links and anchors of the README like those of any page.
"""

from __future__ import annotations

import os
import re

HOME = "index.md"


def on_page_read_source(page, config):
    if page.file.src_uri != HOME:
        return None
    readme = os.path.join(os.path.dirname(config.config_file_path), "README.md")
    with open(readme, encoding="utf-8") as f:
        return re.sub(r"\]\(docs/", "](", f.read())
