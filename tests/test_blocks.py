"""Block-repeat scans, task probes, measures with intervals, and the merge study (issue 14)."""

import datetime
import json
import re
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from layerplan.engine.runner import forward
from layerplan.export import export_checkpoint
from layerplan.plan.plan import PlanError
from layerplan.search.blocks import (MergeSpace, block_candidates, block_scan, merge_study, parse_range, parse_repeats,
                                     repeat_plan)
from layerplan.search.evaluate import perplexity
from layerplan.search.measure_registry import MeasureInputs
from layerplan.search.measures import (PerplexityScorer, ProbeScorer, ProbeView, Units, bootstrap, build_scorers,
                                       point_value)
from layerplan.search.probes import DAYS, PROBE_SETS, Probe, ProbeItem, generate_probe, read_probe_file
from studies import assert_exact_and_distinct, kill_mid_trial, run_workers
from tiny import VOCAB, tiny_model


class CharTokenizer:
    """One token per character ("\\n" and printable ASCII): enough for probes on tiny models."""

    chars = "\n" + "".join(chr(c) for c in range(32, 127))
    bos_token_id = None
    eos_token_id = 0
    chat_template = None

    def encode(self, text, add_special_tokens=False):
        return [max(self.chars.find(c), 1) for c in text]  # other characters read as a space

    def decode(self, ids):
        return "".join(self.chars[i] for i in ids)

    def __call__(self, text, return_tensors="pt"):
        return type("Encoded", (), {"input_ids": torch.tensor([self.encode(text)])})()

    def save_pretrained(self, folder):
        pass


@pytest.fixture(scope="module")
def tiny():
    model = tiny_model("llama", num_layers=4)
    model.tokenizer = CharTokenizer()
    ids = torch.randint(3, VOCAB, (1, 48), generator=torch.Generator().manual_seed(0))
    return model, ids


def test_blocks_and_their_plans(tiny):
    model, _ = tiny
    assert len(block_candidates(30)) == 465
    assert block_candidates(4, (1, 2)) == [(1, 1), (1, 2), (2, 2)]
    assert block_candidates(5, max_len=1) == [(i, i) for i in range(5)]
    assert [s.layer for s in repeat_plan(model, 1, 2).steps] == [0, 1, 2, 1, 2, 3]
    twice = repeat_plan(model, 2, 2, repeats=2, scale=0.5)
    assert twice.to_string() == "0-2,2@0.5,2@0.5,3"
    assert parse_range("1-2", 4) == (1, 2)
    assert parse_repeats("2,1") == [1, 2] and parse_repeats(2) == [2]
    for bad in ("0", "1,-2", "twice", ""):
        with pytest.raises(PlanError, match="cannot read --repeats"):
            parse_repeats(bad)
    for bad, message in (("2-9", "outside layers 0–3"), ("x", "expected A-B")):
        with pytest.raises(PlanError, match=message):
            parse_range(bad, 4)
    with pytest.raises(PlanError, match="block 3-1"):
        repeat_plan(model, 3, 1)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("repeats", [1, 2, (1, 2)])
def test_scanned_perplexity_equals_the_plan_run_alone(arch, repeats):
    """The shared-prefix scan, the naive scan and sliding-window perplexity of each plan agree."""
    model = tiny_model(arch, num_layers=4)
    ids = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
    blocks = block_candidates(4)
    fast = block_scan(model, {"ppl": PerplexityScorer(model, ids, model.plan())}, blocks, repeats)
    naive = block_scan(model, {"ppl": PerplexityScorer(model, ids, model.plan(), reuse=False)}, blocks, repeats)
    assert fast.reuse and not naive.reuse
    alone_base = perplexity(model, ids, model.plan(), window=40, stride=40).perplexity
    assert fast.base_score("ppl").value == pytest.approx(alone_base, rel=1e-6)
    for row, naive_row in zip(fast.rows, naive.rows):
        alone = perplexity(model, ids, model.plan(row.plan), window=40, stride=40).perplexity
        assert row.score("ppl").value == pytest.approx(alone, rel=1e-6)
        assert row.score("ppl").value == pytest.approx(naive_row.score("ppl").value, rel=1e-9)
        assert row.score("ppl").change == pytest.approx(alone - alone_base, abs=2e-6 * alone)
    counts = [repeats] if isinstance(repeats, int) else list(repeats)
    assert [(r.start, r.end, r.repeats) for r in fast.rows] == [(i, j, c) for i, j in blocks for c in counts]
    assert fast.repeats == counts and all(len(r.plan.split(",")) >= 2 for r in fast.rows)
    if counts == [1, 2]:  # the second repeat resumed after the first's: the same numbers as scanning it alone
        twice = block_scan(model, {"ppl": PerplexityScorer(model, ids, model.plan())}, blocks, 2)
        assert [r for r in fast.rows if r.repeats == 2] == twice.rows
        assert "x2" in fast.table()


def test_a_block_repeated_twice_runs_only_its_second_repeat_after_the_first(tiny, monkeypatch):
    from layerplan.search import measures

    model, ids = tiny
    scorers = {"ppl": PerplexityScorer(model, ids, model.plan()),
               **build_scorers(model, ["arithmetic"], MeasureInputs(probe_items=4))}
    steps_run = []
    real = measures.run_hidden

    def counting(model_, ids_, plan, *args, resume=None, **kwargs):
        steps_run.append(len(plan.active_steps) - resume.step)
        return real(model_, ids_, plan, *args, resume=resume, **kwargs)

    monkeypatch.setattr(measures, "run_hidden", counting)
    blocks = block_candidates(4)
    cost = {}
    for repeats in (1, 2, (1, 2)):
        steps_run.clear()
        block_scan(model, scorers, blocks, repeats)
        cost[repeats] = sum(steps_run)
    saved = 2 * sum(j - i + 1 for i, j in blocks)  # the first repeat, for each of the two streams
    assert cost[(1, 2)] == cost[1] + cost[2] - saved


