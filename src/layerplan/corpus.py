"""Evaluation text that needs no download: Python's own documentation topics, which ship with
every Python as `pydoc_data.topics`, Python source from the standard library (code-domain text),
plus readers for the user's own text and JSONL files."""

from __future__ import annotations

import json
from pathlib import Path

# A fixed selection, so every run and every machine measures on the same tokens.
DEFAULT_TOPICS = ("assignment", "class", "function", "for", "if", "while", "try", "with", "import",
                  "lambda", "numbers", "strings", "typesseq", "typesmapping", "exceptions", "execmodel")


def default_corpus() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name].strip() for name in DEFAULT_TOPICS if name in topics)


# Python source that ships with every Python: code-domain text for exit heads and calibration
CODE_MODULES = ("textwrap", "json.decoder", "json.encoder", "functools", "dataclasses", "argparse", "shlex",
                "fractions", "heapq", "bisect", "calendar", "difflib")


def code_corpus() -> str:
    import importlib.util

    sources = []
    for name in CODE_MODULES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            sources.append(Path(spec.origin).read_text())
    return "\n\n".join(sources)


BUILTIN = {"builtin:docs": default_corpus, "builtin:code": code_corpus}


def read_texts(path: str | Path, field: str = "text") -> list[str]:
    """A plain text file is one text; a .jsonl file gives one text per line (its `field`);
    builtin:docs (the default corpus) and builtin:code (Python standard-library source) need no file."""
    if str(path) in BUILTIN:
        return [BUILTIN[str(path)]()]
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"text file not found: {path.resolve()}")
    if path.suffix.lower() == ".jsonl":
        texts = []
        for number, record in read_jsonl(path):
            if not isinstance(record, dict) or field not in record:
                has = ", ".join(map(str, record)) if isinstance(record, dict) else f"a {type(record).__name__}"
                raise ValueError(f"{path}:{number}: no '{field}' field (has {has})")
            texts.append(str(record[field]))
        texts = [text for text in texts if text.strip()]
    else:
        texts = [text for text in [read_text_file(path)] if text.strip()]
    if not texts:
        raise ValueError(f"{path}: no text in it; give a file with some text"
                         + (f" (JSONL records with a '{field}' field)" if path.suffix.lower() == ".jsonl" else ""))
    return texts


def read_text_file(path: Path) -> str:
    """The file as UTF-8 text; anything else is one error naming the file. A pipe is read (for
    /dev/stdin), a device or socket refused (/dev/zero would never end)."""
    if path.exists() and not (path.is_file() or path.is_dir() or path.is_fifo()):
        raise ValueError(f"{path}: not a text file (a device or socket)")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text (byte {error.start}: {error.reason})") from None
    except IsADirectoryError:
        raise ValueError(f"{path}: a folder, not a text file") from None
    except OSError as error:
        raise ValueError(f"{path}: cannot read it ({error.strerror or error})") from None


def read_jsonl(path: Path) -> list[tuple[int, object]]:
    """(line number, record) of each non-blank line; a line that is not JSON gets one error
    naming the file and line."""
    records = []
    for number, line in enumerate(read_text_file(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append((number, json.loads(line)))
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number}: not valid JSON ({error.msg})") from None
    return records


def given_text(text: str | None) -> str | None:
    """--text read before any model loads (None: the caller's default corpus)."""
    return "\n\n".join(read_texts(text)) if text else None


def first_tokens(ids, tokens: int):
    """The first `tokens` of a calibration text's ids (a sequence); ValueError where it has fewer."""
    if len(ids) < tokens:
        raise ValueError(f"the calibration text has {len(ids)} tokens, fewer than the {tokens} asked for")
    return ids[:tokens]
