"""The borders between rooms, read from docs/ARCHITECTURE.md ("Rooms and what each may import"): every import of
an engine module, at the top of a file or inside a function, is one its room's row allows, or one of the room's
own modules. The table is the specification; this test only reads it.

How the table is read: the first backticked path of the `room` cell names the room (`engine/ops`: the package and
everything under it; `engine/*.py`: the engine's top-level modules; `app/`); in the `may import` cell, every
backticked dotted path that starts with `engine` is an engine module or package the room may import (a package
allows its submodules). Everything else there is prose: third-party libraries, and what a room must never import.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ARCHITECTURE = REPO / "docs" / "ARCHITECTURE.md"
TABLE_TITLE = "## Rooms and what each may import"
TOP_LEVEL = "engine/*.py"

# Imports the table does not allow that the tree still has, as (importing module, imported module). Each is a
# border to fix, not a rule: remove an entry once its import is gone (the test fails on a stale entry too). None
# is left: the worker package ended the top level and engine/distributed importing each other.
KNOWN_VIOLATIONS: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Room:
    path: str                        # as the table names it: `engine/ops`, `engine/*.py`, `app/`
    allowed: tuple[str, ...]         # engine modules and packages it may import (dotted)

    def holds(self, module: str) -> bool:
        """Whether `module` (dotted) lives in this room."""
        if self.path == TOP_LEVEL:          # engine/__init__.py and the modules beside it, not the packages
            return module == "engine" or (module.count(".") == 1 and module.startswith("engine.")
                                          and not (REPO / "engine" / module.split(".")[1]).is_dir())
        package = self.path.rstrip("/").replace("/", ".")
        return module == package or module.startswith(package + ".")

    def allows(self, module: str) -> bool:
        return module == "engine" or self.holds(module) or any(
            module == a or module.startswith(a + ".") for a in self.allowed)


def read_rooms(text: str) -> list[Room]:
    """The rooms table of ARCHITECTURE.md's text."""
    section = text.split(TABLE_TITLE, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    rooms = []
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        path = re.findall(r"`([^`]+)`", cells[0])[0]
        names = (n.strip("/").removesuffix(".py").replace("/", ".") for n in re.findall(r"`([^`]+)`", cells[-1]))
        rooms.append(Room(path, tuple(n for n in names if n == "engine" or n.startswith("engine."))))
    return rooms


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def engine_imports(path: Path) -> set[str]:
    """The engine modules a file imports anywhere in it (top level, functions, TYPE_CHECKING blocks): for
    `from engine.a import b`, engine.a.b where that is a module, else engine.a."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "engine"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "engine":
            for alias in node.names:
                candidate = REPO.joinpath(*node.module.split("."), alias.name)
                is_module = candidate.with_suffix(".py").is_file() or (candidate / "__init__.py").is_file()
                found.add(f"{node.module}.{alias.name}" if is_module else node.module)
    return found


def python_files() -> list[Path]:
    return sorted(p for top in ("engine", "app", "proxy") for p in (REPO / top).rglob("*.py"))


def room_of(module: str, rooms: list[Room]) -> Room | None:
    holding = [r for r in rooms if r.holds(module)]
    return max(holding, key=lambda r: len(r.path), default=None)


def violations(rooms: list[Room], files: list[Path]) -> tuple[set[tuple[str, str]], list[str]]:
    """(importer, imported) pairs the table does not allow, and the modules in no room."""
    found, homeless = set(), []
    for path in files:
        module = module_name(path)
        room = room_of(module, rooms)
        if room is None:
            homeless.append(module)
            continue
        found |= {(module, imported) for imported in engine_imports(path) if not room.allows(imported)}
    return found, homeless


@pytest.fixture(scope="module")
def rooms() -> list[Room]:
    return read_rooms(ARCHITECTURE.read_text())


def test_the_table_names_the_rooms(rooms):
    paths = {r.path for r in rooms}
    assert {"engine/ops", "engine/model", "engine/inputs", "engine/core", TOP_LEVEL, "engine/server", "proxy/",
            "app/"} <= paths, paths


def test_every_import_is_one_its_rooms_row_allows(rooms):
    found, homeless = violations(rooms, python_files())
    assert not homeless, f"modules in no room of the table (add a row): {homeless}"
    new = sorted(found - KNOWN_VIOLATIONS)
    assert not new, "imports the rooms table does not allow (importer, imported):\n" + "\n".join(map(str, new))


def test_the_known_violations_are_still_there(rooms):
    """An entry of KNOWN_VIOLATIONS whose import is gone is removed, so that the list only shrinks."""
    found, _ = violations(rooms, python_files())
    assert not KNOWN_VIOLATIONS - found, sorted(KNOWN_VIOLATIONS - found)


def test_a_forbidden_import_is_caught(rooms, tmp_path):
    """The checker itself: ops importing the model, and the launcher importing the engine's runner, are refused;
    a room's own modules and its row's are not."""
    ops, app = room_of("engine.ops.linear", rooms), room_of("app.fit", rooms)
    assert not ops.allows("engine.model.linear") and ops.allows("engine.ops.triton.wna16")
    assert not app.allows("engine.runner") and app.allows("engine.sizing") and app.allows("app.checkpoints")
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from engine.model import linear\n    import engine.runner\n")
    assert engine_imports(bad) == {"engine.model.linear", "engine.runner"}