def test_exported_candidate_reproduces_the_scanned_perplexity(tiny, tmp_path):
    _, ids = tiny
    model = tiny_model("llama", num_layers=4)  # the same weights, without the test tokenizer
    result = block_scan(model, {"ppl": PerplexityScorer(model, ids, model.plan())}, block_candidates(4, (1, 2)))
    best = result.best()
    folder = export_checkpoint(model, model.plan(best.plan), tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa", dtype=torch.float32).eval()
    with torch.no_grad():
        loss = merged(ids, labels=ids).loss
    assert merged.config.num_hidden_layers == best.steps
    assert float(torch.exp(loss)) == pytest.approx(best.score("ppl").value, rel=1e-5)


def test_result_ranks_by_the_first_measure_and_serialises(tiny):
    model, ids = tiny
    scorers = {"ppl": PerplexityScorer(model, ids, model.plan())}
    result = block_scan(model, scorers, block_candidates(4))
    changes = [r.score("ppl").change for r in result.ranked()]
    assert changes == sorted(changes)  # lower perplexity is better
    assert result.best() is result.ranked()[0]
    for row in result.better():
        assert row.score("ppl").change_high < 0
    table = result.table(top=3)
    assert table.splitlines()[0].startswith("block") and len(table.splitlines()) == 5
    restored = json.loads(json.dumps(result.to_dict()))
    assert restored["rows"][0]["scores"][0]["measure"] == "ppl" and len(restored["rows"]) == 10


def test_bootstrap_intervals():
    units = Units(torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0], dtype=torch.float64), torch.ones(6, dtype=torch.float64))
    same = bootstrap("arithmetic", units, units, lambda m: m)
    assert same.value == pytest.approx(4 / 6) and same.low <= same.value <= same.high
    assert (same.change, same.change_low, same.change_high) == (0.0, 0.0, 0.0)
    better = Units(torch.ones(6, dtype=torch.float64), torch.ones(6, dtype=torch.float64))
    paired = bootstrap("arithmetic", better, units, lambda m: m)
    assert paired.change == pytest.approx(2 / 6) and 0.0 <= paired.change_low <= paired.change <= paired.change_high
    assert bootstrap("arithmetic", better, units, lambda m: m) == paired  # seeded


# ----- probes ------------------------------------------------------------------------------------
def _check_arithmetic(prompt: str, answer: str) -> None:
    a, op, b = re.fullmatch(r"(\d+) ([-+*]) (\d+) =", prompt).groups()
    a, b = int(a), int(b)
    assert int(answer) == {"+": a + b, "-": a - b, "*": a * b}[op]
    assert max(a, b) >= 10  # multi-digit


def _check_strings(prompt: str, answer: str) -> None:
    kind, text = re.fullmatch(r"Q: (reverse|uppercase|initials of) ([a-z ]+)\nA:", prompt).groups()
    if kind == "reverse":
        assert answer == "".join(reversed(text))
    elif kind == "uppercase":
        assert answer == "".join(chr(ord(c) - 32) for c in text)
    else:
        assert answer == "".join(word[:1] for word in text.split(" "))


def _check_dates(prompt: str, answer: str) -> None:
    def day(text):
        return datetime.date(*map(int, text.split("-"))).toordinal()

    if m := re.fullmatch(r"Q: (\d+) days after (\S+)\nA:", prompt):
        assert day(answer) - day(m[2]) == int(m[1])
    elif m := re.fullmatch(r"Q: weekday of (\S+)\nA:", prompt):
        assert answer == DAYS[(day(m[1]) - day("2024-01-01")) % 7]  # 2024-01-01 was a Monday
    else:
        m = re.fullmatch(r"Q: days from (\S+) to (\S+)\nA:", prompt)
        assert int(answer) == day(m[2]) - day(m[1])


CHECKS = {"arithmetic": _check_arithmetic, "strings": _check_strings, "dates": _check_dates}


@pytest.mark.parametrize("name", list(PROBE_SETS))
def test_every_built_in_probe_answer_is_right(name):
    assert set(CHECKS) == set(PROBE_SETS)  # a new probe set needs its check here
    for seed in range(3):
        probe = generate_probe(name, 40, seed)
        assert probe.chained and len(probe.items) == 40
        demo, _, demo_answer = probe.header.rstrip("\n").rpartition(" ")
        CHECKS[name](demo, demo_answer)
        for item in probe.items:
            assert item.answer.startswith(" ") and item.answer.strip() == item.answer[1:]
            CHECKS[name](item.prompt, item.answer[1:])
    assert generate_probe(name, 5, 1) == generate_probe(name, 5, 1)
    assert generate_probe(name, 5, 1) != generate_probe(name, 5, 2)


def test_probe_files_and_bad_ones(tmp_path):
    good = tmp_path / "p.jsonl"
    good.write_text('{"prompt": "2 + 2 =", "answer": " 4"}\n\n{"prompt": "Capital of France:", "answer": " Paris"}\n')
    probe = read_probe_file(good)
    assert probe.items == [ProbeItem("2 + 2 =", " 4"), ProbeItem("Capital of France:", " Paris")] and not probe.chained
    for text, message in (('{"prompt": "x"}\n', "p2.jsonl:1: expected"), ("not json\n", "p2.jsonl:1: not valid JSON"),
                          ("\n", "no probe records")):
        (tmp_path / "p2.jsonl").write_text(text)
        with pytest.raises(ValueError, match=message):
            read_probe_file(tmp_path / "p2.jsonl")
    with pytest.raises(FileNotFoundError, match="probe file not found"):
        read_probe_file(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="unknown probe set 'maths'"):
        generate_probe("maths")


