"""Comments and docstrings in ``fastverify/`` stand on their own: none cites a file outside the
package (``STYLE.md``, ``../shared/...``, ``shared/research/...``) or a numbered issue of this
project's tracker. Public sources are fine (``SGLang 0.5.23 srt/...``, ``NVIDIA/nccl#1027``).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fastverify"
FORBIDDEN = re.compile(r"STYLE\.md|\.\./shared|shared/research|\bissue \d+", re.IGNORECASE)

# Files allowed to cite such documents: none.
_PENDING: frozenset[str] = frozenset()


def _texts(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring in ``source``."""
    out = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline)
           if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                out.append((body[0].lineno, body[0].value.value))
    return out


def _hits() -> dict[str, list[str]]:
    hits: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        for line, text in _texts(path.read_text(encoding="utf-8")):
            for m in FORBIDDEN.finditer(text):
                hits.setdefault(rel, []).append(f"{rel}:{line}: {m.group(0)!r}")
    return hits


def test_no_comment_cites_outside_files_or_issue_numbers():
    bad = [h for rel, found in _hits().items() if rel not in _PENDING for h in found]
    assert not bad, "comments/docstrings must stand on their own:\n" + "\n".join(bad)

