"""Task probes: small answer-checked sets that need no download.

Built-in sets are generated on the fly from a seed (multi-digit arithmetic, string manipulation,
date reasoning); every answer is computed exactly by Python. They are asked as a few-shot chain
(one solved example, then each question after the earlier ones with their answers) so that a
small model knows the answer format without spending tokens on a demonstration per item. Users bring their own as JSONL records {"prompt": ..., "answer": ...}:
the answer is the exact continuation of the prompt (lm-evaluation-harness's convention: a space
that ends the prompt moves to the answer).

One registry, PROBE_SETS: adding a built-in probe is one entry here (the measures, the CLI's
choices and its help follow from it).
"""

from __future__ import annotations

import datetime
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ProbeItem:
    prompt: str
    answer: str  # the exact continuation (generated sets: " " + the answer)


@dataclass(frozen=True)
class ProbeSet:
    help: str
    question: Callable[[random.Random], tuple[str, str]]  # rng -> (prompt, answer without the leading space)


def _arithmetic(rng: random.Random) -> tuple[str, str]:
    op = rng.choice("+-*")
    if op == "*":
        a, b = rng.randint(12, 99), rng.randint(3, 99)
        return f"{a} * {b} =", str(a * b)
    a, b = rng.randint(10, 999), rng.randint(10, 999)
    if op == "-":
        a, b = max(a, b), min(a, b)
        return f"{a} - {b} =", str(a - b)
    return f"{a} + {b} =", str(a + b)


WORDS = ("apple", "river", "stone", "garden", "planet", "window", "silver", "basket", "candle", "forest",
         "number", "yellow", "bridge", "pencil", "summer", "market", "orange", "rocket", "winter", "travel")


def _strings(rng: random.Random) -> tuple[str, str]:
    kind = rng.choice(("reverse", "upper", "initials"))
    if kind == "reverse":
        word = rng.choice(WORDS)
        return f"Q: reverse {word}\nA:", word[::-1]
    if kind == "upper":
        word = rng.choice(WORDS)
        return f"Q: uppercase {word}\nA:", word.upper()
    words = rng.sample(WORDS, rng.randint(3, 4))
    return f"Q: initials of {' '.join(words)}\nA:", "".join(w[0] for w in words)


DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")


def _dates(rng: random.Random) -> tuple[str, str]:
    start = datetime.date(2000, 1, 1) + datetime.timedelta(days=rng.randint(0, 9000))
    kind = rng.choice(("after", "weekday", "between"))
    if kind == "after":
        days = rng.randint(2, 60)
        return f"Q: {days} days after {start.isoformat()}\nA:", (start + datetime.timedelta(days=days)).isoformat()
    if kind == "weekday":
        return f"Q: weekday of {start.isoformat()}\nA:", DAYS[start.weekday()]
    end = start + datetime.timedelta(days=rng.randint(2, 90))
    return f"Q: days from {start.isoformat()} to {end.isoformat()}\nA:", str((end - start).days)


PROBE_SETS = {
    "arithmetic": ProbeSet("multi-digit addition, subtraction and multiplication (exact answers)", _arithmetic),
    "strings": ProbeSet("string manipulation: reverse a word, capitalise it, join first letters", _strings),
    "dates": ProbeSet("date reasoning: a date N days later, the weekday of a date, days between two dates", _dates),
}


@dataclass(frozen=True)
class Probe:
    """Items to score. chained: one text asks them one after another, each after the ones
    before it with their answers (a few-shot chain that starts with `header`, one solved example):
    a prompt is a single question line, and no token is spent on a demonstration per item.
    Otherwise each item is scored on its own prompt."""

    name: str
    items: list[ProbeItem]
    chained: bool = False
    header: str = ""  # chained: the text before the first item
    separator: str = "\n"  # chained: the text after each answer


