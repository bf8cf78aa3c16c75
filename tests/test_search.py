"""Plan search: the shared evaluator, greedy skipping, Optuna studies, resumption, shared storage."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from layerplan.engine.runner import forward
from layerplan.plan.plan import LayerPlan
from layerplan.search.bayes import plan_from_params, run_study
from layerplan.search.evaluate import Reference
from layerplan.search.evaluator import PlanEvaluator, measure_costs
from layerplan.search.greedy import GreedyResult, GreedyStep, greedy_search
from layerplan.search.objectives import score
from layerplan.search.run import run_search, speed_on_prompts
from layerplan.search.scan import scan
from studies import assert_exact_and_distinct, fork_worker, kill_mid_trial, run_workers
from tiny import VOCAB, tiny_model


@pytest.fixture(scope="module")
def setup():
    model = tiny_model("llama", num_layers=4)
    ids = torch.randint(3, VOCAB, (1, 32), generator=torch.Generator().manual_seed(0))
    return model, ids


@pytest.mark.parametrize("text", ["full", "skip:attn=2", "skip:mlp=1;attn=3", "exit:3", "skip:layers=0", "0,1,1,2,3"])
def test_evaluator_resume_equals_direct_evaluation(setup, text):
    model, ids = setup
    plan = model.plan(text)
    expected = Reference(forward(model, ids), ids).divergence(forward(model, ids, plan))
    got = PlanEvaluator(model, ids).divergence(plan)
    assert got.kl == pytest.approx(expected.kl, rel=1e-5, abs=1e-7)
    assert got.top1_agreement == expected.top1_agreement


def test_evaluator_memo_hits_whatever_name_a_plan_was_parsed_with(setup):
    model, ids = setup
    evaluator = PlanEvaluator(model, ids)
    first = evaluator.divergence(model.plan("skip:attn=2"))
    assert evaluator.divergence(LayerPlan.from_skips(model.num_layers, attention=[2])) is first
    assert evaluator.evaluations == 1


def test_greedy_first_step_is_the_scans_least_harmful_item_and_resumes(setup, tmp_path):
    model, ids = setup
    least = min(scan(model, ids, kinds=["attention", "mlp"]).items, key=lambda i: i.kl)
    state = tmp_path / "greedy.json"
    first = greedy_search(PlanEvaluator(model, ids), "kl", budget=2, allow_ends=True, state_file=state)
    assert first.steps[0].item == f"{least.kind} {least.layer}"
    assert [s.cost for s in first.steps] == [0.875, 0.75]
    assert first.steps[0].value <= first.steps[1].value  # each step adds damage
    evaluator = PlanEvaluator(model, ids)
    resumed = greedy_search(evaluator, "kl", budget=3, allow_ends=True, state_file=state)
    assert [s.item for s in resumed.steps[:2]] == [s.item for s in first.steps]
    assert len(resumed.steps) == 3
    assert evaluator.evaluations <= 6  # only the third pass ran
    assert json.loads(state.read_text())["steps"][2]["item"] == resumed.steps[2].item


def test_greedy_keeps_the_ends_and_anti_mode_adds_back(setup):
    model, ids = setup
    forward_result = greedy_search(PlanEvaluator(model, ids), "kl", budget=10)
    assert all(s.item.split()[1] in ("1", "2") for s in forward_result.steps)
    assert len(forward_result.steps) == 4  # every sub-layer of layers 1-2; layers 0 and 3 are kept
    assert forward_result.best_plan == "skip:layers=1-2"
    anti = greedy_search(PlanEvaluator(model, ids), "kl", budget=2, mode="anti")
    assert anti.steps[0].cost == pytest.approx(5 / 8)  # ends on (4 sub-layers) + one added back
    assert anti.steps[1].value <= anti.steps[0].value


def test_greedy_best_plan_is_one_rule_for_the_answer_the_report_and_the_study_seed(setup, tmp_path):
    steps = [GreedyStep("attention 1", "skip:attn=1", 1.3, 0.9), GreedyStep("attention 2", "skip:attn=1-2", 1.2, 0.8)]
    # speedup weighs cost: its best-valued step is the answer, even when later steps score lower
    assert GreedyResult("m", "speedup", "forward", steps).best_plan == "skip:attn=1"
    # agreement is quality only: every skip costs some; the answer is the plan at the budget
    assert GreedyResult("m", "agreement", "forward", steps).best_plan == "skip:attn=1-2"
    assert GreedyResult("m", "kl", "forward", []).best_plan == "full"
    model, ids = setup
    result = run_search(model, ids, "agreement", "both", trials=3, budget=2, folder=tmp_path)
    assert result.to_dict()["greedy"]["best_plan"] == result.greedy.best_plan
    assert [t.plan for t in result.study.trials[:2]] == ["full", result.greedy.best_plan]


def test_study_is_seeded_resumes_and_reports(setup, tmp_path):
    model, ids = setup
    storage = str(tmp_path / "study.db")
    evaluator = PlanEvaluator(model, ids)
    seeds = [model.plan(), model.plan("skip:attn=1")]
    first = run_study(evaluator, "kl", 6, storage, "s", seeds=seeds)
    assert [t.plan for t in first.trials[:2]] == ["full", "skip:attn=1"]
    assert first.best_plan == "full" and first.best_value == pytest.approx(0.0, abs=1e-6)
    again = run_study(PlanEvaluator(model, ids), "kl", 9, storage, "s", seeds=seeds)
    complete = [t for t in again.trials if t.state == "COMPLETE"]
    assert len(complete) == 9
    assert [t.plan for t in again.trials[:len(first.trials)]] == [t.plan for t in first.trials]  # nothing lost
    assert len({t.plan for t in complete}) == 9  # and no plan evaluated twice


def test_a_study_keeps_one_objective_model_and_token_count(setup, tmp_path):
    """`search --objective agreement --study <a KL study>` exited 0 with "best agreement 1.06e-06":
    the study stayed MINIMIZE and held KL and agreement values side by side."""
    import optuna

    from layerplan.search.bayes import make_storage

    model, ids = setup
    storage = str(tmp_path / "study.db")
    run_study(PlanEvaluator(model, ids), "kl", 2, storage, "s")
    attrs = optuna.load_study(study_name="s", storage=make_storage(storage)).user_attrs
    assert attrs == {"objective": "kl", "directions": ["minimize"], "model": model.name, "tokens": ids.numel()}
    with pytest.raises(ValueError, match=r"study 's' in this storage was made for objective 'kl', not 'ppl'"):
        run_study(PlanEvaluator(model, ids), "ppl", 3, storage, "s")  # the same direction: caught by its name
    with pytest.raises(ValueError, match=r"objective 'kl', not 'agreement'; directions \['minimize'\], not "
                                         r"\['maximize'\]"):
        run_study(PlanEvaluator(model, ids), "agreement", 3, storage, "s")
    with pytest.raises(ValueError, match=r"tokens 32, not 16"):
        run_study(PlanEvaluator(model, ids[:, :16]), "kl", 3, storage, "s")
    again = run_study(PlanEvaluator(model, ids), "kl", 3, storage, "s")  # the same question resumes
    assert len([t for t in again.trials if t.state == "COMPLETE"]) == 3


def test_a_study_made_before_studies_kept_their_objective_is_adopted_when_its_direction_matches(setup, tmp_path):
    import optuna

    from layerplan.search.bayes import make_storage

    model, ids = setup
    storage = str(tmp_path / "old.db")
    optuna.create_study(storage=make_storage(storage), study_name="old", direction="minimize")
    with pytest.raises(ValueError, match=r"directions \['minimize'\], not \['maximize'\]"):
        run_study(PlanEvaluator(model, ids), "agreement", 1, storage, "old")
    run_study(PlanEvaluator(model, ids), "kl", 1, storage, "old")
    assert optuna.load_study(study_name="old", storage=make_storage(storage)).user_attrs["objective"] == "kl"


def test_a_study_runs_each_plan_once_and_stops_when_it_has_run_them_all(setup, tmp_path):
    from optuna.trial import TrialState

    model, ids = setup  # 4 layers, the ends kept: 4 switches, 16 plans
    storage = f"journal:{tmp_path / 'study.log'}"
    for asked in (16, 20):  # 20: more trials than plans; the study ends when every plan is run
        result = run_study(PlanEvaluator(model, ids), "kl", asked, storage, "small", seed=1)
        complete = [t for t in result.trials if t.state == "COMPLETE"]
        assert len(complete) == len({t.plan for t in complete}) == 16
        assert not [t for t in result.trials if t.state == TrialState.RUNNING.name]
    repeats = [t for t in result.trials if t.state == "PRUNED" and t.plan]
    assert repeats  # the sampler did propose held plans: they were looked up, not run
    values = {t.plan: t.values for t in complete}
    assert all(t.values == values[t.plan] for t in repeats)


def test_a_seed_makes_a_study_reproducible_and_no_seed_varies_it(setup, tmp_path):
    model, ids = setup

    def plans(seed, folder):
        result = run_study(PlanEvaluator(model, ids), "kl", 5, f"journal:{tmp_path / folder / 's.log'}", "s", seed=seed)
        return [t.plan for t in result.trials]

    assert plans(7, "a") == plans(7, "b")
    assert plans(None, "c") != plans(None, "d")


def test_a_study_leaves_optuna_logging_to_the_application(setup, tmp_path):
    import optuna

    model, ids = setup
    chosen = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.DEBUG)
    try:
        run_study(PlanEvaluator(model, ids), "kl", 2, str(tmp_path / "study.db"), "quiet")
        assert optuna.logging.get_verbosity() == optuna.logging.DEBUG
    finally:
        optuna.logging.set_verbosity(chosen)


def test_multi_objective_study_on_a_journal_file(setup, tmp_path):
    model, ids = setup
    result = run_study(PlanEvaluator(model, ids), "agreement", 8, f"journal:{tmp_path / 'j.log'}", "m",
                       multi_objective=True, seeds=[model.plan()])
    assert result.directions == ["maximize", "minimize"]
    assert result.pareto and all(len(p.values) == 2 for p in result.pareto)


def test_speedup_objective_uses_measured_costs(setup):
    model, ids = setup
    costs = measure_costs(model, context=16, repeats=5)
    assert costs.relative_cost(model.plan()) == pytest.approx(1.0)
    assert costs.relative_cost(model.plan("exit:2")) < 1.0
    evaluator = PlanEvaluator(model, ids)
    assert score("speedup", model.plan(), evaluator, costs) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="needs a measured cost model"):
        score("speedup", model.plan(), evaluator)


def test_tokens_per_second_needs_prompts(setup):
    model, ids = setup
    evaluator = PlanEvaluator(model, ids)
    with pytest.raises(ValueError, match="on prompts"):
        score("tokens-per-second", model.plan(), evaluator)  # was 0.0 for every plan
    timed = speed_on_prompts(model, [ids[:, :8]], new_tokens=4)
    assert score("tokens-per-second", model.plan("exit:2"), evaluator, timed_speed=timed) > 0


def test_plan_from_trial_params():
    plan = plan_from_params(4, {"attn_1": False, "mlp_1": True, "attn_2": True, "mlp_2": False})
    assert plan.to_string() == "skip:attn=1;mlp=2"


class _HangingEvaluator(PlanEvaluator):
    """Hangs in its fourth evaluation (mid-study, mid-trial) after touching `marker`, until killed."""

    def __init__(self, model, ids, marker: Path | None) -> None:
        super().__init__(model, ids)
        self.marker = marker

    def divergence(self, plan, give_up=None):
        if self.marker is not None and self.evaluations >= 3:
            self.marker.touch()
            time.sleep(600)
        return super().divergence(plan, give_up)


def _work(model, storage: str, trials: int, marker: Path | None) -> None:
    torch.set_num_threads(1)  # a forked child must not reuse the parent's thread pool
    ids = torch.randint(3, VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))
    run_study(_HangingEvaluator(model, ids, marker), "kl", trials, storage, "shared", seeds=[model.plan()], poll=0.05)


@pytest.fixture(scope="module")
def worker_model():
    return tiny_model("llama", num_layers=6)  # 8 switchable sub-layers: 256 plans


@pytest.mark.parametrize("kind,count", [("sqlite", 2), ("sqlite", 4), ("journal", 2), ("journal", 4)])
def test_worker_processes_share_one_study_exactly(worker_model, tmp_path, kind, count):
    storage = str(tmp_path / "shared.db") if kind == "sqlite" else f"journal:{tmp_path / 'shared.log'}"
    run_workers(_work, count, worker_model, storage, 10, None)
    found = assert_exact_and_distinct(storage, 10)
    seeds = {t.user_attrs.get("sampler_seed") for t in found if "sampler_seed" in t.user_attrs}
    assert len(seeds) == len({t.user_attrs["worker"] for t in found})  # a sampler seed per worker


def _ask_enqueued(storage: str, asks: int, queue) -> None:
    import optuna

    from layerplan.search.bayes import make_storage
    from layerplan.search.workers import claiming

    study = optuna.load_study(study_name="claims", storage=make_storage(storage, heartbeat=None))
    numbers = []
    for _ in range(asks):
        with claiming(storage):
            numbers.append(study.ask().number)
    queue.put(numbers)


def test_workers_asking_together_never_pop_the_same_enqueued_trial(tmp_path):
    # Optuna alone on SQLite hands one WAITING trial to two askers (measured: 49-53 distinct
    # trials out of 60 asks by 4 processes), which made two workers run, then tell, one trial
    import multiprocessing

    import optuna

    from layerplan.search.bayes import make_storage

    storage = str(tmp_path / "claims.db")
    study = optuna.create_study(study_name="claims", storage=make_storage(storage, heartbeat=None))
    for x in range(60):
        study.enqueue_trial({"x": x}, skip_if_exists=False)
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    procs = [context.Process(target=_ask_enqueued, args=(storage, 15, queue)) for _ in range(4)]
    for p in procs:
        p.start()
    numbers = [n for _ in procs for n in queue.get(timeout=120)]
    for p in procs:
        p.join(timeout=60)
    assert sorted(numbers) == list(range(60))


@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_a_study_killed_mid_trial_resumes_without_repeating_or_leaving_it_running(worker_model, tmp_path, kind):
    from optuna.trial import TrialState

    storage = str(tmp_path / "study.db") if kind == "sqlite" else f"journal:{tmp_path / 'study.log'}"
    marker = tmp_path / "in-trial"
    killed = kill_mid_trial(_work, (worker_model, storage, 8, marker), storage, marker)
    run_workers(_work, 1, worker_model, storage, 8, None)
    found = assert_exact_and_distinct(storage, 8)
    assert found[killed.number].state == TrialState.FAIL
    first, resumed = (t.user_attrs.get("sampler_seed") for t in (found[1], found[-1]))
    assert first != resumed  # the resumed worker does not replay the killed one's proposals


def _pg_bin() -> Path | None:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl")) if Path("/usr/lib/postgresql").exists() else []
    return found[-1].parent if found else None


@pytest.fixture
def postgres():
    """A throwaway PostgreSQL server on 127.0.0.1, run as the 'postgres' user."""
    import tempfile

    bin_dir = _pg_bin()
    if bin_dir is None or shutil.which("runuser") is None:
        pytest.skip("PostgreSQL is not installed (Debian package 'postgresql'; .ci/run installs it when it can)")
    pytest.importorskip("psycopg", reason="psycopg (3) is needed to talk to PostgreSQL")
    if os.geteuid() != 0:
        pytest.skip("starting a PostgreSQL server as the 'postgres' user needs root (runuser)")
    tmp_path = Path(tempfile.mkdtemp(prefix="layerplan-pg-"))  # pytest's tmp root is private to root
    data = tmp_path / "pgdata"
    data.mkdir()
    shutil.chown(tmp_path, "postgres")
    shutil.chown(data, "postgres")
    with socket.socket() as sock:  # a free port: a server left by an interrupted run keeps its own
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]

    def as_postgres(*args):
        subprocess.run(["runuser", "-u", "postgres", "--", *args], check=True, capture_output=True)

    as_postgres(str(bin_dir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres")
    as_postgres(str(bin_dir / "pg_ctl"), "-D", str(data), "-o", f"-p {port} -k {tmp_path} -h 127.0.0.1",
                "-l", str(tmp_path / "pg.log"), "-w", "start")
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        as_postgres(str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop")
        shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.parametrize("count", [2, 4])
def test_workers_share_a_study_in_postgresql_exactly(worker_model, postgres, count):
    run_workers(_work, count, worker_model, postgres, 10, None)
    assert_exact_and_distinct(postgres, 10)


def _open_storage_on_signal(url, go, results):
    from layerplan.search.bayes import make_storage

    go.wait()
    try:
        make_storage(url)
        results.put("ok")
    except Exception as error:  # noqa: BLE001 - the test reports whatever a worker met
        results.put(f"{type(error).__name__}: {str(error).splitlines()[0]}")


def test_workers_that_open_an_empty_postgresql_database_together_all_get_the_study(postgres):
    """Workers started at once race to create Optuna's schema: the losers of CREATE TABLE get
    "relation already exists" (a ProgrammingError) and must retry, not fail. Without the retry this
    failed in about one round of four here."""
    import multiprocessing

    import psycopg

    context = multiprocessing.get_context("fork")  # the queue and event of fork_worker's processes
    base = postgres.rsplit("/", 1)[0]
    for round_ in range(8):
        with psycopg.connect(postgres, autocommit=True) as connection:
            connection.execute(f"CREATE DATABASE together{round_}")
        go, results = context.Event(), context.Queue()
        procs = [fork_worker(_open_storage_on_signal, f"{base}/together{round_}", go, results) for _ in range(6)]
        time.sleep(0.3)
        go.set()
        outcomes = [results.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(timeout=60)
        assert outcomes == ["ok"] * len(procs), f"round {round_}: {outcomes}"


def test_storage_in_a_folder_that_does_not_exist_yet(tmp_path):
    from layerplan.search.bayes import make_storage

    for url in (str(tmp_path / "new" / "a" / "study.db"), f"journal:{tmp_path / 'other' / 'b' / 'journal.log'}"):
        storage = make_storage(url)
        assert storage is not None
    assert (tmp_path / "new" / "a" / "study.db").exists()
    assert (tmp_path / "other" / "b").is_dir()


@pytest.mark.parametrize("objective", ["kl", "ppl", "agreement"])
def test_early_abort_changes_nothing_but_the_work(objective):
    model = tiny_model("llama", num_layers=8)
    ids = torch.randint(3, VOCAB, (1, 320), generator=torch.Generator().manual_seed(1))  # 10 chunks of 32
    runs = {}
    for abort in (False, True):
        evaluator = PlanEvaluator(model, ids)
        result = greedy_search(evaluator, objective, budget=4, allow_ends=True, prune=0.5, min_alive=2,
                               early_abort=abort)
        runs[abort] = ([(s.item, s.plan, s.value) for s in result.steps], evaluator.aborted)
    assert runs[True][0] == runs[False][0]
    assert runs[False][1] == 0
    if objective == "kl":  # on this model and text, some KL candidate is provably out before the end
        assert runs[True][1] > 0


def test_bounds_of_an_aborted_candidate_are_on_the_right_side(setup):
    model, _ = setup
    ids = torch.randint(3, VOCAB, (1, 256), generator=torch.Generator().manual_seed(2))
    plan = model.plan("skip:layers=1")
    full = PlanEvaluator(model, ids).divergence(plan)
    early = PlanEvaluator(model, ids).divergence(plan, give_up=lambda bounds: True)
    assert not early.complete and full.complete
    assert early.kl <= full.kl and early.perplexity <= full.perplexity and early.top1_agreement >= full.top1_agreement


# --- the steps of one worker's study (BayesOptimisation), one at a time -------------------------

def _toy_optimisation(storage=None, n_trials=3, seeds=(), on_trial=None):
    """Two switches (attention and MLP of layer 1 of 4): four plans; a plan's value is its cost."""
    from types import SimpleNamespace

    from layerplan.search.bayes import BayesOptimisation, skip_space

    space = skip_space(SimpleNamespace(num_layers=4, name="toy"), [("attention", 1), ("mlp", 1)])
    return BayesOptimisation(space, lambda plan: float(plan.cost), "kl", ["minimize"], n_trials, storage, "toy",
                             seeds=list(seeds), seed=0, on_trial=on_trial, poll=0.01)


