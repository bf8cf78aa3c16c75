"""Task probes: small answer-checked sets that need no download.

Built-in sets are generated on the fly from a seed (multi-digit arithmetic, string manipulation,
date reasoning); every answer is computed exactly by Python. They are asked as a few-shot chain
(one solved example, then each question after the earlier ones with their answers) so that a
small model knows the answer format without spending tokens on a demonstration per item. Users bring their own as JSONL records {"prompt": ..., "answer": ...}:
the answer is the exact continuation of the prompt (lm-evaluation-harness's convention: a space
that ends the prompt moves to the answer). Local lm-evaluation-harness tasks are probes too
(harness_probe): one answer per document (loglikelihood, generate_until), or multiple choice,
where every choice is an item and a ChoiceQuestion says which items are one document's choices.

One registry, PROBE_SETS: adding a built-in probe is one entry here (the measures, the CLI's
choices and its help follow from it).
"""

from __future__ import annotations

import datetime
import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from layerplan.corpus import read_jsonl


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
class ChoiceQuestion:
    """One multiple-choice document: its choices are the probe's items first, first + 1, ...
    (each a context and that choice's continuation after it, as lm-evaluation-harness asks them).
    lengths: each choice's length in characters (lm-evaluation-harness's acc_norm divides the
    log-likelihood by it: the doc_to_choice text, without the target delimiter); gold: the
    indices of the right choices (one, or several for a task with multiple targets)."""

    first: int
    lengths: tuple[int, ...]
    gold: tuple[int, ...]


@dataclass(frozen=True)
class Probe:
    """Items to score. chained: one text asks them one after another, each after the ones
    before it with their answers (a few-shot chain that starts with `header`, one solved example):
    a prompt is a single question line, and no token is spent on a demonstration per item.
    Otherwise each item is scored on its own prompt. questions: a multiple-choice probe's
    documents (its items are their choices); empty for a probe of one answer per item."""

    name: str
    items: list[ProbeItem]
    chained: bool = False
    header: str = ""  # chained: the text before the first item
    separator: str = "\n"  # chained: the text after each answer
    questions: tuple[ChoiceQuestion, ...] = ()


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
    for number, record in read_jsonl(path):
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


HARNESS_TYPES = ("loglikelihood", "generate_until", "multiple_choice")  # the task output types a probe takes


def task_manager(names: list[str], include_path: str | None = None):
    """lm-evaluation-harness's TaskManager that knows every task (or group) in `names`: those in
    `include_path`, else built in. ValueError naming the unknown ones (and where it looked), or an
    empty list, or lm-eval not installed; made before any model loads."""
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise ValueError("lm-evaluation-harness is not installed: pip install 'layerplan[eval]'") from None
    if not names:
        raise ValueError("no task named: give lm-evaluation-harness task names, e.g. --tasks arc_easy")
    # the built-in index is thousands of YAML files: read it only when a task is not in include_path,
    # and only for names some built-in file spells out (an index names no task its files do not)
    manager = TaskManager(include_path=include_path, include_defaults=include_path is None) if include_path else None
    if manager is None or not set(names) <= set(manager.all_tasks):
        known = set(manager.all_tasks) if manager is not None else set()
        _refuse_unknown([name for name in names if name not in known and not _spelled_in_built_in_tasks(name)],
                        include_path)
        manager = _all_tasks(include_path)
    _refuse_unknown([name for name in names if name not in manager.all_tasks], include_path)
    return manager


def _refuse_unknown(unknown: list[str], include_path: str | None) -> None:
    if unknown:
        where = f" (in {include_path} or built in)" if include_path else ""
        raise ValueError(f"no lm-evaluation-harness task {', '.join(repr(n) for n in unknown)}{where}; "
                         "`lm_eval ls tasks` lists them")


def _spelled_in_built_in_tasks(name: str) -> bool:
    """Whether any file of lm-evaluation-harness's built-in tasks holds `name` as text: a byte scan
    of its ~14,000 files costs a small part of indexing them (each parsed as YAML; record 427), so
    a misspelt task is refused without that index."""
    return name.encode() in _built_in_task_text()


@lru_cache(maxsize=1)
def _built_in_task_text() -> bytes:
    """The built-in task files' bytes, one after another (a NUL between files)."""
    import lm_eval.tasks

    root = Path(lm_eval.tasks.__file__).parent
    return b"\0".join(path.read_bytes() for pattern in ("*.yaml", "*.yml", "*.py") for path in root.rglob(pattern))