def generate_probe(name: str, count: int = 24, seed: int = 0) -> Probe:
    """`count` items of the built-in set `name`, the same for the same seed on every machine."""
    if name not in PROBE_SETS:
        raise ValueError(f"unknown probe set '{name}'; built-in: {', '.join(PROBE_SETS)}")
    if count < 1:
        raise ValueError(f"a probe needs at least one item, got {count}")
    rng = random.Random(f"{name}-{seed}")  # string seeds hash the same on every run and machine
    question = PROBE_SETS[name].question
    example, example_answer = question(rng)
    items = [ProbeItem(prompt, f" {answer}") for prompt, answer in (question(rng) for _ in range(count))]
    return Probe(name, items, chained=True, header=f"{example} {example_answer}\n")


def read_probe_file(path: str | Path) -> Probe:
    """JSONL records {"prompt": ..., "answer": ...}, one a line; bad records get one line naming
    the file and line."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"probe file not found: {path.resolve()}")
    items = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number}: not valid JSON ({error.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) \
                or not isinstance(record.get("answer"), str) or not record["answer"].strip():
            raise ValueError(f"{path}:{number}: expected {{\"prompt\": \"...\", \"answer\": \"...\"}} with a "
                             f"non-empty answer string")
        items.append(ProbeItem(record["prompt"], record["answer"]))
    if not items:
        raise ValueError(f"{path}: no probe records (expected JSONL lines with prompt and answer)")
    return Probe(path.name, items)


def encode_pair(tokenizer, context: str, continuation: str, prefix_token: int) -> tuple[list[int], list[int]]:
    """Token ids of context and continuation as lm-evaluation-harness makes them: trailing spaces
    of the context move to the continuation, and the continuation's ids are those of the whole
    minus the context's (so that the pair tokenizes as the whole text does)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    encode = tokenizer.encode
    if not context:
        return [prefix_token], encode(continuation, add_special_tokens=False)
    whole = encode(context + continuation, add_special_tokens=False)
    context_ids = encode(context, add_special_tokens=False)
    return context_ids, whole[len(context_ids):]


def prefix_token(tokenizer) -> int:
    """What an empty context starts from (lm-evaluation-harness's convention)."""
    return tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id


def harness_probe(task_name: str, include_path: str | None = None, limit: int | None = None) -> Probe:
    """A local lm-evaluation-harness task as a probe: each document's context (zero-shot) and its
    target after the task's target delimiter. Tasks that score one continuation (loglikelihood)
    or generate an answer (generate_until) fit; multiple-choice tasks rank choices instead."""
    try:
        from lm_eval.tasks import TaskManager, get_task_dict
    except ImportError:
        raise ValueError("lm-evaluation-harness is not installed: pip install 'layerplan[eval]'") from None
    # the built-in index is thousands of YAML files: read it only when the task is not in include_path
    manager = TaskManager(include_path=include_path, include_defaults=include_path is None)
    if task_name not in manager.all_tasks and include_path is not None:
        manager = TaskManager(include_path=include_path)
    if task_name not in manager.all_tasks:
        raise ValueError(f"no lm-evaluation-harness task '{task_name}'" + (f" (in {include_path} or built in)"
                                                                           if include_path else ""))
    tasks = get_task_dict([task_name], manager)
    task = tasks.get(task_name)
    if task is None or not hasattr(task, "OUTPUT_TYPE"):
        raise ValueError(f"'{task_name}' is a group of tasks or was not found; name one task")
    if task.OUTPUT_TYPE not in ("loglikelihood", "generate_until"):
        raise ValueError(f"task {task_name} is {task.OUTPUT_TYPE}; a probe takes loglikelihood or generate_until tasks")
    docs = task.test_docs() if task.has_test_docs() else task.validation_docs()
    if docs is None:
        raise ValueError(f"task {task_name} has no test or validation documents")
    delimiter = getattr(task.config, "target_delimiter", " ")
    items = []
    for doc in list(docs)[:limit]:
        target = task.doc_to_target(doc)
        target = target[0] if isinstance(target, list) else target
        items.append(ProbeItem(str(task.doc_to_text(doc)), f"{delimiter}{target}"))
    if not items:
        raise ValueError(f"task {task_name} has no documents")
    return Probe(task_name, items)
