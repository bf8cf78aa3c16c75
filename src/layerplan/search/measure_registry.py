"""The measures a block scan or a merge study scores plans on (search/measures.py scores them): one
registry, MEASURES, that the CLI's choices and help come from, data only (no torch), and the check
of a command's measures against its inputs before any model loads."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from layerplan.search.probes import PROBE_SETS


@dataclass(frozen=True)
class MeasureInputs:
    """What the measures read: calibration tokens, the user's files, probe size and seed."""

    tokens: int = 256
    text: str | None = None  # --text: a .txt or .jsonl file (or builtin:code)
    probe_file: str | None = None  # --probe-file: JSONL of {"prompt", "answer"}
    probe_items: int = 24
    seed: int = 0
    task: str | None = None  # --task: a local lm-evaluation-harness task (probes.HARNESS_TYPES)
    include_path: str | None = None  # --include-path: the folder of its YAML


@dataclass(frozen=True)
class Measure:
    name: str
    help: str
    direction: str  # "minimize" or "maximize"
    unit: str  # what its value is: "perplexity", "accuracy" or "log-likelihood"
    needs: str | None = None  # the MeasureInputs field (CLI option) it cannot do without
    probe: str | None = None  # probes: PROBE_SETS name, or "file"; measures of one probe share its scorer
    field: str = "exact"  # probes: the per-item number (ProbeAnswers field; CHOICE_FIELDS key)


def _probe_measures(probe: str, help: str, needs: str | None = None) -> list[Measure]:
    return [Measure(probe, f"probe: {help}; exact-match accuracy of greedy answers", "maximize", "accuracy", needs,
                    probe, "exact"),
            Measure(f"{probe}-ll", f"the {probe} probe's mean answer log-likelihood (nats per item)", "maximize",
                    "log-likelihood", needs, probe, "logprob")]


MEASURES = {m.name: m for m in (
    Measure("ppl", "perplexity on the built-in corpus (--tokens tokens)", "minimize", "perplexity"),
    Measure("text", "perplexity on your text (--text FILE, first --tokens tokens)", "minimize", "perplexity", "text"),
    *(m for name, probe in PROBE_SETS.items() for m in _probe_measures(name, probe.help)),
    *_probe_measures("file", 'your JSONL of {"prompt", "answer"} (--probe-file)', "probe_file"),
    Measure("task", "probe: a local lm-evaluation-harness task (--task NAME --include-path DIR; its first "
            "--probe-items documents); exact-match accuracy of greedy answers, or a multiple_choice task's acc",
            "maximize", "accuracy", "task", "task", "exact"),
    Measure("task-ll", "the task probe's mean answer log-likelihood (nats per item); of a multiple_choice task the "
            "mean margin of the right choice's log-likelihood over the best wrong one's", "maximize",
            "log-likelihood", "task", "task", "logprob"),
    Measure("task-norm", "a multiple_choice task's acc_norm: the right choice has the highest log-likelihood per "
            "character", "maximize", "accuracy", "task", "task", "norm"),
)}


def check_measures(names: list[str], inputs: MeasureInputs) -> None:
    """Unknown measures and missing inputs, named before any model is loaded."""
    for name in names:
        measure = MEASURES.get(name)
        if measure is None:
            raise ValueError(f"unknown measure '{name}'; choose from {', '.join(MEASURES)}")
        if measure.needs and getattr(inputs, measure.needs) is None:
            raise ValueError(f"the {name} measure needs --{measure.needs.replace('_', '-')}")
    for path in (inputs.text, inputs.probe_file):
        if path is not None and not str(path).startswith("builtin:") and not Path(path).exists():
            raise FileNotFoundError(f"{'probe' if path == inputs.probe_file else 'text'} file not found: "
                                    f"{Path(path).resolve()}")
