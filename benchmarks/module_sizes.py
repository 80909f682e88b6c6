#!/usr/bin/env python3
"""How the package is grouped: module count, lines per module, modules per package, and the small
modules that only one other module imports (candidates to merge into the job they serve).

    python benchmarks/module_sizes.py [--small 130]

Lines count everything in the file (docstrings included). Importers are counted from every import
statement, function-level ones included, resolved as ``tests/test_house_rules.py`` resolves them.
"""

from __future__ import annotations

import argparse
import ast
import statistics
from collections import Counter, defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fastverify"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def importers(paths: dict[str, Path]) -> dict[str, set[str]]:
    """For each module, the other package modules that import it anywhere."""
    out: dict[str, set[str]] = defaultdict(set)
    for me, path in paths.items():
        pkg = me if path.name == "__init__.py" else me.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                names = {f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names}
            else:
                continue
            for name in names:
                if name in paths and name != me:
                    out[name].add(me)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", type=int, default=130, help="a module of at most this many lines is small")
    args = p.parse_args()
    paths = {module_name(f): f for f in sorted(PACKAGE.rglob("*.py"))}
    lines = {m: len(f.read_text(encoding="utf-8").splitlines()) for m, f in paths.items()}
    sizes = sorted(lines.values())
    print(
        f"{len(paths)} modules, {sum(sizes)} lines: mean {statistics.mean(sizes):.0f}, "
        f"median {statistics.median(sizes):.0f}, largest {sizes[-1]}"
    )
    per_package = Counter(m.rsplit(".", 1)[0] if paths[m].name != "__init__.py" else m for m in paths)
    print("modules per package: " + ", ".join(f"{k} {v}" for k, v in sorted(per_package.items())))
    users = importers(paths)
    lone = [m for m in paths if paths[m].name != "__init__.py" and lines[m] <= args.small and len(users[m]) == 1]
    print(f"{len(lone)} modules of {args.small} lines or fewer with one importer:")
    for m in sorted(lone):
        print(f"  {m} ({lines[m]} lines) <- {next(iter(users[m]))}")


if __name__ == "__main__":
    main()
