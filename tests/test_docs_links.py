"""The design lives in the repository: no file points outside it (``../shared``, a
``DESIGN.md`` that a clone or the wheel does not have), and every relative link in the README and
``docs/`` reaches a file of the repository."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEXT = (".py", ".md", ".sh", ".toml", ".cfg", ".txt")
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def _tracked():
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode == 0 and out.stdout.strip():
        return [ROOT / f for f in out.stdout.split()]
    return [p for p in ROOT.rglob("*") if ".venv" not in p.parts and ".git" not in p.parts]


def test_nothing_points_outside_the_repository():
    offenders = []
    this = Path(__file__).resolve()
    for path in _tracked():
        if path.suffix not in TEXT or not path.is_file() or path.resolve() == this:
            continue
        text = path.read_text(errors="replace")
        for needle in ("../shared", "DESIGN.md"):
            if needle in text:
                offenders.append(f"{path.relative_to(ROOT)}: {needle}")
    assert offenders == []


def test_relative_links_in_the_docs_resolve():
    broken = []
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        for target, _ in LINK.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).resolve().exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert broken == []
    assert "docs/architecture.md" in (ROOT / "README.md").read_text()