def _direct_answers(model, tokenizer, rows):
    """(greedy, exact, logprob) per answer, from one plain forward pass per row (no batching, no reuse)."""
    out = []
    for text, answers in rows:
        ids = torch.tensor([tokenizer.encode(text)])
        logp = torch.log_softmax(forward(model, ids, model.plan("0-2,1-3")).float(), -1)[0]
        for start, answer in answers:
            target = tokenizer.encode(answer)
            picks = logp[start - 1 : start - 1 + len(target)]
            greedy = picks.argmax(-1).tolist() == target
            after = tokenizer.decode([int(logp[start - 1 + len(target)].argmax())])
            out.append((greedy, greedy and not after[:1].isalnum(),
                        float(picks.gather(1, torch.tensor(target)[:, None]).sum())))
    return out


def test_probe_scores_equal_direct_teacher_forcing_batched_or_chained(tiny):
    model, _ = tiny
    tok = model.tokenizer
    plan = model.plan("0-2,1-3")
    # an answer the model itself writes greedily after its prompt: right by construction
    prompt = "Q: 12 + 7 =\nA:"
    ids = torch.tensor([tok.encode(prompt)])
    for _ in range(3):
        nxt = int(forward(model, ids, plan)[0, -1].argmax())
        ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
    own = tok.decode(ids[0, -3:].tolist())
    items = [ProbeItem(prompt, own), ProbeItem("Q: 3 + 4 =\nA:", " 7"), ProbeItem("Q: longer one, 30 - 1 =\nA:", " 29")]

    independent = ProbeScorer(model, Probe("t", items), model.plan(), batch_size=2)
    got = independent.answers(plan)
    expected = _direct_answers(model, tok, [(i.prompt + i.answer, [(len(i.prompt), i.answer)]) for i in items])
    assert got.greedy.tolist() == [e[0] for e in expected] and got.greedy[0]
    assert got.exact.tolist() == [e[1] for e in expected]
    assert got.logprob.tolist() == pytest.approx([e[2] for e in expected], abs=1e-4)

    chained = Probe("c", items, chained=True, header="Q: 1 + 1 =\nA: 2\n")
    text, spans = chained.header, []
    for item in items:
        text += item.prompt
        spans.append((len(text), item.answer))
        text += item.answer + "\n"
    got = ProbeScorer(model, chained, model.plan()).answers(plan)
    expected = _direct_answers(model, tok, [(text, spans)])
    assert got.greedy.tolist() == [e[0] for e in expected]
    assert got.logprob.tolist() == pytest.approx([e[2] for e in expected], abs=1e-4)
    naive = ProbeScorer(model, chained, model.plan(), reuse=False).answers(plan)
    assert naive.logprob.tolist() == pytest.approx(got.logprob.tolist(), abs=1e-9)


def test_measures_registry_shares_a_probe_and_names_what_is_missing(tiny):
    model, ids = tiny
    scorers = build_scorers(model, ["arithmetic", "arithmetic-ll"], MeasureInputs(probe_items=6))
    assert isinstance(scorers["arithmetic"], ProbeView)
    assert scorers["arithmetic"].scorer is scorers["arithmetic-ll"].scorer  # one pass serves both
    value = point_value(scorers["arithmetic-ll"], model.plan("0-2,1-3"))
    assert value < 0 and 0.0 <= point_value(scorers["arithmetic"], model.plan("0-2,1-3")) <= 1.0
    with pytest.raises(ValueError, match="the text measure needs --text"):
        build_scorers(model, ["text"], MeasureInputs())
    with pytest.raises(ValueError, match="the file measure needs --probe-file"):
        build_scorers(model, ["file"], MeasureInputs())
    with pytest.raises(ValueError, match="unknown measure 'bleu'"):
        build_scorers(model, ["bleu"], MeasureInputs())
    result = block_scan(model, scorers, [(1, 1), (1, 2)])
    assert [s.measure for s in result.rows[0].scores] == ["arithmetic", "arithmetic-ll"]
    assert result.rows[0].scores[1].detail == pytest.approx(result.rows[0].scores[1].value)


def test_a_scan_with_workers_scores_every_block_as_one_worker_does(tiny):
    model, ids = tiny
    scorers = {"ppl": PerplexityScorer(model, ids, model.plan()),
               **build_scorers(model, ["arithmetic-ll", "arithmetic"], MeasureInputs(probe_items=6))}
    threads = torch.get_num_threads()
    alone = block_scan(model, scorers, block_candidates(4))
    seen = []
    shared = block_scan(model, scorers, block_candidates(4), workers=3, on_progress=lambda done, total: seen.append(done))
    assert shared.rows == alone.rows  # the probe's two measures read one pass per thread, never another's
    assert seen == list(range(1, 11)) and torch.get_num_threads() == threads


