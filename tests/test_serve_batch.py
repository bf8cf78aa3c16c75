"""`layerplan serve` with continuous batching (no draft): concurrent requests share each pass, and
each one's reply is its solo run's; a client hanging up mid-batch frees its place; bad requests
get their 4xx while a batch runs."""

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from layerplan.app.serve import create_app
from layerplan.decoding.generate import generate
from layerplan.decoding.sampling_params import SamplingParams
from servers import serving

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def batched(smollm2):
    app = create_app(smollm2, max_batch=4)
    with serving(app) as base:
        yield base, app


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three colours of the rainbow are",
           "Once upon a time", "1, 2, 3, 4,", "The best way to learn is"]


def _complete(base, model, prompt, n, **extra):
    with httpx.Client(base_url=base, timeout=300) as client:
        response = client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": n,
                                                         "temperature": 0, **extra})
    assert response.status_code == 200, response.text
    return response.json()


def test_concurrent_requests_share_passes_and_each_reply_is_its_solo_run(batched, smollm2):
    base, app = batched
    assert httpx.get(f"{base}/health").json()["max_batch"] == 4
    lengths = [24, 9, 17, 30, 5, 12]  # requests leave at different steps; two wait for a place
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        replies = list(pool.map(lambda pair: _complete(base, smollm2.name, *pair), zip(PROMPTS, lengths)))
    for prompt, n, reply in zip(PROMPTS, lengths, replies):
        solo = generate(smollm2, smollm2.tokenizer(prompt).input_ids, max_new_tokens=n, sampling=SamplingParams())
        assert reply["choices"][0]["text"] == solo.text, prompt
    assert app.state.scheduler.counters.running == 0 and app.state.scheduler.batch == 0
    recent = httpx.get(f"{base}/health").json()["batch_recent"]  # the batch over the last minute
    assert recent["passes"] > 0 and 1 <= recent["mean_batch"] <= recent["max_batch"] <= 4


def test_seeded_sampling_in_a_batch_is_its_solo_run(batched, smollm2):
    base, _ = batched
    extra = {"temperature": 0.8, "seed": 7}
    with ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(lambda p: _complete(base, smollm2.name, p, 12, **extra), PROMPTS[:3]))
    for prompt, reply in zip(PROMPTS[:3], replies):
        solo = generate(smollm2, smollm2.tokenizer(prompt).input_ids, max_new_tokens=12,
                        sampling=SamplingParams(temperature=0.8), seed=7)
        assert reply["choices"][0]["text"] == solo.text


def test_a_client_hanging_up_mid_batch_frees_its_place_and_others_finish(batched, smollm2):
    base, app = batched
    counters = app.state.scheduler.counters
    cancelled = counters.cancelled

    def hang_up():
        request = {"model": smollm2.name, "prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 300, "temperature": 0,
                   "stream": True}
        with httpx.Client(base_url=base, timeout=120) as client:
            with client.stream("POST", "/v1/completions", json=request) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        return  # the first piece of text: hang up

    with ThreadPoolExecutor(3) as pool:
        others = [pool.submit(_complete, base, smollm2.name, p, 20) for p in PROMPTS[:2]]
        pool.submit(hang_up).result()
        bad = httpx.post(f"{base}/v1/completions", json={"model": smollm2.name, "prompt": "x", "max_tokens": -1})
        assert 400 <= bad.status_code < 500  # answered while the batch decodes
        replies = [f.result() for f in others]
    for prompt, reply in zip(PROMPTS[:2], replies):
        solo = generate(smollm2, smollm2.tokenizer(prompt).input_ids, max_new_tokens=20, sampling=SamplingParams())
        assert reply["choices"][0]["text"] == solo.text
    deadline = time.time() + 30
    while counters.cancelled == cancelled and time.time() < deadline:
        time.sleep(0.05)
    assert counters.cancelled == cancelled + 1 and counters.running == 0


def test_a_lookup_draft_runs_inside_the_batch(smollm2):
    """serve --draft suffix batches: every request its own suffix drafter, its replies its solo
    (greedy) ones, its usage reporting the speculation. (A probe row whose rows are nearly free:
    without the probe's pass costs a shared pass drafts nothing.)"""
    from layerplan.engine.probe_rows import ProbeRow

    flat = ProbeRow("native", "stored", 1.0, {k: 1.0 + 0.03 * (k - 1) for k in range(1, 17)})
    app = create_app(smollm2, draft="suffix", max_batch=4, probe_row=flat)
    assert app.state.scheduler.max_batch == 4
    with serving(app) as base:
        prompts = ["1, 2, 3, 4, 1, 2, 3, 4, 1, 2,", "def add(a, b):\n    return a + b\n\ndef add(a, b):"] + PROMPTS[:2]
        with ThreadPoolExecutor(len(prompts)) as pool:
            replies = list(pool.map(lambda p: _complete(base, smollm2.name, p, 24), prompts))
        for prompt, reply in zip(prompts, replies):
            solo = generate(smollm2, smollm2.tokenizer(prompt).input_ids, max_new_tokens=24, sampling=SamplingParams())
            assert reply["choices"][0]["text"] == solo.text, prompt
        assert any(reply["usage"].get("speculative", {}).get("drafted") for reply in replies)
    assert create_app(smollm2, draft="exit:20", max_batch=4).state.scheduler.max_batch == 1  # runs a model: alone


def test_generate_prompt_file_decodes_the_prompts_together_as_they_decode_alone(smollm2, tmp_path):
    """layerplan generate --prompt-file: one JSON line a prompt, in the file's order, each text its
    solo run's; a PROMPT beside it, or a drafter that runs a model, is refused in one line."""
    import gc
    import json

    from click.testing import CliRunner

    from layerplan.app.cli import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS[:3]) + "\n")
    run = CliRunner().invoke(main, ["generate", "--prompt-file", str(prompts), "--dtype", "float32", "-n", "10",
                                    "--max-batch", "2"])
    assert run.exit_code == 0, run.output
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert [line["name"] for line in lines] == ["prompts-1", "prompts-2", "prompts-3"]
    for prompt, line in zip(PROMPTS, lines):
        solo = generate(smollm2, smollm2.tokenizer(prompt).input_ids, max_new_tokens=10, sampling=SamplingParams())
        assert line["text"] == solo.text and line["tokens"] == len(solo.token_ids)
    del run
    gc.collect()  # the first command's model (in reference cycles) before the next command loads another
    both = CliRunner().invoke(main, ["generate", "x", "--prompt-file", str(prompts)])
    assert both.exit_code != 0 and "give a PROMPT (or -p TEXT, -f FILE) or --prompt-file FILE" in both.output
    model_draft = CliRunner().invoke(main, ["generate", "--prompt-file", str(prompts), "--dtype", "float32",
                                            "--draft", "exit:20"])
    assert model_draft.exit_code != 0 and "runs a model" in model_draft.output
