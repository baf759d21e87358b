"""Train the dummy models' byte-level BPE tokenizer (stack/engine/data/dummy_bpe.json).

    python scripts/train_dummy_tokenizer.py [--vocab 16384] [--out stack/engine/data/dummy_bpe.json]

The corpus is text every Python 3.11 install ships, so this runs offline and anywhere: the language
reference and library topics (English prose, `pydoc_data/topics.py`), the standard library's own
source (code), and, for the JSON that coding agents send, the stdlib's public functions written as
OpenAI-style tool schemas (name, docstring as description, parameters). Files are read in sorted
order and the trainer runs single-threaded, so the same Python version gives the same file; the
result is committed, so images never train at build time.

Specials and template are the engine's (stack/engine/tokenizer.py): <|bos|>, <|eos|>, the role
markers as special tokens, and the Hermes tool tags as ordinary added tokens (as Qwen2.5 has them).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from stack.engine.tokenizer import DUMMY_BPE_PATH, build_dummy_bpe  # noqa: E402

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SOURCE_BYTES = 6_000_000  # of stdlib source: enough code for the merges, a training run of a minute on one core
SCHEMA_MODULES = ("os", "os.path", "shutil", "subprocess", "json", "re", "pathlib", "asyncio", "socket", "http.client",
                  "urllib.request", "urllib.parse", "collections", "itertools", "functools", "logging", "argparse",
                  "datetime", "time", "random", "statistics", "string", "textwrap", "difflib", "csv", "sqlite3",
                  "zipfile", "tarfile", "hashlib", "base64", "email.message", "threading", "tempfile", "glob", "fnmatch",
                  "inspect", "typing", "dataclasses", "enum", "math", "decimal", "fractions", "uuid", "secrets", "html")


def prose() -> Iterator[str]:
    """The language reference and library topics: English with code samples."""
    from pydoc_data.topics import topics

    for key in sorted(topics):
        yield topics[key]


def source() -> Iterator[str]:
    """Stdlib modules in sorted order, up to SOURCE_BYTES."""
    budget = SOURCE_BYTES
    for path in sorted(STDLIB.rglob("*.py")):
        rel = path.relative_to(STDLIB).parts
        if rel[0] in ("site-packages", "test", "idlelib", "lib2to3", "pydoc_data") or "tests" in rel:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        yield text
        budget -= len(text)
        if budget <= 0:
            return


def tool_schemas() -> Iterator[str]:
    """Public stdlib functions as OpenAI / Anthropic tool schemas, pretty and compact, one module at a time."""
    for name in SCHEMA_MODULES:
        module = importlib.import_module(name)
        tools = []
        for attr in sorted(dir(module)):
            fn = getattr(module, attr)
            if attr.startswith("_") or not callable(fn) or not inspect.getdoc(fn):
                continue
            try:
                params = list(inspect.signature(fn).parameters.values())
            except (TypeError, ValueError):
                continue
            props = {p.name: {"type": "string" if p.default is inspect.Parameter.empty or isinstance(p.default, str) else
                              type(p.default).__name__.replace("NoneType", "null").replace("int", "integer").replace("bool", "boolean"),
                              "description": f"The {p.name.replace('_', ' ')} argument of {name}.{attr}."} for p in params
                     if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
            required = [p.name for p in params if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
            tools.append({"name": f"{name}.{attr}", "description": inspect.getdoc(fn),
                          "input_schema": {"type": "object", "properties": props, "required": required,
                                           "additionalProperties": False, "$schema": "http://json-schema.org/draft-07/schema#"}})
        yield json.dumps(tools, indent=2)
        yield json.dumps([{"type": "function", "function": {**t, "parameters": t.pop("input_schema")}} for t in tools])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--out", type=Path, default=DUMMY_BPE_PATH)
    a = ap.parse_args()
    os.environ["RAYON_NUM_THREADS"] = "1"  # one thread: merge ties resolve in one order
    corpus = [*prose(), *tool_schemas(), *source()]
    tok = build_dummy_bpe(corpus, a.vocab)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(a.out))
    print(f"wrote {a.out}: {tok.get_vocab_size(with_added_tokens=True)} tokens from {sum(map(len, corpus))} characters "
          f"(Python {sys.version.split()[0]})")


if __name__ == "__main__":
    main()
