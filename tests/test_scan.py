import pytest
import torch

from layerplan.app.report import exits_plot, scan_heatmap
from layerplan.engine.runner import forward
from layerplan.search.evaluate import Reference
from layerplan.search.scan import scan
from tiny import VOCAB, tiny_model


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt2"])
def test_reuse_gives_the_same_numbers_as_recomputing(arch):
    model = tiny_model(arch, num_layers=4)
    ids = torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    fast, naive = scan(model, ids), scan(model, ids, reuse=False)
    assert len(fast.items) == 12
    for a, b in zip(fast.items, naive.items):
        assert (a.kind, a.layer) == (b.kind, b.layer)
        assert a.kl == pytest.approx(b.kl, rel=1e-5, abs=1e-7)
        assert a.perplexity == pytest.approx(b.perplexity, rel=1e-5)


def test_scan_item_equals_direct_evaluation_of_the_skip_plan():
    model = tiny_model("qwen3", num_layers=3)
    ids = torch.randint(3, VOCAB, (1, 20), generator=torch.Generator().manual_seed(1))
    result = scan(model, ids)
    expected = Reference(forward(model, ids), ids).divergence(forward(model, ids, model.plan("skip:mlp=1")))
    item = result.item("mlp", 1)
    assert item.kl == pytest.approx(expected.kl, rel=1e-5)
    assert item.top1_agreement == pytest.approx(expected.top1_agreement)


def test_scan_of_a_partial_plan_skips_what_is_already_off(tmp_path):
    model = tiny_model("llama", num_layers=3)
    ids = torch.randint(3, VOCAB, (1, 12))
    result = scan(model, ids, model.plan("skip:attn=1"), kinds=["attention", "mlp"])
    assert result.item("attention", 1) is None
    assert result.item("mlp", 1) is not None
    ranked = result.ranked()  # every kind, least harmful first: what `layerplan scan` and the tune report list
    assert len(ranked) == len(result.items) and [i.kl for i in ranked] == sorted(i.kl for i in result.items)
    assert all(i.kind == "mlp" for i in result.ranked("mlp"))
    png = scan_heatmap(result, tmp_path / "scan.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="unknown scan kind"):
        scan(model, ids, kinds=["heads"])


def test_exit_scan_equals_direct_exits_and_plots(tmp_path):
    model = tiny_model("qwen2", num_layers=4)
    ids = torch.randint(3, VOCAB, (1, 16), generator=torch.Generator().manual_seed(2))
    result = scan(model, ids, kinds=["exit"])
    assert [i.step for i in result.items] == [1, 2, 3]
    reference = Reference(forward(model, ids), ids)
    for item in result.items:
        expected = reference.divergence(forward(model, ids, model.plan(f"exit:{item.step}")))
        assert item.kl == pytest.approx(expected.kl, rel=1e-5)
        assert item.layer == item.step - 1
    assert exits_plot(result, tmp_path / "exits.png").read_bytes()[:4] == b"\x89PNG"


def test_plots_leave_matplotlib_global_state_alone(tmp_path):
    """A library picture must not switch the backend an application or notebook chose."""
    import matplotlib

    model = tiny_model("llama", num_layers=2)
    result = scan(model, torch.randint(3, VOCAB, (1, 8)), kinds=["exit"])
    chosen = matplotlib.get_backend()
    matplotlib.use("pdf")
    try:
        exits_plot(result, tmp_path / "exits.png")
        assert matplotlib.get_backend() == "pdf"
    finally:
        matplotlib.use(chosen)


def test_an_interrupted_scan_runs_only_the_rest_when_started_again(tmp_path, monkeypatch):
    """A scan's journal keeps each finished candidate: the same scan started again after an
    interruption runs only the candidates not in it and gives the uninterrupted scan's items; a
    journal of another scan (other ids, another base plan) is started afresh; a line cut short
    is ignored."""
    from layerplan.search.evaluator import PlanEvaluator
    from layerplan.search.importance import ScanJournal, journal_path

    model = tiny_model("llama", num_layers=4)
    ids = torch.randint(3, VOCAB, (1, 16), generator=torch.Generator().manual_seed(3))
    whole = scan(model, ids)
    path = journal_path(tmp_path / "out", exits=False)

    def interrupted(done, total):
        if done == 5:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        scan(model, ids, on_progress=interrupted, journal=ScanJournal(path, ids.flatten().tolist()))
    assert len(path.read_text().splitlines()) == 1 + 5
    with path.open("a") as journal:
        journal.write('{"kind": "mlp", "st')  # (the process killed mid-line)

    runs = []
    divergence = PlanEvaluator.divergence
    monkeypatch.setattr(PlanEvaluator, "divergence", lambda self, plan, *a: runs.append(plan) or divergence(self, plan, *a))
    again = scan(model, ids, journal=ScanJournal(path, ids.flatten().tolist()))
    assert again.items == whole.items and again.resumed == 5 and len(runs) == len(whole.items) - 5
    ScanJournal(path, []).remove()
    assert not path.exists()

    other = torch.randint(3, VOCAB, (1, 16), generator=torch.Generator().manual_seed(4))
    with pytest.raises(KeyboardInterrupt):
        scan(model, ids, on_progress=interrupted, journal=ScanJournal(path, ids.flatten().tolist()))
    for other_ids, plan in ((other, None), (ids, model.plan("skip:attn=0"))):
        fresh = scan(model, other_ids, plan, journal=ScanJournal(path, other_ids.flatten().tolist()))
        assert fresh.resumed == 0