@lru_cache(maxsize=4)
def _all_tasks(include_path: str | None):
    """TaskManager over the built-in tasks and include_path (indexing them takes seconds: once)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path)


def harness_probe(task_name: str, include_path: str | None = None, limit: int | None = None) -> Probe:
    """A local lm-evaluation-harness task as a probe, zero-shot, on its first `limit` test (else
    validation) documents, each context as lm-evaluation-harness makes it (description and the
    document's text). A loglikelihood task's item is lm-eval's own request (Task.construct_requests:
    the target as is, no delimiter); a generate_until task's answer is its target after the
    target delimiter (what greedy decoding should write). Multiple-choice tasks: every choice of
    every document is an item, its context and continuation lm-eval's request for it."""
    from lm_eval.tasks import get_task_dict

    manager = task_manager([task_name], include_path)
    try:
        tasks = get_task_dict([task_name], manager)
    except Exception as error:  # lm-eval checks the task's first document as it builds it (an index out of range...)
        raise ValueError(f"lm-evaluation-harness cannot build task {task_name}: {type(error).__name__}: {error}") from None
    task = tasks.get(task_name)
    if task is None or not hasattr(task, "OUTPUT_TYPE"):
        raise ValueError(f"'{task_name}' is a group of tasks or was not found; name one task")
    if task.OUTPUT_TYPE not in HARNESS_TYPES:
        raise ValueError(f"task {task_name} is {task.OUTPUT_TYPE}; a probe takes {', '.join(HARNESS_TYPES[:-1])} or "
                         f"{HARNESS_TYPES[-1]} tasks")
    docs = task.test_docs() if task.has_test_docs() else task.validation_docs()
    if docs is None:
        raise ValueError(f"task {task_name} has no test or validation documents")
    docs = list(docs)[:limit]
    if not docs:
        raise ValueError(f"task {task_name} has no documents")
    if task.OUTPUT_TYPE == "multiple_choice":
        return _choice_probe(task_name, task, docs)
    delimiter = getattr(task.config, "target_delimiter", " ")
    items = []
    for number, doc in enumerate(docs):
        context = task.fewshot_context(doc, 0)  # zero-shot: the task's description and the document's text
        if task.OUTPUT_TYPE == "loglikelihood":  # lm-eval's own request: its target as is, no delimiter
            items.append(ProbeItem(*map(str, task.construct_requests(doc, context,
                                                                     metadata=(task_name, number, 1)).args[:2])))
            continue
        target = task.doc_to_target(doc)  # generate_until: the answer greedy decoding should write
        target = target[0] if isinstance(target, list) else target
        items.append(ProbeItem(str(context), f"{delimiter}{target}"))
    return Probe(task_name, items)


def _choice_probe(task_name: str, task, docs: list) -> Probe:
    """A multiple_choice task's documents as ChoiceQuestions, read as lm-evaluation-harness's
    ConfigurableTask reads them (its construct_requests and process_results): the choices are
    doc_to_choice's, the right one doc_to_target's (an index, a choice's text, or a list of
    indices), or doc_to_text's where the choices are the contexts (multiple_input: Winogrande)."""
    config = getattr(task, "config", None)
    if config is None or getattr(config, "doc_to_choice", None) is None:
        raise ValueError(f"task {task_name} is multiple_choice without doc_to_choice; a probe reads a YAML task's "
                         f"doc_to_choice")
    if callable(getattr(config, "process_results", None)):
        raise ValueError(f"task {task_name} scores its choices with its own process_results; a probe scores "
                         f"multiple_choice tasks by lm-evaluation-harness's acc and acc_norm only")
    items, questions = [], []
    for number, doc in enumerate(docs):
        choices = [str(choice) for choice in task.doc_to_choice(doc)]
        where = f"task {task_name}, document {number}"
        if not choices or not all(choices):
            raise ValueError(f"{where}: choices {choices!r}; every choice needs text")
        context = task.fewshot_context(doc, 0)  # zero-shot: the task's description and the document's text
        requests = task.construct_requests(doc, context, metadata=(task_name, number, 1))
        # acc_mutual_info appends each choice without its context: not scored here
        pairs = [request.args[:2] for request in requests][: len(choices)]
        gold = task.doc_to_text(doc) if task.multiple_input else task.doc_to_target(doc)
        if isinstance(gold, str):
            gold = choices.index(gold) if gold in choices else gold
        golds = tuple(gold) if isinstance(gold, list) else (gold,)
        if not golds or not all(isinstance(g, int) and not isinstance(g, bool) and 0 <= g < len(choices)
                                for g in golds):
            raise ValueError(f"{where}: the answer {gold!r} is not one of its {len(choices)} choices "
                             f"(expected a choice's index or text)")
        questions.append(ChoiceQuestion(len(items), tuple(len(choice) for choice in choices), golds))
        items += [ProbeItem(str(context), str(continuation)) for context, continuation in pairs]
    return Probe(task_name, items, questions=tuple(questions))