def test_an_interrupted_scan_resumes_where_it_stopped_with_the_same_rows(tiny, tmp_path):
    """Ctrl-C after 4 of 10 blocks keeps them in the checkpoint; the same command then scores only
    the other 6, and the rows (and their order) are those of a scan never interrupted."""
    from layerplan.app.merges import scan_blocks

    model, _ = tiny
    inputs = MeasureInputs(tokens=32, probe_items=6)
    args = (model, ["ppl", "arithmetic"], inputs, (0, 3), None, [1, 2])
    whole = scan_blocks(*args)
    checkpoint = tmp_path / "blocks.partial.json"

    def interrupt(done: int, total: int) -> None:
        if done == 8:  # 4 blocks of 2 counts each
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        scan_blocks(*args, checkpoint=checkpoint, on_progress=interrupt)
    assert len(json.loads(checkpoint.read_text())["rows"]) == 8
    seen = []
    resumed = scan_blocks(*args, checkpoint=checkpoint, on_progress=lambda done, total: seen.append(done))
    assert resumed.resumed == 8 and seen[0] == 8 and seen[-1] == 20
    assert json.dumps([r.__dict__ for r in resumed.rows], default=lambda o: o.__dict__) == \
        json.dumps([r.__dict__ for r in whole.rows], default=lambda o: o.__dict__)
    assert not checkpoint.exists()  # a finished scan leaves no checkpoint

    # other settings (another seed: other probe items) never reuse the saved rows
    with pytest.raises(KeyboardInterrupt):
        scan_blocks(*args, checkpoint=checkpoint, on_progress=interrupt)
    other = scan_blocks(model, ["ppl", "arithmetic"], MeasureInputs(tokens=32, probe_items=6, seed=1), (0, 3), None,
                        [1, 2], checkpoint=checkpoint)
    assert other.resumed == 0


# ----- the study -----------------------------------------------------------------------------------
def test_merge_study_resumes_and_scores_what_it_says(tiny, tmp_path):
    pytest.importorskip("optuna")
    model, ids = tiny
    scorer = PerplexityScorer(model, ids, model.plan())
    space = MergeSpace((1, 3), max_len=2, max_repeats=2, scales=(0.5, 1.0))
    storage = str(tmp_path / "study.db")
    seeds = [{"start": 1, "length": 2, "repeats": 1, "scale": 1.0}]
    first = merge_study(model, scorer, "ppl", space, 5, storage, seeds=seeds)
    assert len([t for t in first.trials if t.state == "COMPLETE"]) == 5
    assert first.trials[0].plan == "0-2,1-3"  # the seed ran first
    again = merge_study(model, scorer, "ppl", space, 7, storage)
    assert len([t for t in again.trials if t.state == "COMPLETE"]) == 7
    assert [t.plan for t in again.trials[: len(first.trials)]] == [t.plan for t in first.trials]  # kept
    best = model.plan(again.best_plan)
    assert again.best_value == pytest.approx(point_value(scorer, best), rel=1e-12)
    assert again.best_value == min(t.values[0] for t in again.trials if t.state == "COMPLETE")
    shapes = {tuple(s.layer for s in repeat_plan(model, i, j, r).steps)
              for i, j in block_candidates(4, (1, 3), max_len=2) for r in (1, 2)}
    for trial in again.trials:  # every trial ran a plan of the space
        assert tuple(s.layer for s in model.plan(trial.plan).steps) in shapes
        assert all(0.5 <= s.scale <= 1.0 for s in model.plan(trial.plan).steps)


class _HangingScorer(PerplexityScorer):
    """Hangs in its second plan (mid-study, mid-trial) after touching `marker`, until killed."""

    def __init__(self, model, ids, marker: Path | None) -> None:
        super().__init__(model, ids, model.plan())
        self.marker, self.plans = marker, 0

    def units(self, plan):
        self.plans += 1
        if self.marker is not None and self.plans >= 2:
            self.marker.touch()
            time.sleep(600)
        return super().units(plan)


WORKERS_SPACE = MergeSpace((0, 3), max_len=3, max_repeats=1, scales=(1.0, 1.0))  # 9 plans: proposals repeat


def _merge_work(model, ids, storage: str, trials: int, marker: Path | None) -> None:
    torch.set_num_threads(1)  # a forked child must not reuse the parent's thread pool
    merge_study(model, _HangingScorer(model, ids, marker), "ppl", WORKERS_SPACE, trials, storage, "shared",
                poll=0.05)


def test_merge_study_workers_share_a_storage_and_fail_a_dead_workers_trial(tiny, tmp_path):
    """The skip search's machinery: a worker killed mid-trial leaves a RUNNING trial, which the
    next workers fail; two workers on one SQLite file then finish the study, no plan run twice."""
    pytest.importorskip("optuna")
    from optuna.trial import TrialState

    model, ids = tiny
    storage, marker = str(tmp_path / "merge.db"), tmp_path / "in-trial"
    killed = kill_mid_trial(_merge_work, (model, ids, storage, 5, marker), storage, marker)
    run_workers(_merge_work, 2, model, ids, storage, 5, None)
    found = assert_exact_and_distinct(storage, 5)
    assert found[killed.number].state == TrialState.FAIL
    assert {t.state for t in found[: killed.number]} <= {TrialState.COMPLETE, TrialState.PRUNED}  # kept, not rerun
    for trial in found:  # a complete trial's value is its plan's perplexity
        if trial.state == TrialState.COMPLETE:
            plan = model.plan(trial.user_attrs["plan"])
            assert trial.values[0] == pytest.approx(point_value(PerplexityScorer(model, ids, model.plan()), plan),
                                                    rel=1e-9)
            assert WORKERS_SPACE.plan_of_params(model, trial.params) == plan


