"""The README and docs/ link only to files inside the repository (issue 11: the design document lived outside
it), and the README links the design and the deployment guide."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def local_links(doc: Path) -> list[str]:
    """Markdown link targets that are not URLs, code blocks and spans left out."""
    text = re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", doc.read_text(), flags=re.S))
    return [t for t in LINK.findall(text) if not re.match(r"^[a-z]+://|^mailto:", t)]


def test_every_local_link_resolves_inside_the_repository():
    docs = [ROOT / "README.md", ROOT / "formal/README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    broken = []
    for doc in docs:
        for target in local_links(doc):
            path = (doc.parent / target).resolve()
            if not path.is_relative_to(ROOT) or not path.exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert broken == []


def test_readme_links_the_design_and_the_guide():
    links = set(local_links(ROOT / "README.md"))
    assert {"docs/design.md", "docs/kubernetes.md"} <= links
    assert "../shared" not in (ROOT / "README.md").read_text()
