"""Measures that say "better", not "closer": perplexity on a text and exact-answer task probes,
each with a bootstrap interval and a paired interval of the change against the base plan.

Scoring many plans that start like the base plan (a repeated block i..j runs 0..j first) is
cheap: SharedPrefix keeps the base plan's residual stream before each of its steps, captured in
one pass per input batch, and a candidate runs only the steps after the prefix it shares.

One registry, MEASURES (the CLI's choices and help come from it); the built-in probes come
from probes.PROBE_SETS.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from layerplan.corpus import read_texts
from layerplan.engine.runner import Resume, head, run_hidden
from layerplan.models.loading import LoadedModel
from layerplan.plan.plan import LayerPlan
from layerplan.search.evaluate import calibration_ids, token_nll
from layerplan.search.measure_registry import MEASURES, MeasureInputs, check_measures
from layerplan.search.probes import (ChoiceQuestion, Probe, encode_pair, generate_probe, harness_probe,
                                     prefix_token, read_probe_file)


def shared_steps(plan: LayerPlan, base: LayerPlan) -> int:
    """How many leading steps `plan` runs exactly as `base` does."""
    count = 0
    for mine, theirs in zip(plan.active_steps, base.active_steps):
        if mine != theirs:
            break
        count += 1
    return count


class SharedPrefix:
    """The residual stream of many plans on fixed ids (B, T), each resumed from the base plan's
    stream before the first step where it differs, or from a stream a plan before it on this
    thread was asked to keep (hidden's `keep`) where that one goes further. reuse=False runs
    every plan from the embeddings (the naive baseline); the results are the same."""

    @torch.inference_mode()
    def __init__(self, model: LoadedModel, ids: torch.Tensor, base: LayerPlan, reuse: bool = True) -> None:
        self.model, self.ids, self.base, self.reuse = model, ids, base, reuse
        self.before: list[torch.Tensor] = []  # before[k]: the stream before base step k (after k steps)
        self._kept = threading.local()  # .stream: (the steps run, the stream after them), per thread
        if reuse:
            final = run_hidden(model, ids, base, observe=lambda index, sub, hidden: (
                self.before.append(hidden) if sub == "attention" else None))
            self.before.append(final)

    @torch.inference_mode()
    def hidden(self, plan: LayerPlan, keep: int | None = None) -> torch.Tensor:
        """The stream after the plan's steps. keep: also keep the stream before step `keep` for
        the next call on this thread, which resumes there if its plan starts with the same `keep`
        steps (a block repeated twice resumes after the first repeat of the block repeated once);
        every call forgets what the call before it kept."""
        if not self.reuse:
            return run_hidden(self.model, self.ids, plan)
        steps = plan.active_steps
        start = shared_steps(plan, self.base)
        resumed = self.before[start]  # the stream before step `start`
        kept = getattr(self._kept, "stream", None)
        if kept is not None and start < len(kept[0]) <= len(steps) and steps[: len(kept[0])] == kept[0]:
            start, resumed = len(kept[0]), kept[1]
        captured = [resumed] if keep == start else []  # the stream before step `keep`
        observe = None
        if keep is not None and start < keep < len(steps):
            def observe(index: int, sub_layer: str, hidden: torch.Tensor) -> None:
                if index == keep and sub_layer == "attention":
                    captured.append(hidden)
        stream = resumed
        if start < len(steps):  # else the base itself, an exit inside it, or a kept stream
            stream = run_hidden(self.model, None, plan, resume=Resume(resumed, start), observe=observe)
        if keep == len(steps) and start <= keep:
            captured.append(stream)
        self._kept.stream = (steps[:keep], captured[0]) if keep is not None and captured else None
        return stream


@dataclass(frozen=True)
class Units:
    """One plan's numbers on one measure, per resampling unit: the measure's value is
    summary(Σ values / Σ weights) (perplexity: exp of the mean NLL over tokens; accuracy: the
    mean over items)."""

    values: torch.Tensor  # (U,) float64
    weights: torch.Tensor  # (U,) float64
    detail: float | None = None  # probes: mean answer (multiple choice: right choice) log-likelihood per item (nats)


@dataclass(frozen=True)
class Score:
    """A plan's value on one measure, with a 95% bootstrap interval, and its change against
    the base plan on the same units (paired resampling: both plans see the same resample)."""

    measure: str
    value: float
    low: float
    high: float
    change: float  # value − the base plan's value
    change_low: float
    change_high: float
    detail: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


RESAMPLES = 1000


def bootstrap(measure: str, candidate: Units, base: Units, summary: Callable[[torch.Tensor], torch.Tensor],
              resamples: int = RESAMPLES, seed: int = 0) -> Score:
    """Percentile bootstrap (95%) over units. The same seed gives every candidate the same
    resamples, so that candidates are compared on equal footing."""
    count = candidate.values.numel()
    picks = torch.randint(0, count, (resamples, count), generator=torch.Generator().manual_seed(seed))
    weights = base.weights[picks].sum(1)

    def value(units: Units) -> tuple[float, torch.Tensor]:
        return (float(summary(units.values.sum() / units.weights.sum())),
                summary(units.values[picks].sum(1) / weights))

    point, samples = value(candidate)
    base_point, base_samples = value(base)
    quantiles = torch.tensor([0.025, 0.975], dtype=torch.float64)
    low, high = torch.quantile(samples, quantiles).tolist()
    change_low, change_high = torch.quantile(samples - base_samples, quantiles).tolist()
    return Score(measure, point, low, high, point - base_point, change_low, change_high, candidate.detail)


class PerplexityScorer:
    """Perplexity on fixed ids (1, T); resampling units are blocks of `block` consecutive tokens
    (neighbouring tokens are not independent)."""

    block = 16

    def __init__(self, model: LoadedModel, ids: torch.Tensor, base: LayerPlan, reuse: bool = True) -> None:
        self.model, self.ids, self.reuse = model, ids, reuse
        self.stream = SharedPrefix(model, ids, base, reuse)
        self.tokens = int(ids.shape[1])

    @staticmethod
    def summary(mean_nll: torch.Tensor) -> torch.Tensor:
        return torch.exp(mean_nll)

    @torch.inference_mode()
    def nll(self, plan: LayerPlan, keep: int | None = None) -> torch.Tensor:
        """(T-1,) float64 NLL of each next token under the plan (keep: see SharedPrefix.hidden)."""
        return token_nll(head(self.model, self.stream.hidden(plan, keep)), self.ids)[0].double()

    def units(self, plan: LayerPlan, keep: int | None = None) -> Units:
        nll = self.nll(plan, keep)
        starts = range(0, nll.numel(), self.block)
        return Units(torch.stack([nll[s : s + self.block].sum() for s in starts]),
                     torch.tensor([float(min(self.block, nll.numel() - s)) for s in starts], dtype=torch.float64))


@dataclass(frozen=True)
class ProbeAnswers:
    """Per item: exact (greedy decoding writes the answer and then stops the word: the next
    greedy token starts with neither a letter nor a digit, or ends the text), greedy (greedy
    decoding starts with the answer: lm-evaluation-harness's `acc` of a loglikelihood task) and
    logprob (the answer's log-likelihood, nats)."""

    exact: torch.Tensor  # (items,) bool
    greedy: torch.Tensor  # (items,) bool
    logprob: torch.Tensor  # (items,) float64


@dataclass(frozen=True)
class ChoiceAnswers:
    """Per multiple-choice question, as lm-evaluation-harness scores it from each choice's
    log-likelihood (its process_results): acc (the highest log-likelihood is a right choice's;
    of equal ones the first counts, as numpy's argmax), acc_norm (the same for log-likelihood
    per character of the choice), margin (the best right choice's log-likelihood minus the best
    wrong one's, nats: above 0 where acc holds, a smooth measure of it; 0 when every choice is
    right) and logprob (the best right choice's log-likelihood)."""

    acc: torch.Tensor  # (questions,) bool
    acc_norm: torch.Tensor  # (questions,) bool
    margin: torch.Tensor  # (questions,) float64
    logprob: torch.Tensor  # (questions,) float64

    @classmethod
    def of(cls, questions: tuple[ChoiceQuestion, ...], logprob: torch.Tensor) -> ChoiceAnswers:
        """From the log-likelihood of each item (the questions' choices in turn)."""
        acc, acc_norm, margin, right = [], [], [], []
        for question in questions:
            lls = logprob[question.first : question.first + len(question.lengths)]
            per_char = lls / torch.tensor(question.lengths, dtype=lls.dtype)
            gold = list(question.gold)
            wrong = [k for k in range(len(lls)) if k not in question.gold]
            acc.append(int(lls.argmax()) in question.gold)
            acc_norm.append(int(per_char.argmax()) in question.gold)
            best = lls[gold].max()
            right.append(float(best))
            margin.append(float(best - lls[wrong].max()) if wrong else 0.0)
        return cls(torch.tensor(acc), torch.tensor(acc_norm), torch.tensor(margin, dtype=torch.float64),
                   torch.tensor(right, dtype=torch.float64))


class ProbeScorer:
    """Exact-match accuracy of greedy continuations, scored by teacher forcing: greedy decoding
    writes the answer exactly when each answer token is the argmax after the prompt and the
    answer tokens before it, so one pass over prompt + answer decides it (no generation loop).
    A chained probe is one row (the whole chain); independent items are right-padded rows of
    a batch (causal attention never lets a real token see the padding). A multiple-choice
    probe's items are its choices, each its own row (context + choice: the runner has no mask
    that would let choices share one row of their context), and `choices` ranks them."""

    def __init__(self, model: LoadedModel, probe: Probe, base: LayerPlan, reuse: bool = True,
                 batch_size: int = 32) -> None:
        if model.tokenizer is None:
            raise ValueError("task probes need the model's tokenizer")
        self.model, self.probe, self.items, self.reuse = model, probe, probe.items, reuse
        self._last = threading.local()  # .answers: (plan, ProbeAnswers), per thread (block_scan's workers)
        self.stop_tokens = set(model.eos_token_ids)
        self.word_tokens: dict[int, bool] = {}  # token id -> its text starts with a letter or digit
        rows = self._rows()
        for ids, _ in rows:
            if len(ids) > model.context_length:
                raise ValueError(f"probe {probe.name}: a row of {len(ids)} tokens is longer than the model's context "
                                 f"({model.context_length}); use fewer items")
        pad = prefix_token(model.tokenizer)
        rows.sort(key=lambda row: len(row[0]))
        self.batches = []  # (SharedPrefix over the padded rows, per row: [(item, answer start, answer ids)])
        for first in range(0, len(rows), batch_size):
            chosen = rows[first : first + batch_size]
            width = max(len(ids) for ids, _ in chosen)
            ids = torch.tensor([row + [pad] * (width - len(row)) for row, _ in chosen], device=model.device)
            self.batches.append((SharedPrefix(model, ids, base, reuse), [answers for _, answers in chosen]))

    def _rows(self) -> list[tuple[list[int], list[tuple[int, int, list[int]]]]]:
        """Token rows and, per row, the answers in it: (item index, position of its first token, its ids)."""
        tokenizer = self.model.tokenizer
        start = prefix_token(tokenizer)
        pairs = [encode_pair(tokenizer, item.prompt, item.answer, start) for item in self.items]
        for item, (_, answer) in zip(self.items, pairs):
            if not answer:
                raise ValueError(f"probe {self.probe.name}: the answer {item.answer!r} adds no token to its prompt")
        if not self.probe.chained:
            return [(context + answer, [(index, len(context), answer)]) for index, (context, answer) in enumerate(pairs)]
        ids = tokenizer.encode(self.probe.header, add_special_tokens=False) if self.probe.header else [start]
        separator = tokenizer.encode(self.probe.separator, add_special_tokens=False)
        answers = []
        for index, (context, answer) in enumerate(pairs):
            ids = ids + context
            answers.append((index, len(ids), answer))
            ids = ids + answer + separator
        return [(ids, answers)]

    def _continues_word(self, token: int) -> bool:
        if token not in self.word_tokens:
            text = self.model.tokenizer.decode([token])
            self.word_tokens[token] = token not in self.stop_tokens and text[:1].isalnum()
        return self.word_tokens[token]

    @torch.inference_mode()
    def answers(self, plan: LayerPlan, keep: int | None = None) -> ProbeAnswers:
        """The plan's answers (the last plan's are kept: several measures read one probe; keep:
        see SharedPrefix.hidden)."""
        last = getattr(self._last, "answers", None)
        if last is not None and last[0] == plan:
            return last[1]
        count = len(self.items)
        exact = torch.zeros(count, dtype=torch.bool)
        greedy = torch.zeros(count, dtype=torch.bool)
        logprob = torch.zeros(count, dtype=torch.float64)
        for stream, row_answers in self.batches:
            hidden = stream.hidden(plan, keep)
            # the positions that predict each answer token, and the one after the answer
            wanted = [(b, item, at, answer) for b, answers in enumerate(row_answers) for item, at, answer in answers]
            rows = torch.cat([hidden[b, at - 1 : at + len(answer)] for b, _, at, answer in wanted])
            logp = torch.log_softmax(head(self.model, rows[None])[0].float(), -1)
            best = logp.argmax(-1)
            offset = 0
            for _, item, _, answer in wanted:
                target = torch.tensor(answer, device=logp.device)
                span = slice(offset, offset + len(answer))
                greedy[item] = bool((best[span] == target).all())
                exact[item] = greedy[item] and not self._continues_word(int(best[offset + len(answer)]))
                logprob[item] = float(logp[span].gather(1, target[:, None]).double().sum())
                offset += len(answer) + 1
        self._last.answers = (plan, ProbeAnswers(exact, greedy, logprob))
        return self._last.answers[1]

    def choices(self, plan: LayerPlan, keep: int | None = None) -> ChoiceAnswers:
        """A multiple-choice probe's questions under the plan (from `answers`' log-likelihoods)."""
        if not self.probe.questions:
            raise ValueError(f"probe {self.probe.name} is not multiple choice")
        return ChoiceAnswers.of(self.probe.questions, self.answers(plan, keep).logprob)


# a measure's field (ProbeAnswers') -> what it reads of a multiple-choice probe (ChoiceAnswers')
CHOICE_FIELDS = {"exact": "acc", "logprob": "margin", "norm": "acc_norm"}


class ProbeView:
    """One number per probe item as a measure: "exact" (accuracy) or "logprob" (the answer's
    log-likelihood, smoother where a small model gets few answers right); on a multiple-choice
    probe one per question (CHOICE_FIELDS: acc, the right choice's log-likelihood margin, or
    acc_norm). Views of one scorer share its last plan's answers, so asking all costs one pass."""

    def __init__(self, scorer: ProbeScorer, field: str) -> None:
        self.scorer, self.field = scorer, field
        self.reuse = scorer.reuse

    @staticmethod
    def summary(mean: torch.Tensor) -> torch.Tensor:
        return mean

    def units(self, plan: LayerPlan, keep: int | None = None) -> Units:
        if self.scorer.probe.questions:
            result = self.scorer.choices(plan, keep)
            values = getattr(result, CHOICE_FIELDS[self.field])
        else:
            result = self.scorer.answers(plan, keep)
            values = getattr(result, self.field)
        return Units(values.double(), torch.ones(values.numel(), dtype=torch.float64), float(result.logprob.mean()))


def _perplexity_ids(model: LoadedModel, name: str, inputs: MeasureInputs) -> torch.Tensor:
    if name == "ppl":
        return calibration_ids(model, tokens=inputs.tokens)
    ids = model.tokenizer("\n\n".join(read_texts(inputs.text)), return_tensors="pt").input_ids
    if ids.shape[1] < 2:
        raise ValueError(f"{inputs.text}: the text has fewer than two tokens; nothing to score")
    return ids[:, : inputs.tokens].to(model.device)


def build_scorers(model: LoadedModel, names: list[str], inputs: MeasureInputs, base: LayerPlan | None = None,
                  reuse: bool = True) -> dict[str, PerplexityScorer | ProbeView]:
    """The named measures' scorers on `model`, each prepared against `base` (default: the model)."""
    check_measures(names, inputs)
    base = base if base is not None else model.plan()
    probes: dict[str, ProbeScorer] = {}
    scorers = {}
    for name in names:
        measure = MEASURES[name]
        if measure.probe is None:
            scorers[name] = PerplexityScorer(model, _perplexity_ids(model, name, inputs), base, reuse)
            continue
        if measure.probe not in probes:
            if measure.probe == "file":
                probe = read_probe_file(inputs.probe_file)
            elif measure.probe == "task":
                probe = harness_probe(inputs.task, inputs.include_path, inputs.probe_items)
            else:
                probe = generate_probe(measure.probe, inputs.probe_items, inputs.seed)
            probes[measure.probe] = ProbeScorer(model, probe, base, reuse)
        if measure.field not in ProbeAnswers.__dataclass_fields__ and not probes[measure.probe].probe.questions:
            raise ValueError(f"the {name} measure needs a multiple_choice task; {probes[measure.probe].probe.name} "
                             f"has one answer per document")
        scorers[name] = ProbeView(probes[measure.probe], measure.field)
    return scorers


def point_value(scorer: PerplexityScorer | ProbeView, plan: LayerPlan) -> float:
    """The measure's value for one plan, without an interval (what a search optimises)."""
    units = scorer.units(plan)
    return float(scorer.summary(units.values.sum() / units.weights.sum()))


def is_better(measure: str, change: float) -> bool:
    return change < 0 if MEASURES[measure].direction == "minimize" else change > 0
