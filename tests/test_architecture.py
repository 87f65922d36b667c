"""The package map of docs/architecture.md is the law: every import between packages is one its line allows."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"^- `(?P<pkg>[\w/]+/)`.* owns .*; may import (?P<allowed>.*)\.$")
TOKEN = re.compile(r"`([\w/]+/)`|\bthe root\b|\bnothing\b")


def read_map() -> dict[str, set[str]]:
    """``{package dir: allowed package dirs}`` from the map's lines (``sync_service/`` is the root)."""
    rules = {}
    for line in (ROOT / "docs/architecture.md").read_text().splitlines():
        if m := LINE.match(line):
            allowed = set()
            for tok in TOKEN.finditer(m["allowed"]):
                if tok[1]:
                    allowed.add(tok[1])
                elif tok[0] == "the root":
                    allowed.add("sync_service/")
            rules[m["pkg"]] = allowed
    return rules


def package_of(module: str) -> str | None:
    """The map's package of a dotted module name; ``None`` for third-party modules."""
    parts = module.split(".")
    if parts[0] in ("protocols", "actors"):
        return parts[0] + "/"
    if parts[0] != "sync_service":
        return None
    if len(parts) > 1 and (ROOT / "sync_service" / parts[1]).is_dir():
        return f"sync_service/{parts[1]}/"
    return "sync_service/"


def imports(path: Path) -> list[tuple[str, int]]:
    """Absolute imports of a file (``from sync_service import x`` names ``sync_service.x``), with line numbers."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names] if node.module == "sync_service" else [node.module]
            out += [(n, node.lineno) for n in names]
    return out


def test_map_covers_every_package():
    rules = read_map()
    dirs = {"protocols/", "actors/", "sync_service/"} | {
        f"sync_service/{d.name}/" for d in (ROOT / "sync_service").iterdir() if (d / "__init__.py").is_file()}
    assert set(rules) == dirs, f"packages without a map line: {sorted(dirs - set(rules))}; " \
                               f"map lines without a package: {sorted(set(rules) - dirs)}"


def test_every_import_is_allowed_by_the_map():
    rules = read_map()
    bad = []
    for path in sorted(p for top in ("protocols", "actors", "sync_service") for p in (ROOT / top).rglob("*.py")):
        rel = path.relative_to(ROOT)
        me = package_of(".".join(rel.with_suffix("").parts))
        for module, lineno in imports(path):
            target = package_of(module)
            if target is not None and target != me and target not in rules[me]:
                bad.append(f"{rel}:{lineno} imports {module} ({me} may not import {target})")
    assert not bad, "imports the map of docs/architecture.md does not allow:\n" + "\n".join(bad)


def test_map_rejects_a_forbidden_import(tmp_path):
    """The checker itself: a rule without ``sync_service/entrypoints/`` flags a core → entrypoints import."""
    assert "sync_service/entrypoints/" not in read_map()["sync_service/merge/"]
    src = tmp_path / "m.py"
    src.write_text("from sync_service.entrypoints.cli import main\n")
    (module, _), = imports(src)
    assert package_of(module) == "sync_service/entrypoints/"


def test_root_holds_only_shared_modules():
    assert len(list((ROOT / "sync_service").glob("*.py"))) <= 7
