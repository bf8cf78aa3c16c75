"""OpenAI's presence and frequency penalties (llama.cpp's --presence-penalty/--frequency-penalty):
on the tokens generated so far, not the prompt's; a speculative decode with them gives the plain
decode's tokens with them (the sampled distribution: tests/test_speculative.py's statistical tests
run with them); the server takes them, a value outside -2..2 is a 400 naming it."""

import numpy as np
import pytest
from click.testing import CliRunner

from layerplan.app.cli import main
from layerplan.decoding.choice import processed_logits
from layerplan.decoding.generate import generate
from layerplan.decoding.sampling_params import SamplingError, SamplingParams

REPETITIVE = "xxxxxxxxxxxxxxx"  # the tiny model continues it with one byte over and over: drafts get accepted
PENALISED = SamplingParams(presence_penalty=1.5, frequency_penalty=0.5)


def test_the_prompts_tokens_are_not_penalised():
    logits = np.array([3.0, 2.0, 1.0], np.float32)
    # the prompt: 0, 0; generated: 1
    assert processed_logits(logits, PENALISED, [0, 0, 1], 2).tolist() == [3.0, 2.0 - 1.5 - 0.5, 1.0]
    for name in ("presence_penalty", "frequency_penalty"):
        with pytest.raises(SamplingError, match=f"{name} 2.5 is out of range"):
            SamplingParams(**{name: 2.5})


@pytest.mark.parametrize("draft", ["suffix", "suffix:tree", "ngram|exit:2"])
def test_a_speculative_decode_with_the_penalties_gives_the_plain_decodes_tokens(tiny_text_model, draft):
    ids = tiny_text_model.tokenizer(REPETITIVE).input_ids
    plain = generate(tiny_text_model, ids, max_new_tokens=30, sampling=SamplingParams()).token_ids
    penalised = generate(tiny_text_model, ids, max_new_tokens=30, sampling=PENALISED).token_ids
    assert penalised != plain
    drafted = generate(tiny_text_model, ids, max_new_tokens=30, sampling=PENALISED, draft=draft)
    assert drafted.token_ids == penalised


def test_the_server_and_generate_take_them(tiny_text_model, tiny_text_client, tmp_path):
    ids = tiny_text_model.tokenizer(REPETITIVE).input_ids
    alone = generate(tiny_text_model, ids, max_new_tokens=16, sampling=PENALISED).text
    body = {"model": "tiny", "prompt": REPETITIVE, "max_tokens": 16, "temperature": 0}
    answer = tiny_text_client.post("/v1/completions", json={**body, "presence_penalty": 1.5, "frequency_penalty": 0.5})
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == alone
    refused = tiny_text_client.post("/v1/completions", json={**body, "frequency_penalty": 2.5})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "frequency_penalty"
    folder = tmp_path / "tok"
    tiny_text_model.hf.save_pretrained(folder)
    tiny_text_model.tokenizer.save_pretrained(folder)
    result = CliRunner().invoke(main, ["generate", REPETITIVE, "-m", str(folder), "--dtype", "float32", "-n", "16",
                                       "--no-stream", "--presence-penalty", "1.5", "--frequency-penalty", "0.5"])
    assert result.exit_code == 0 and result.stdout.rstrip("\n") == alone, result.output
