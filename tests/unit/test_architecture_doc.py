"""docs/architecture.md names real code, in the real order.

The page's notation (its "How code is named here"): `` `path/file.py`: `name` `` is a function, class, `Class.method` or
class field defined in that file; `` `path/file.py`: `f` → `a` → `b` `` says `f` calls (or hands on) `a`, then `b`,
in that order of the source. Bare file names (`` `kv_wire.py` ``) must exist under stack/ or doctor/."""

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
REF = re.compile(r"`(?P<path>[\w/]+\.py)`: `(?P<name>[\w.]+)`(?P<chain>(?:\s*→\s*`[\w.]+`)*)")
BARE_FILE = re.compile(r"`([\w]+\.py)`")

Position = tuple[int, int]


@cache
def _tree(path: str) -> ast.Module:
    return ast.parse((ROOT / path).read_text(), path)


def _definition(path: str, name: str) -> ast.AST | None:
    """The def/class `name` (or `Class.member`) at the top of `path`, or None."""
    scope: list[ast.stmt] = _tree(path).body
    found: ast.AST | None = None
    for part in name.split("."):
        found = None
        for node in scope:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == part:
                found = node
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == part:
                found = node
        if found is None:
            return None
        scope = found.body if isinstance(found, ast.ClassDef) else []
    return found


def _uses(function: ast.AST, name: str) -> list[Position]:
    """Where `function` mentions `name` (a call, or a function handed on as a value), by where the mention ends (a
    call: where the call ends), so nested calls `f(g(x))` come in the order they run. `a.b` matches `x.a.b` too."""
    ends = {id(node.func): node for node in ast.walk(function) if isinstance(node, ast.Call)}
    return sorted((end.end_lineno or 0, end.end_col_offset or 0)
                  for node in ast.walk(function)
                  if isinstance(node, (ast.Name, ast.Attribute)) and ((text := ast.unparse(node)) == name or text.endswith("." + name))
                  for end in [ends.get(id(node), node)])


def order_problem(function: ast.AST, chain: list[str]) -> str | None:
    """None if `function` mentions each of `chain` in that order (each after the one before), else what breaks it."""
    after: Position = (0, -1)
    for name in chain:
        later = [p for p in _uses(function, name) if p > after]
        if not later:
            return f"`{name}` is not used after line {after[0]}" if _uses(function, name) else f"`{name}` is not used at all"
        after = later[0]
    return None


def _text() -> str:
    """The page without its ``double-backtick`` spans: the notation's own examples name no code."""
    return re.sub(r"``.*?``", "", DOC.read_text())


def references() -> list[tuple[str, str, list[str]]]:
    text = _text()
    return [(m["path"], m["name"], re.findall(r"`([\w.]+)`", m["chain"])) for m in REF.finditer(text)]


def test_the_page_names_code_in_the_notation() -> None:
    """The check is not vacuous: the page follows the notation throughout, chains included."""
    refs = references()
    assert len(refs) >= 40 and sum(bool(chain) for _p, _n, chain in refs) >= 15


def test_every_named_function_exists_in_the_file_named() -> None:
    missing = [f"{path}: {name}" for path, name, _chain in references()
               if not (ROOT / path).is_file() or _definition(path, name) is None]
    assert not missing, "docs/architecture.md names code that is not there:\n" + "\n".join(missing)


def test_every_order_the_page_claims_is_the_order_of_the_code() -> None:
    wrong = []
    for path, name, chain in references():
        function = _definition(path, name) if (ROOT / path).is_file() else None
        if chain and function is not None and (problem := order_problem(function, chain)):
            wrong.append(f"{path}: {name} → {' → '.join(chain)}: {problem}")
    assert not wrong, "docs/architecture.md claims an order the code does not follow:\n" + "\n".join(wrong)


def test_every_file_named_exists() -> None:
    names = {p.name for pkg in ("stack", "doctor") for p in (ROOT / pkg).rglob("*.py")}
    missing = sorted(set(BARE_FILE.findall(_text())) - names)
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"


def test_a_claimed_order_that_the_code_does_not_follow_is_caught() -> None:
    """The OpenAI front end parses before it checks the OpenAI-only fields; the reverse claim fails."""
    handler = _definition("stack/router/api/openai.py", "chat_completions")
    assert handler is not None
    assert order_problem(handler, ["parse", "_check_chat_only"]) is None
    assert order_problem(handler, ["_check_chat_only", "parse"]) is not None
    assert _definition("stack/router/api/openai.py", "no_such_function") is None
