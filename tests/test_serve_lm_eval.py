"""lm-evaluation-harness's own `local-completions` model against `layerplan serve`: it finds the
server's tokenizer by the /tokenize routes, scores continuations with echo + logprobs and
generates until its stop strings. Its numbers are the model's under the server's plan (a pass of
context and continuation says the same), so a plan can be evaluated by lm_eval's API client as
by `layerplan eval`. A tiny model with a byte tokenizer keeps it fast."""

import pytest
import torch

from layerplan.app.serve import create_app
from layerplan.decoding.generate import generate
from layerplan.decoding.prompt_logprobs import prompt_logprobs
from layerplan.decoding.sampling_params import SamplingParams
from layerplan.engine.runner import forward
from servers import serving

PAIRS = [("the cat sat on", " the mat"), ("hello", " world"), ("0101010", "1010")]


@pytest.fixture(scope="module")
def tiny(tiny_text_model):
    return tiny_text_model


def _scored(model, context: str, continuation: str, plan: str | None) -> tuple[float, bool]:
    """(log P(continuation | context), whether greedy decoding gives it), from one pass."""
    context_ids = model.tokenizer(context, add_special_tokens=False).input_ids
    ids = context_ids + model.tokenizer(continuation, add_special_tokens=False).input_ids
    with torch.inference_mode():
        logp = forward(model, torch.tensor([ids]), model.plan(plan))[0].float().log_softmax(-1)
    rows = logp[len(context_ids) - 1: len(ids) - 1]
    wanted = torch.tensor(ids[len(context_ids):])
    return float(rows.gather(1, wanted[:, None]).sum()), bool((rows.argmax(-1) == wanted).all())


@pytest.mark.parametrize("plan", [None, "skip:mlp=1", "0,1,1,2"])
def test_lm_evals_local_completions_scores_what_the_model_says_under_the_servers_plan(tiny, plan):
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    app = create_app(tiny, plan=tiny.plan(plan) if plan else None, served_name="tiny")
    with serving(app) as base:
        lm = LocalCompletionsAPI(base_url=f"{base}/v1/completions", model="tiny", tokenizer_backend="auto",
                                 max_length=128)
        assert lm.tokenizer_backend == "remote"  # found by /tokenizer_info and /tokenize
        got = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(PAIRS)])
        texts = lm.generate_until([Instance("generate_until", {}, ("the cat", {"until": ["x"], "max_gen_toks": 12}),
                                            0)])
    for (value, greedy), (context, continuation) in zip(got, PAIRS):
        expected, expected_greedy = _scored(tiny, context, continuation, plan)
        assert value == pytest.approx(expected, abs=1e-3) and greedy == expected_greedy
    alone = generate(tiny, tiny.tokenizer("the cat", add_special_tokens=False).input_ids,
                     tiny.plan(plan) if plan else None, 12, sampling=SamplingParams(), stop=["x"]).text
    assert texts == [alone]


def test_a_long_prompt_is_scored_in_chunks_as_in_one_pass(tiny):
    ids = tiny.tokenizer("the quick brown fox jumps over the lazy dog " * 2).input_ids
    whole = prompt_logprobs(tiny, ids, tiny.plan(), 2, chunk=len(ids))
    for chunk in (1, 3, 7):
        pieces = prompt_logprobs(tiny, ids, tiny.plan(), 2, chunk=chunk)
        assert [p.token for p in pieces] == ids[1:] == [w.token for w in whole]
        assert [p.logprob for p in pieces] == pytest.approx([w.logprob for w in whole], abs=1e-4)
        assert [[t for t, _ in p.top] for p in pieces] == [[t for t, _ in w.top] for w in whole]