def test_merge_space_draws_every_unseen_plan_then_none(tiny):
    import random

    model, _ = tiny
    space = MergeSpace((1, 2), max_len=2, max_repeats=1, scales=(1.0, 1.0))
    held, rng = set(), random.Random(0)
    while (params := space.unseen(model, held, rng)) is not None:
        held.add(space.plan_of_params(model, params).to_string())
    assert held == {repeat_plan(model, i, j).to_string() for i, j in block_candidates(4, (1, 2), 2)}
    with pytest.raises(PlanError, match="without scale"):
        MergeSpace((1, 2), max_len=2).plan_of_params(model, {"start": 1, "length": 1, "repeats": 1})


def test_study_exports_its_best_as_checkpoint_and_mergekit(tiny, tmp_path):
    from layerplan.app.merges import study_merges

    model, _ = tiny
    space = MergeSpace((1, 2), max_len=2, max_repeats=1, scales=(1.0, 1.0))
    outcome = study_merges(model, "ppl", MeasureInputs(tokens=32), space, 3, tmp_path, "org/tiny")
    assert outcome.best_plan == outcome.study.best_plan and outcome.base_value > 0
    merged = AutoModelForCausalLM.from_pretrained(outcome.checkpoint).eval()
    assert merged.config.num_hidden_layers == len(model.plan(outcome.best_plan).steps)
    yaml_text = Path(outcome.mergekit).read_text()
    assert "org/tiny" in yaml_text and "passthrough" in yaml_text
    assert json.loads((tmp_path / "merge-study.json").read_text())["best_plan"] == outcome.best_plan


@pytest.mark.real
def test_explore_blocks_and_search_from_the_command_line(smollm2, tmp_path):
    from click.testing import CliRunner

    from layerplan.app.cli import main

    out = tmp_path / "run"
    common = ["--range", "12-13", "--tokens", "32", "--probe-items", "4", "--out", str(out)]
    result = CliRunner().invoke(main, ["explore", "--blocks", "--report", "--measure", "ppl", "--measure", "dates",
                                       "--repeats", "1,2", "--workers", "2", *common])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "blocks.json").read_text())
    assert report["measures"] == ["ppl", "dates"] and len(report["rows"]) == 6 and report["repeats"] == [1, 2]
    assert {r["plan"] for r in report["rows"]} >= {"0-12,12*2,13-29"} or any("12" in r["plan"] for r in report["rows"])
    page = (out / "report.html").read_text()
    assert "layerplan export" in page and "data:image/png;base64" in page
    assert all((out / f"blocks-{m}-x{r}.png").exists() for m in ("ppl", "dates") for r in (1, 2))
    # the study resumes from its storage: the second run adds one trial
    for trials in ("2", "3"):
        result = CliRunner().invoke(main, ["explore", "--search", "--trials", trials, "--no-export", *common])
        assert result.exit_code == 0, result.output
    study = json.loads((out / "merge-study.json").read_text())["study"]
    assert len([t for t in study["trials"] if t["state"] == "COMPLETE"]) == 3
    assert "slices" in (out / "best-merge.yaml").read_text()
    for args, message in ((["--blocks", "--range", "5-99"], "outside layers 0–29"),
                          (["--blocks", "--repeats", "1,x"], "cannot read --repeats '1,x'"),
                          (["--blocks", "--measure", "text"], "needs --text"),
                          (["--blocks", "--probe-file", str(tmp_path / "none.jsonl")], "probe file not found")):
        result = CliRunner().invoke(main, ["explore", *args])
        assert result.exit_code != 0 and message in result.output and "Traceback" not in result.output


def test_mergekit_yaml_carries_residual_scales():
    from layerplan.plan.formats import from_mergekit, to_mergekit
    from layerplan.plan.plan import parse_plan

    for text in ("0-13,13@0.85,14-29", "0-14,15*2@0.25,16-29", "a:0-5,b:3-9@0.5,a:8-29"):
        plan = parse_plan(text, 30)
        assert from_mergekit(to_mergekit(plan, "m", sources={"b": "B"}), 30) == plan
    assert "o_proj" not in to_mergekit(parse_plan("0-20,10-29", 30), "m")


@pytest.mark.real
def test_a_probe_scored_by_lm_evaluation_harness_agrees(smollm2, tmp_path):
    """The arithmetic chain, each item as lm-eval sees it (its whole context as text): lm-eval's
    loglikelihood `acc` (greedy) and perplexity equal layerplan's greedy match and answer
    log-likelihood, under a merge plan; and the chain scored as one row equals its items scored alone."""
    lm_eval = pytest.importorskip("lm_eval")
    import yaml
    from lm_eval.tasks import TaskManager

    from layerplan.app.integrations.harness import LayerplanLM

    probe = generate_probe("arithmetic", 6, seed=3)
    text, items = probe.header, []
    for item in probe.items:
        items.append(ProbeItem(text + item.prompt, item.answer))
        text += item.prompt + item.answer + probe.separator
    plan = smollm2.plan("0-14,12-29")
    chained = ProbeScorer(smollm2, probe, smollm2.plan()).answers(plan)
    alone = ProbeScorer(smollm2, Probe("items", items), smollm2.plan()).answers(plan)
    assert chained.greedy.tolist() == alone.greedy.tolist()
    assert chained.logprob.tolist() == pytest.approx(alone.logprob.tolist(), abs=2e-3)

    data = tmp_path / "probe.jsonl"
    data.write_text("".join(json.dumps({"prompt": i.prompt, "answer": i.answer}) + "\n" for i in items))
    task = {"task": "lp_probe", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test", "output_type": "loglikelihood", "doc_to_text": "{{prompt}}",
            "doc_to_target": "{{answer}}", "target_delimiter": "",
            "metric_list": [{"metric": "acc"}, {"metric": "perplexity"}]}
    (tmp_path / "lp_probe.yaml").write_text(yaml.safe_dump(task))
    lm = LayerplanLM(pretrained=smollm2, plan=plan.to_string())
    results = lm_eval.simple_evaluate(model=lm, tasks=["lp_probe"],
                                      task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False)
                                      )["results"]["lp_probe"]
    assert results["acc,none"] == pytest.approx(float(alone.greedy.double().mean()))
    assert results["perplexity,none"] == pytest.approx(float(torch.exp(-alone.logprob.mean())), rel=1e-4)


