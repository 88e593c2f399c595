"""Every file path the docs and the code's comments name exists, so a moved file cannot leave stale pointers.

Checked: the Markdown files of the repository and the Python sources of `jaxserve/`, `planner/` and `modelspec/`
(comments, docstrings and messages alike). A path rooted at a folder of the repository (`jaxserve/...`,
`scripts/...`, `docs/...`, `tests/...`, `planner/...`, `modelspec/...`) must exist from the root; a shorter one
such as `runner/sampler.py` or `loops/sync.py` must be the tail of a file of the repository. Files outside the
repository are cited with `../`, e.g. ../shared/GUIDE.md; templates and globs (`docs/<topic>.md`, `*.cc`) are
not paths and are skipped.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOTED = ("jaxserve", "scripts", "docs", "tests", "planner", "modelspec")
# A run of path characters not preceded by one (so URLs' tails are not read as rooted paths).
TOKEN = re.compile(r"(?<![\w./~-])[\w.-]+(?:/[\w.<>*{}\[\]|-]+)+/?")
# Relative paths of source files; outputs (`reports/x.json`) are not in the tree.
SUFFIXES = (".py", ".md", ".sh", ".cc", ".h")
TEMPLATE_CHARS = set("<>*{}[]|")
# The team's guide and measurements sit beside the checkout, not in it: cited as ../shared/...
OUTSIDE = re.compile(r"(?<![\w./-])shared/(?:GUIDE\.md|measurements\b)[\w./-]*")


def tracked_files() -> list[str]:
    cmd = ["git", "ls-files", "--cached", "--others", "--exclude-standard"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout.splitlines()


def named_paths(text: str, folder_names: set[str]) -> list[str]:
    """The repository paths `text` names: rooted ones, and relative source files whose first folder is one of
    the repository's (so another project's `vllm/v1/...` is not read as ours)."""
    found = []
    for m in TOKEN.finditer(text):
        token = m.group(0).rstrip("./-")
        if TEMPLATE_CHARS & set(token) or token.startswith(".") or "://" in text[m.end():m.end() + 3]:
            continue
        first = token.split("/", 1)[0]
        if first in ROOTED or (first in folder_names and token.endswith(SUFFIXES)):
            found.append(token)
    return found


def missing_paths(text: str, files: list[str]) -> list[str]:
    """The paths `text` names that are not in `files` (or, rooted, not a folder of them), and in-tree citations
    of what lies outside the repository."""
    folders = {str(p) for f in files for p in Path(f).parents if str(p) != "."}
    folder_names = {Path(d).name for d in folders}
    missing = []
    for path in named_paths(text, folder_names):
        if path.split("/", 1)[0] in ROOTED:
            ok = path in files or path in folders
        else:
            ok = any(f == path or f.endswith("/" + path) for f in files)
        if not ok:
            missing.append(path)
    return missing + [m.group(0).rstrip(".") for m in OUTSIDE.finditer(text)]


def sources(files: list[str]) -> list[str]:
    py_roots = ("jaxserve/", "planner/", "modelspec/")
    return [f for f in files if f.endswith(".md") or (f.endswith(".py") and f.startswith(py_roots))]


def test_the_checker_tells_a_stale_path_from_a_live_one():
    files = ["jaxserve/runner/sampler.py", "jaxserve/model/llama.py", "docs/results.md", "scripts/gpu_step.sh"]
    text = ("see jaxserve/runner/sampler.py, runner/sampler.py, docs/results.md and `scripts/gpu_step.sh`; "
            "not jaxserve/model/sampler.py, model/sampler.py or shared/GUIDE.md; ../shared/GUIDE.md, "
            "docs/<topic>.md, jaxserve/kernels/cpu/*.cc, vllm/v1/worker.py, reports/a/b.json, a shared/exclusive lock "
            "and https://x.org/docs/a.md are no paths of ours")
    assert missing_paths(text, files) == ["jaxserve/model/sampler.py", "model/sampler.py", "shared/GUIDE.md"]


def test_every_path_the_docs_and_comments_name_exists():
    files = tracked_files()
    stale = {}
    for name in sources(files):
        text = (ROOT / name).read_text(encoding="utf-8")
        missing = missing_paths(text, files)
        if missing:
            stale[name] = sorted(set(missing))
    assert not stale, f"paths that name no file of the repository (moved or outside it: cite those as ../): {stale}"
