"""A logit bias (OpenAI's logit_bias, llama.cpp's -l/--logit-bias): added to the logits before
anything else, so greedy decoding takes it too; a speculative decode with it gives the plain
decode's tokens with it; a banned token (-inf) never comes; a bias out of range, or a token outside
the vocabulary, is one line naming it. A tiny model with a byte tokenizer keeps it fast."""

import math

import numpy as np
import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient

from layerplan.app.cli import main
from layerplan.app.serve import create_app
from layerplan.decoding.choice import processed_logits
from layerplan.decoding.generate import generate
from layerplan.decoding.rounds import target_pick
from layerplan.decoding.sampling_params import SamplingError, SamplingParams

REPETITIVE = "xxxxxxxxxxxxxxx"  # the tiny model continues it with one byte over and over: drafts get accepted


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from tiny_text import save_tiny_with_tokenizer

    return save_tiny_with_tokenizer(tmp_path_factory.mktemp("bias") / "tok")


@pytest.fixture(scope="module")
def tiny(folder):
    from layerplan.engine.load import load_model

    return load_model(str(folder), dtype="float32")


def test_the_bias_comes_before_the_penalty_and_greedy_takes_it():
    logits = np.array([1.0, 5.0, 2.0, -0.5], np.float32)
    assert target_pick(logits, SamplingParams(), [], 0) == 1
    assert target_pick(logits, SamplingParams(logit_bias=((1, -math.inf),)), [], 0) == 2
    assert target_pick(logits, SamplingParams(logit_bias=((3, 6.0),)), [], 0) == 3
    # -0.5 + 1 = 0.5 > 0, so the penalty divides it: bias first, then the penalty
    params = SamplingParams(repetition_penalty=2.0, logit_bias=((3, 1.0),))
    processed = processed_logits(logits, params, [3], 0)
    assert processed[3] == pytest.approx(0.25) and processed[0] == 1.0
    assert logits.tolist() == [1.0, 5.0, 2.0, -0.5]  # the caller's logits untouched


@pytest.mark.parametrize("bias, says", [
    (((1, 100.5),), "logit_bias 100.5 for token 1 is out of range"),
    (((1, math.nan),), "logit_bias nan for token 1 is out of range"),
    (((1, math.inf),), "or -inf to ban the token"),
    (((-1, 1.0),), "logit_bias token -1 is out of range"),
])
def test_a_bias_out_of_range_is_one_line_naming_it(bias, says):
    with pytest.raises(SamplingError, match=says.replace("(", r"\(")):
        SamplingParams(logit_bias=bias)
    with pytest.raises(SamplingError, match="token 300 is out of range: the vocabulary has ids 0-258"):
        SamplingParams(logit_bias=((300, 1.0),)).check_vocabulary(259)


@pytest.mark.parametrize("draft", ["suffix", "suffix:tree", "ngram|exit:2"])
def test_a_speculative_decode_with_a_bias_gives_the_plain_decodes_tokens_with_it(tiny, draft):
    ids = tiny.tokenizer(REPETITIVE).input_ids
    plain = generate(tiny, ids, max_new_tokens=30, sampling=SamplingParams()).token_ids
    banned = SamplingParams(logit_bias=((plain[0], -math.inf),))
    biased = generate(tiny, ids, max_new_tokens=30, sampling=banned).token_ids
    assert plain[0] not in biased and biased != plain
    drafted = generate(tiny, ids, max_new_tokens=30, sampling=banned, draft=draft)
    assert drafted.token_ids == biased and drafted.stats["accepted"] > 0


def test_the_server_takes_openais_logit_bias_and_refuses_what_it_cannot_use(tiny):
    with TestClient(create_app(tiny, served_name="tiny")) as client:
        def answer(**extra):
            return client.post("/v1/completions", json={"model": "tiny", "prompt": REPETITIVE, "max_tokens": 20,
                                                        "temperature": 0, **extra})

        ids = tiny.tokenizer(REPETITIVE).input_ids
        first = generate(tiny, ids, max_new_tokens=1, sampling=SamplingParams()).token_ids[0]
        text = answer(logit_bias={str(first): -100}).json()["choices"][0]["text"]
        alone = generate(tiny, ids, max_new_tokens=20, sampling=SamplingParams(logit_bias=((first, -100.0),)))
        assert text == alone.text != answer().json()["choices"][0]["text"] and first not in alone.token_ids
        for bias, says in (({"x": 1}, "is not a token id"), ({"\u00b2": 1}, "is not a token id"),
                           ({"9999": 1}, "vocabulary has ids 0-258"),
                           ({"5": 101}, "out of range")):
            refused = answer(logit_bias=bias)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "logit_bias", refused.text
            assert says in refused.json()["error"]["message"]


def test_generate_takes_llama_cpps_logit_bias_flag(folder, tiny):
    ids = tiny.tokenizer(REPETITIVE).input_ids
    first = generate(tiny, ids, max_new_tokens=1, sampling=SamplingParams()).token_ids[0]
    base = ["generate", REPETITIVE, "-m", str(folder), "--dtype", "float32", "-n", "12", "--no-stream"]
    plain, banned = (CliRunner().invoke(main, base + extra) for extra in ([], ["-l", f"{first}-inf"]))
    assert plain.exit_code == banned.exit_code == 0, banned.output
    assert plain.stdout != banned.stdout
    assert tiny.tokenizer.decode([first]) not in banned.stdout
    for bad, says in (("7*2", "is not TOKEN+BIAS"), ("5+inf", "is not TOKEN+BIAS"), ("9999+1", "vocabulary has ids")):
        refused = CliRunner().invoke(main, base + ["-l", bad])
        assert refused.exit_code != 0 and says in refused.stderr and "Traceback" not in refused.stderr


def test_a_biased_generate_runs_on_the_light_front_end_greedy_or_sampled():
    """The light front end takes a line's bias, greedy or sampled (decoding/choice.py, the torch
    front end's plain choice too: tests/test_choice.py)."""
    from layerplan.app.cli.generating import light_request

    assert light_request(["generate", "hi", "-l", "5+1"]).logit_bias == ((5, 1.0),)
    sampled = light_request(["generate", "hi", "-l", "5+1", "--temp", "0.7"])
    assert sampled.logit_bias == ((5, 1.0),) and sampled.temperature == 0.7