def test_a_local_harness_task_is_a_probe(tiny, tmp_path):
    pytest.importorskip("lm_eval")
    import yaml

    model, _ = tiny
    data = tmp_path / "docs.jsonl"
    docs = [{"q": "Q: 3 + 4 =\nA:", "a": "7"}, {"q": "Q: 10 - 1 =\nA:", "a": "9"}, {"q": "Q: 2 * 2 =\nA:", "a": "4"}]
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    for name, output in (("lp_ll", "loglikelihood"), ("lp_gen", "generate_until")):
        task = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
                "test_split": "test", "output_type": output, "doc_to_text": "{{q}}", "doc_to_target": "{{a}}",
                "metric_list": [{"metric": "acc" if output == "loglikelihood" else "exact_match"}],
                "description": "Sums.\n"}
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(task))
    inputs = MeasureInputs(probe_items=2, task="lp_ll", include_path=str(tmp_path))
    view = build_scorers(model, ["task-ll"], inputs)["task-ll"]
    # lm-eval's own requests: the description, then the target as is (a loglikelihood task adds no delimiter)
    assert view.scorer.items == [ProbeItem("Sums.\n" + d["q"], d["a"]) for d in docs[:2]]
    from lm_eval.tasks import TaskManager, get_task_dict

    lm_task = get_task_dict(["lp_ll"], TaskManager(include_path=str(tmp_path), include_defaults=False))["lp_ll"]
    lm_task.build_all_requests(limit=2)
    assert [(item.prompt, item.answer) for item in view.scorer.items] == [r.args for r in lm_task.instances]
    direct = ProbeScorer(model, Probe("same", view.scorer.items), model.plan())
    plan = model.plan("0-2,1-3")
    assert point_value(view, plan) == pytest.approx(float(direct.answers(plan).logprob.mean()), abs=1e-9)
    gen = build_scorers(model, ["task"], MeasureInputs(probe_items=5, task="lp_gen", include_path=str(tmp_path)))
    assert gen["task"].scorer.items == [ProbeItem("Sums.\n" + d["q"], " " + d["a"]) for d in docs]
    with pytest.raises(ValueError, match="the task measure needs --task"):
        build_scorers(model, ["task"], MeasureInputs())


# ----- multiple-choice lm-evaluation-harness tasks as probes --------------------------------------
CHOICE_DOCS = [
    {"question": "Q: What colour is the sky?\nA:", "choices": ["blue", "green", "deep purple"], "answer": 0},
    {"question": "Q: How many legs has a cat?\nA:", "choices": ["two", "four", "eight or more"], "answer": 1},
    {"question": "Q: 3 + 4 =\nA:", "choices": ["seven", "twelve", "thirty-four", "one"], "answer": 0},
    {"question": "Q: Opposite of up?\nA:", "choices": ["down", "sideways", "up"], "answer": 2},
]
INPUT_DOCS = [  # multiple inputs (Winogrande's form): the choices are contexts, the target follows each
    {"options": ["The cat sat on the", "The cat sat in the"], "label": 0, "rest": "mat."},
    {"options": ["Rain falls from the", "Rain falls to the"], "label": 0, "rest": "sky."},
    {"options": ["She drank a cup of", "She ate a cup of"], "label": 0, "rest": "tea."},
]
CHOICE_TASKS = {  # name -> (documents, what differs)
    "lp_mc": (CHOICE_DOCS, {"doc_to_text": "{{question}}", "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}"}),
    # the right choice named by its text (lm-eval reads a text of digits as an index), a description
    # before each question, no target delimiter
    "lp_mc_text": (CHOICE_DOCS, {"doc_to_text": "{{question}}", "doc_to_choice": "{{choices}}",
                                 "doc_to_target": "{{choices[answer]}}", "description": "Answer briefly.\n",
                                 "target_delimiter": ""}),
    "lp_mc_input": (INPUT_DOCS, {"doc_to_text": "{{label}}", "doc_to_choice": "{{options}}", "doc_to_target": "{{rest}}"}),
}


def _write_choice_tasks(folder: Path, extra: dict | None = None) -> list[str]:
    """The multiple-choice tasks (and `extra`: name -> (documents, fields)) as local lm-eval YAML."""
    import yaml

    for name, (docs, fields) in {**CHOICE_TASKS, **(extra or {})}.items():
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
        task = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
                "test_split": "test", "output_type": "multiple_choice",
                "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}], **fields}
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(task))
    return list(CHOICE_TASKS)