def _params(attn: bool, mlp: bool) -> dict:
    return {"attn_1": attn, "mlp_1": mlp}


def test_open_seeds_a_new_study_and_not_a_resumed_one(tmp_path):
    from optuna.trial import TrialState

    storage = f"journal:{tmp_path / 'toy.log'}"
    first = _toy_optimisation(storage, seeds=[_params(False, True)])
    first.open()
    assert [t.state for t in first.study.get_trials()] == [TrialState.WAITING]
    again = _toy_optimisation(storage, seeds=[_params(True, False)])
    again.open()
    assert [t.system_attrs["fixed_params"] for t in again.study.get_trials()] == [_params(False, True)]


def test_run_trial_evaluates_a_new_plan_and_prunes_a_held_one_with_the_holders_values():
    optimisation = _toy_optimisation()
    optimisation.open()
    for _ in range(2):
        optimisation.study.enqueue_trial(_params(False, True))
    first = optimisation.ask()
    assert optimisation.worker_seed is not None and optimisation.rng is not None
    assert optimisation.run_trial(first) == "complete"
    second = optimisation.ask()
    assert optimisation.run_trial(second) == "duplicate"
    told = optimisation.study.get_trials()[1]
    assert told.user_attrs["duplicate_of"] == first.number
    assert told.user_attrs["copied_values"] == optimisation.study.get_trials()[0].values
    assert told.user_attrs["plan"] == "skip:attn=1"


