"""The README's and the docs' code blocks, as tests/test_docs.py checks them: each fenced ``python`` or
``yaml`` block, and each command of a ``bash`` block (continuation lines joined, comments dropped)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md")),
             "recipes/tree/README.md", "recipes/yaml/README.md", "benchmarks/README.md"]


@dataclass(frozen=True)
class Block:
    file: str
    kind: str   # "python", "yaml" or "command"
    text: str

    @property
    def key(self) -> tuple[str, str]:
        return self.file, self.text if self.kind == "command" else self.text.strip().splitlines()[0]


def commands(body: str) -> list[str]:
    """A bash block's commands: continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", body)
    out = []
    for line in joined.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line and not line.startswith("#"):
            out.append(re.sub(r"\s+", " ", line))
    return out


def doc_blocks() -> list[Block]:
    found = []
    for name in DOC_FILES:
        text = (ROOT / name).read_text()
        for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, re.M | re.S):
            if lang == "python":
                found.append(Block(name, "python", body))
            elif lang == "yaml":
                found.append(Block(name, "yaml", body))
            elif lang in ("bash", "sh", "shell"):
                found += [Block(name, "command", c) for c in commands(body)]
            elif lang == "" and re.match(r"\s*(python|rlflow|torchrun|pip)\b", body):
                found += [Block(name, "command", c) for c in commands(body)]  # an untagged block of commands
    return found


BLOCKS = doc_blocks()