def test_choice_answers_rank_choices_as_lm_evaluation_harness_does():
    from layerplan.search.measures import ChoiceAnswers
    from layerplan.search.probes import ChoiceQuestion

    questions = (ChoiceQuestion(0, (1, 10), (1,)),  # the longer choice wins only per character
                 ChoiceQuestion(2, (3, 3, 3), (1,)),  # a tie: the first of the equal ones counts (numpy's argmax)
                 ChoiceQuestion(5, (2, 2, 2), (0, 2)))  # two right choices
    logprob = torch.tensor([-2.0, -5.0, -1.0, -1.0, -3.0, -4.0, -6.0, -0.5], dtype=torch.float64)
    got = ChoiceAnswers.of(questions, logprob)
    assert got.acc.tolist() == [False, False, True] and got.acc_norm.tolist() == [True, False, True]
    assert got.margin.tolist() == [-3.0, 0.0, 5.5] and got.logprob.tolist() == [-5.0, -1.0, -0.5]


def _check_choice_agreement(model, plan, folder: Path) -> None:
    """Each multiple-choice task through lm-eval's simple_evaluate (the LayerplanLM wrapper) and
    through the probe: the same acc and acc_norm per document and in all, the same choice
    log-likelihoods, and the probe's items are lm-eval's requests."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from layerplan.app.integrations.harness import LayerplanLM

    names = _write_choice_tasks(folder)
    lm = LayerplanLM(pretrained=model, plan=plan.to_string())
    out = lm_eval.simple_evaluate(model=lm, tasks=names, log_samples=True,
                                  task_manager=TaskManager(include_path=str(folder), include_defaults=False))
    for name in names:
        scorers = build_scorers(model, ["task", "task-norm", "task-ll"],
                                MeasureInputs(probe_items=10, task=name, include_path=str(folder)))
        scorer = scorers["task"].scorer
        samples = sorted(out["samples"][name], key=lambda sample: sample["doc_id"])
        assert [(item.prompt, item.answer) for item in scorer.items] == [tuple(args[:2]) for s in samples
                                                                         for args in s["arguments"]]
        got = scorer.choices(plan)
        assert got.acc.tolist() == [bool(s["acc"]) for s in samples]
        assert got.acc_norm.tolist() == [bool(s["acc_norm"]) for s in samples]
        lls = [float(resp[0][0]) for s in samples for resp in s["resps"]]
        assert scorer.answers(plan).logprob.tolist() == pytest.approx(lls, abs=2e-4)
        results = out["results"][name]
        assert point_value(scorers["task"], plan) == results["acc,none"]
        assert point_value(scorers["task-norm"], plan) == results["acc_norm,none"]
        assert point_value(scorers["task-ll"], plan) == pytest.approx(float(got.margin.mean()))


def test_a_multiple_choice_task_scores_as_lm_evaluation_harness_does(tiny, tmp_path):
    pytest.importorskip("lm_eval")
    model, _ = tiny
    _check_choice_agreement(model, model.plan("0-2,1-3"), tmp_path)


@pytest.mark.real
def test_a_multiple_choice_task_scores_as_lm_evaluation_harness_does_on_the_real_model(smollm2, tmp_path):
    pytest.importorskip("lm_eval")
    _check_choice_agreement(smollm2, smollm2.plan("0-14,12-29"), tmp_path)


def test_a_scanned_multiple_choice_score_equals_the_plan_run_alone(tiny, tmp_path):
    """The shared-prefix scan (single and double repeats) and each plan run alone from the
    embeddings give the same acc, acc_norm and margin; the log-likelihoods equal one plain
    forward pass per context + choice (no batch, no padding)."""
    pytest.importorskip("lm_eval")
    model, _ = tiny
    _write_choice_tasks(tmp_path)
    names = ["task", "task-norm", "task-ll"]
    inputs = MeasureInputs(probe_items=10, task="lp_mc", include_path=str(tmp_path))
    scorers = build_scorers(model, names, inputs)
    assert scorers["task"].scorer is scorers["task-norm"].scorer is scorers["task-ll"].scorer  # one pass serves all
    assert len(scorers["task"].scorer.items) == sum(len(d["choices"]) for d in CHOICE_DOCS)
    result = block_scan(model, scorers, block_candidates(4), (1, 2))
    alone = build_scorers(model, names, inputs, reuse=False)
    assert [s.measure for s in result.rows[0].scores] == names
    for row in result.rows:
        plan = model.plan(row.plan)
        for name in names:
            assert row.score(name).value == pytest.approx(point_value(alone[name], plan), abs=1e-9)
        assert row.score("task-ll").detail == pytest.approx(float(alone["task"].scorer.choices(plan).logprob.mean()))
    tok, plan = model.tokenizer, model.plan(result.rows[3].plan)
    direct = []
    for item in scorers["task"].scorer.items:
        context, answer = tok.encode(item.prompt), tok.encode(item.answer)
        logp = torch.log_softmax(forward(model, torch.tensor([context + answer]), plan).float(), -1)[0]
        direct.append(float(logp[len(context) - 1 : -1].gather(1, torch.tensor(answer)[:, None]).sum()))
    assert scorers["task"].scorer.answers(plan).logprob.tolist() == pytest.approx(direct, abs=1e-4)


UNSUPPORTED = "task lp_roll is loglikelihood_rolling; a probe takes loglikelihood, generate_until or multiple_choice tasks"


def _write_one_answer_tasks(folder: Path) -> None:
    """lp_one (loglikelihood) and lp_roll (loglikelihood_rolling, which no probe takes)."""
    import yaml

    data = folder / "text.jsonl"
    data.write_text(json.dumps({"q": "Q: 3 + 4 =\nA:", "a": "7"}) + "\n")
    for name, output in (("lp_roll", "loglikelihood_rolling"), ("lp_one", "loglikelihood")):
        task = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
                "test_split": "test", "output_type": output, "doc_to_text": "{{q}}", "doc_to_target": "{{a}}"}
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(task))


def test_task_probes_name_what_they_cannot_score(tiny, tmp_path):
    pytest.importorskip("lm_eval")
    model, _ = tiny
    fields = CHOICE_TASKS["lp_mc"][1]
    _write_choice_tasks(tmp_path, {"lp_bad_answer": ([CHOICE_DOCS[0], {**CHOICE_DOCS[1], "answer": 7}], fields),
                                   "lp_bad_first": ([{**CHOICE_DOCS[0], "answer": 7}], fields)})
    _write_one_answer_tasks(tmp_path)
    for measure, task, message in (
            ("task", "lp_roll", UNSUPPORTED),
            ("task-norm", "lp_one", "the task-norm measure needs a multiple_choice task; lp_one has one answer per document"),
            ("task", "lp_bad_answer", "task lp_bad_answer, document 1: the answer 7 is not one of its 3 choices"),
            ("task", "lp_bad_first", "lm-evaluation-harness cannot build task lp_bad_first: IndexError")):
        with pytest.raises(ValueError, match=re.escape(message)):
            build_scorers(model, [measure], MeasureInputs(task=task, include_path=str(tmp_path)))


@pytest.mark.real
def test_explore_blocks_takes_a_multiple_choice_task_from_the_command_line(smollm2, tmp_path):
    pytest.importorskip("lm_eval")
    from click.testing import CliRunner

    from layerplan.app.cli import main

    _write_choice_tasks(tmp_path)
    _write_one_answer_tasks(tmp_path)
    out = tmp_path / "run"
    common = ["explore", "--blocks", "--include-path", str(tmp_path), "--range", "12-12", "--out", str(out)]
    result = CliRunner().invoke(main, [*common, "--task", "lp_mc", "--measure", "task-norm", "--measure", "task-ll"])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "blocks.json").read_text())
    assert report["measures"] == ["task-norm", "task-ll", "task"] and len(report["rows"]) == 1
    base = {score["measure"]: score["value"] for score in report["base"]}
    assert base["task"] in (0.0, 0.25, 0.5, 0.75, 1.0) and base["task-norm"] in (0.0, 0.25, 0.5, 0.75, 1.0)
    result = CliRunner().invoke(main, [*common, "--task", "lp_roll", "--measure", "task"])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert [line for line in result.output.splitlines() if "Error" in line] == [f"Error: {UNSUPPORTED}"], result.output


@pytest.mark.real
def test_scanned_perplexity_equals_the_plan_run_alone_on_the_real_model(smollm2):
    """The same on the packaged model and its engine (the native kernels where they run)."""
    ids = torch.tensor([smollm2.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4)[:40]])
    scorer = PerplexityScorer(smollm2, ids, smollm2.plan())
    result = block_scan(smollm2, {"ppl": scorer}, [(12, 13), (20, 20)])
    for row in result.rows:
        alone = perplexity(smollm2, ids, smollm2.plan(row.plan), window=40, stride=40).perplexity
        assert row.score("ppl").value == pytest.approx(alone, rel=1e-6)


def test_merge_study_takes_repeated_layers_from_a_second_model(tmp_path):
    pytest.importorskip("optuna")
    model = tiny_model("llama", num_layers=4, seed=0)
    model.attach(tiny_model("llama", num_layers=4, seed=1), "b")
    ids = torch.randint(3, VOCAB, (1, 24), generator=torch.Generator().manual_seed(0))
    scorer = PerplexityScorer(model, ids, model.plan())
    space = MergeSpace((1, 2), max_len=2, max_repeats=1, scales=(1.0, 1.0), sources=("", "b"))
    seeds = [{"start": 1, "length": 2, "repeats": 1, "source": "b"}]
    result = merge_study(model, scorer, "ppl", space, 2, str(tmp_path / "s.db"), seeds=seeds)
    first = model.plan(result.trials[0].plan)
    assert result.trials[0].plan == "a:0-2,b:1-2,a:3" and first.models == ("b",)
    alone = perplexity(model, ids, first, window=24, stride=24).perplexity
    assert result.trials[0].values[0] == pytest.approx(alone, rel=1e-6)


def test_a_misspelt_task_is_refused_without_indexing_the_built_in_tasks(tmp_path, monkeypatch):
    """A name no built-in task file spells out is refused from the include path's index and a byte
    scan; the built-in index (~15 s of YAML) is read only for a name that could be in it."""
    pytest.importorskip("lm_eval")
    import yaml

    from layerplan.search import probes

    task = {"task": "lp_here", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": "x.jsonl"}},
            "test_split": "test", "output_type": "loglikelihood", "doc_to_text": "{{prompt}}", "doc_to_target": "{{answer}}"}
    (tmp_path / "lp_here.yaml").write_text(yaml.safe_dump(task))
    indexed = []
    monkeypatch.setattr(probes, "_all_tasks", lambda include_path: indexed.append(include_path) or pytest.fail("indexed"))
    assert probes._spelled_in_built_in_tasks("arc_easy") and not probes._spelled_in_built_in_tasks("lp_no_such_task")
    with pytest.raises(ValueError, match=rf"^no lm-evaluation-harness task 'lp_no_such_task' \(in {re.escape(str(tmp_path))} "
                                         r"or built in\); `lm_eval ls tasks` lists them$"):
        probes.task_manager(["lp_here", "lp_no_such_task"], str(tmp_path))
    with pytest.raises(ValueError, match=r"^no lm-evaluation-harness task 'lp_no_such_task'; "):
        probes.task_manager(["lp_no_such_task"])
    assert probes.task_manager(["lp_here"], str(tmp_path)).all_tasks == ["lp_here"] and indexed == []
