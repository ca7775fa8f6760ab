"""Every repository path README.md and docs/*.md name exists, and the pages stay small.

What counts as a path (anything else is prose or an example, e.g. `runs/x`, `$OUT`, `~/.cache`):
- a markdown link's target that is not a URL or an anchor, relative to the page;
- a whitespace-separated word inside a `code span`, a fenced block or an indented line (4
  spaces: a code block, or a list's continuation) that starts with a
  top-level folder of the repository (`dormouse/`, `docs/`, `tests/`, ...), or with one of
  dormouse's sub-packages (`train/loop.py` is dormouse/train/loop.py), or a bare file name
  ending in .py or .md (then some file of the repository has that name). A `*` is a glob
  that must match; `::test_name` and `#anchor` suffixes are dropped.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: the folders a repository path can start with (fixed: a user's own runs/ is not one)
TOP = ("dormouse", "gates", "references", "tests", "docs", ".ci")
SUBPACKAGES = tuple(p.name for p in (ROOT / "dormouse").iterdir() if (p / "__init__.py").exists())
#: file names the pages use as examples of the user's files, not the repository's
EXAMPLES = {"notes.md"}
#: pages written by hand are read in a few minutes (status.md and mutations.md are generated)
GENERATED = {"status.md", "mutations.md"}
MAX_LINES = 250

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
_SPAN = re.compile(r"`([^`\n]+)`")
_INDENTED = re.compile(r"^    .*$", re.MULTILINE)


def _words(text: str) -> list[str]:
    blocks = _FENCE.findall(text)
    rest = _FENCE.sub("", text)
    chunks = blocks + _INDENTED.findall(rest) + _SPAN.findall(rest)
    return [w for chunk in chunks for w in chunk.split()]


def _candidate(word: str) -> str | None:
    """The repository path this word names, or None when it names none."""
    w = word.strip("'\"(),;:.[]{}<>|\\*")
    w = w.split("::", 1)[0].split("#", 1)[0].rstrip(":")
    if not w or "$" in w or w.startswith(("/", "~", "http")):
        return None
    first = w.split("/", 1)[0]
    if "/" in w and first in TOP:
        return w
    if "/" in w and first in SUBPACKAGES:
        return f"dormouse/{w}"
    if "/" not in w and re.fullmatch(r"[\w.-]+\.(py|md)", w) and w not in EXAMPLES:
        return f"**/{w}"
    return None


def _exists(path: str) -> bool:
    if path.startswith("**/"):
        return any(p.is_file() for p in ROOT.rglob(path[3:]) if ".git" not in p.parts)
    if "*" in path:
        return any(ROOT.glob(path))
    return (ROOT / path).exists()


def _missing(page: Path) -> list[str]:
    text = page.read_text()
    bad = []
    for target in _LINK.findall(text):
        if target.startswith(("http://", "https://", "mailto:", "#")):
            continue
        if not (page.parent / target.split("#", 1)[0]).exists():
            bad.append(f"link ({target})")
    for word in _words(text):
        path = _candidate(word)
        if path is not None and not _exists(path):
            bad.append(f"`{word}`")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_path_a_page_names_exists(page):
    assert not _missing(page), f"{page.relative_to(ROOT)} names paths that do not exist"


def test_the_check_sees_a_missing_path(tmp_path):
    page = tmp_path / "p.md"
    page.write_text(
        "see `bench/optim_bench.py`, [x](nothing.md) and `dormouse/train/loop.py`;"
        " not `runs/x` nor `$OUT/metrics.jsonl`\n```\npython docs/gone.png\n```\n"
        "\n    python -m dormouse compare docs/runs/a\n"
    )
    assert _missing(page) == [
        "link (nothing.md)",
        "`docs/gone.png`",
        "`docs/runs/a`",
        "`bench/optim_bench.py`",
    ]


def test_the_docs_are_small():
    files = [p for p in (ROOT / "docs").rglob("*") if p.is_file()]
    assert len(files) <= 20, f"docs/ holds {len(files)} files; raw outputs belong elsewhere"
    long = {
        p.name: n
        for p in PAGES
        if p.parent.name == "docs"
        and p.name not in GENERATED
        and (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"pages over {MAX_LINES} lines: {long}"
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_the_readme_has_one_generated_line_per_gate_of_the_status_table():
    readme = (ROOT / "README.md").read_text()
    begin, end = "<!-- status:begin -->", "<!-- status:end -->"
    lines = readme.split(begin, 1)[1].split(end, 1)[0].strip().splitlines()
    status = (ROOT / "docs" / "status.md").read_text()
    gates = list(dict.fromkeys(re.findall(r"^\| (g\d\d\w*) \|", status, re.MULTILINE)))
    assert [re.match(r"- \[`(\w+)`\]\(docs/status\.md\)", ln).group(1) for ln in lines] == gates


def test_gate_lines_say_both_verdicts():
    from gates.status import Record, gate_lines

    cpu = Record("g01_x", "a claim", "", "", "", True, env={"backend": "gloo", "device": "cpu"})
    gpu = Record("g01_x", "a claim", "", "", "", False,
                 env={"backend": "nccl", "device": "2x NVIDIA H200"})  # fmt: skip
    alone = Record("g02_y", "another", "", "", "", True, env={"backend": "none", "device": "cpu"})
    assert gate_lines([cpu, alone], [(gpu, True)]) == [
        "- [`g01_x`](docs/status.md): PASS (gloo); GPU: FAIL (nccl, 2x NVIDIA H200) STALE. a claim",
        "- [`g02_y`](docs/status.md): PASS (cpu); GPU: not run. another",
    ]


def test_ci_runs_the_readme_test_command_verbatim():
    """.ci/run runs the README's test command as the README prints it, so the two never drift."""
    readme = (ROOT / "README.md").read_text()
    command = next(ln for ln in readme.splitlines()
                   if ln.startswith("python3 -m pip install") and "pytest" in ln)  # fmt: skip
    assert command in (ROOT / ".ci" / "run").read_text().splitlines()
