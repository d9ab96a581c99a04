"""docs/architecture.md's map of the tree names every package and top-level module of jspec,
and nothing that is gone: the map is kept true by this test, not by memory."""

import os
import re

from support import REPO_ROOT


def test_the_map_names_every_package_and_nothing_more():
    with open(os.path.join(REPO_ROOT, "docs", "architecture.md")) as f:
        doc = f.read()
    tree = doc[doc.index("```\njspec/") : doc.index("```", doc.index("```\njspec/") + 3)]
    mapped = set(re.findall(r"^  ([\w.]+(?:/|\.py))", tree, re.M))
    mapped |= {m + ".py" for m in re.findall(r"^  ([\w]+)\.py, ", tree, re.M)}
    mapped |= set(re.findall(r", ([\w]+\.py) ", tree))
    root = os.path.join(REPO_ROOT, "jspec")
    actual = {n + "/" for n in os.listdir(root) if os.path.isfile(os.path.join(root, n, "__init__.py"))}
    actual |= {n for n in os.listdir(root) if n.endswith(".py") and n != "__init__.py"}
    assert actual - mapped == set(), "in jspec/ but not in docs/architecture.md"
    assert mapped - actual == set(), "in docs/architecture.md but not in jspec/"
