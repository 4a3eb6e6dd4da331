"""Every ```python block in docs/*.md runs: each file's blocks in order, in one
namespace, in a fresh process with 8 emulated CPU devices and a temp cwd."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def blocks(path: pathlib.Path) -> list[str]:
    return BLOCK.findall(path.read_text())


def run_doc(doc: pathlib.Path, tmp_path: pathlib.Path) -> None:
    code = "\n\n".join(f"# --- block {i}\n{b}" for i, b in enumerate(blocks(doc)))
    script = tmp_path / f"{doc.stem}.py"
    script.write_text(code)
    env = dict(os.environ)
    env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    run = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert run.returncode == 0, f"{doc.name} failed:\n{run.stdout[-3000:]}\n{run.stderr[-5000:]}"


# One class per page, `TestDoc_<page>::test_code_runs`: the integration session shares
# tests between its two workers with `--dist loadscope` (a module's functions on one
# worker, each class a unit of its own), so the pages, each its own process, run on
# both workers instead of as one ~11-minute unit.
def _page_test(doc: pathlib.Path) -> type:
    def test_code_runs(self, tmp_path):
        run_doc(doc, tmp_path)

    name = "TestDoc_" + re.sub(r"\W", "_", doc.stem)
    return type(name, (), {"test_code_runs": test_code_runs, "__doc__": f"docs/{doc.name}"})


for _doc in DOCS:
    if blocks(_doc):
        _cls = _page_test(_doc)
        globals()[_cls.__name__] = _cls


def test_every_doc_is_checked():
    assert DOCS, "docs/ has no pages"


CITED = re.compile(r"(?<![\w./-])((?:docs|examples|tools|tests|packages|\.ci)/[\w./-]*[\w/])")
QUOTED = re.compile(r"`([^`\n]+)`|\]\(([^)\s]+)\)")


def cited(text: str) -> set[str]:
    """Repository paths named in `code` spans and in link targets."""
    found = set()
    for code, link in QUOTED.findall(text):
        found.update(CITED.findall(code or link))
    return found


@pytest.mark.parametrize(
    "page",
    [*DOCS, ROOT / "README.md", *sorted(ROOT.glob("packages/*/README.md"))],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_every_cited_file_exists(page):
    """A guide never points at a file that is not in the repository (paths are
    taken from the repository root, or from the page's own folder)."""
    missing = sorted(
        path
        for path in cited(page.read_text())
        if not (ROOT / path).exists() and not (page.parent / path).exists()
    )
    assert not missing, f"{page.relative_to(ROOT)} cites files that do not exist: {missing}"