def test_turn_says_full_once_the_study_has_its_trials_and_the_trial_is_failed():
    from optuna.trial import TrialState

    optimisation = _toy_optimisation(n_trials=1)
    optimisation.open()
    optimisation.study.enqueue_trial(_params(False, True))
    optimisation.study.enqueue_trial(_params(True, False))
    assert optimisation.run_trial(optimisation.ask()) == "complete"
    assert optimisation.turn(99, "skip:mlp=1") == ("full", None)
    assert optimisation.run_trial(optimisation.ask()) == "full"
    assert optimisation.study.get_trials()[1].state == TrialState.FAIL


def test_enqueue_unseen_draws_a_plan_nobody_holds_until_none_is_left():
    optimisation = _toy_optimisation(n_trials=10)
    optimisation.open()
    for attn, mlp in ((True, True), (False, True), (True, False)):
        optimisation.study.enqueue_trial(_params(attn, mlp))
        assert optimisation.run_trial(optimisation.ask()) == "complete"
    optimisation.repeats = 3
    assert optimisation.enqueue_unseen(optimisation.look()) and optimisation.repeats == 0
    assert optimisation.queued_plan(optimisation.study.get_trials()[-1]) == "skip:layers=1"
    assert not optimisation.enqueue_unseen(optimisation.look())  # all four held (one of them queued)


def test_step_reports_progress_and_ends_when_the_study_is_full():
    seen = []
    optimisation = _toy_optimisation(n_trials=2, on_trial=lambda done, total: seen.append((done, total)))
    optimisation.open()
    steps = 0
    while optimisation.step():
        steps += 1
    assert seen[0] == (0, 2) and seen[-1] == (2, 2)
    result = optimisation.result()
    assert len([t for t in result.trials if t.state == "COMPLETE"]) == 2 and result.stale_failed == []
