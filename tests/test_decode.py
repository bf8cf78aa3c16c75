import numpy as np
import pytest
import torch

from layerplan.decoding.generate import generate
from layerplan.decoding.choice import processed_logits
from layerplan.decoding.loop import DecodeLoop
from layerplan.decoding.rounds import target_pick, target_probs
from layerplan.decoding.sampling_params import SamplingParams
from layerplan.plan.plan import LayerPlan
from tiny import ARCHS, VOCAB, tiny_model


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_transformers_generate(arch):
    model = tiny_model(arch)
    ids = torch.randint(3, VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model.hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                      do_sample=False, pad_token_id=0)[0, 5:].tolist()
    assert generate(model, ids, max_new_tokens=12).token_ids == reference  # both stop at EOS (id 2)


def test_sampling_is_seeded_and_respects_max_tokens():
    model = tiny_model("llama")
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, repetition_penalty=1.2)
    a = generate(model, [5, 6, 7], max_new_tokens=10, sampling=params, seed=3, stop_at_eos=False)
    b = generate(model, [5, 6, 7], max_new_tokens=10, sampling=params, seed=3, stop_at_eos=False)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 10 and a.stop_reason == "length"


def test_processing_matches_definitions():
    logits = np.array([2.0, 1.0, 0.5, -1.0, -3.0], np.float32)
    params = SamplingParams(repetition_penalty=2.0)
    penalised = processed_logits(logits, params, [0, 3], 0)
    assert penalised.tolist() == [1.0, 1.0, 0.5, -2.0, -3.0]
    # presence and frequency: the generated tokens alone (the context from output_from), by count
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    penalised = processed_logits(logits, params, [0, 1, 1, 2, 2, 2], 1)
    assert penalised.tolist() == [2.0, 1.0 - 0.5 - 0.5, 0.5 - 0.5 - 0.75, -1.0, -3.0]
    top_k = target_probs(logits, SamplingParams(temperature=1.0, top_k=2), [], 0)
    assert (top_k[2:] == 0).all() and top_k[:2].sum() == pytest.approx(1.0)
    probs = np.exp(logits) / np.exp(logits).sum()  # [0.61, 0.22, 0.14, 0.03, 0.004]
    top_p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.7), [], 0)
    assert (top_p > 0).tolist() == [True, True, False, False, False]
    assert probs[0] < 0.7 <= probs[0] + probs[1]
    assert target_pick(logits, SamplingParams(), [], 0) == 0
    with pytest.raises(ValueError, match=r"top_p 0.0 is out of range: a number in \(0, 1\]"):
        SamplingParams(top_p=0.0)


@pytest.mark.parametrize("settings, message", [
    ({"temperature": float("nan")}, "temperature nan is out of range"),  # sampled garbage, exit 0
    ({"temperature": float("inf")}, "temperature inf is out of range"),
    ({"temperature": 1e-300}, "temperature 1e-300 is out of range: 0 \\(greedy\\) or a finite number >= 0.0001"),
    ({"repetition_penalty": float("nan")}, "repetition_penalty nan is out of range"),  # changed the output
    ({"repetition_penalty": 1e-300}, "repetition_penalty 1e-300 is out of range"),
    ({"top_p": float("nan")}, "top_p nan is out of range"),
    ({"top_k": -1}, "top_k -1 is out of range"),
])
def test_settings_whose_arithmetic_is_not_finite_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**settings)


def test_every_setting_in_range_gives_finite_probabilities():
    from layerplan.decoding.sampling_params import MIN_TEMPERATURE, PENALTY_RANGE

    logits = np.array([80.0, -80.0, 3.0, 0.0], np.float32)
    for temperature in (MIN_TEMPERATURE, 2.0):
        for penalty in PENALTY_RANGE:
            params = SamplingParams(temperature=temperature, repetition_penalty=penalty, top_p=0.9)
            probs = target_probs(logits, params, [0, 1], 0)
            assert np.isfinite(probs).all() and abs(float(probs.sum()) - 1) < 1e-5


@pytest.mark.real
def test_real_model_greedy_chat_stop_and_stream(smollm2):
    pieces = []
    result = generate(smollm2, "Write a Python function that adds two numbers.", max_new_tokens=40,
                      chat=True, stop=["return"], on_text=pieces.append)
    assert result.stop_reason == "stop"
    assert "def " in result.text and "return" not in result.text
    assert "".join(pieces) == result.text
    ids = smollm2.encode("def fibonacci(n):")
    with torch.no_grad():
        reference = smollm2.hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                                        do_sample=False, pad_token_id=2)[0, ids.shape[1]:].tolist()
    assert generate(smollm2, ids, max_new_tokens=24).token_ids == reference


def _stream_texts(tokenizer, sequences, stop=()) -> None:
    """TextStream's text after each token, decoding through its anchored window, equals the whole
    decode of the tokens so far (cut at a stop string), for every prefix of every sequence."""
    from layerplan.decoding.text import TextStream

    for ids in sequences:
        stream, deltas = TextStream(tokenizer, stop, None), []
        stream.on_text = deltas.append
        for n in range(1, len(ids) + 1):
            stopped = stream.update(ids[:n])
            whole = tokenizer.decode(ids[:n], skip_special_tokens=True)
            cut = min((whole.find(s) for s in stop if s in whole), default=-1)
            assert stream.text == (whole[:cut] if cut >= 0 else whole), (ids[:n], stream.text, whole)
            assert stopped == (cut >= 0)
            if stopped:
                break
        stream.finish()
        assert "".join(deltas) == stream.text


def test_the_streamed_text_is_the_whole_decode_through_its_window():
    """Random bytes (characters split across tokens, invalid UTF-8, special tokens among them),
    past several anchors (TextStream.ANCHOR_EVERY), with and without stop strings."""
    import random

    from tiny_text import byte_tokenizer

    tokenizer = byte_tokenizer()
    rng = random.Random(4)
    text = "héllo wörld, ünïcode ✓ and emoji 🙂 — " * 8
    utf8 = tokenizer(text).input_ids
    noise = [[rng.randrange(0, 259) for _ in range(200)] for _ in range(3)]
    _stream_texts(tokenizer, [utf8, *noise])
    _stream_texts(tokenizer, [utf8], stop=["emoji 🙂 — h", "ünï"])


@pytest.mark.real
def test_the_streamed_text_is_the_whole_decode_on_the_packaged_tokenizer(smollm2):
    import random

    tokenizer = smollm2.tokenizer
    rng = random.Random(9)
    prose = tokenizer("The quick brown fox — naïve café, 日本語, 🙂 — jumps; it's done. " * 12).input_ids
    noise = [[rng.randrange(0, len(tokenizer)) for _ in range(160)] for _ in range(2)]
    _stream_texts(tokenizer, [prose, *noise])


class _Letters:
    """A model of letters (token i: chr(97 + i)), torch-free as decoding/loop.py asks: its next
    token is the last one plus one, and its passes are recorded."""

    eos_token_ids = (25,)  # "z"

    class tokenizer:  # noqa: N801 - the protocol's attribute
        @staticmethod
        def decode(ids, skip_special_tokens=True):
            return "".join(chr(97 + i) for i in ids)

    class Cache:
        def __init__(self, capacity):
            self.capacity, self.length = capacity, 0

    def __init__(self):
        self.passes = []

    def new_cache(self, plan, capacity):
        return self.Cache(capacity)

    def last_logits(self, ids, plan, cache, start):
        assert start == cache.length and start + len(ids) <= cache.capacity
        self.passes.append((list(ids), start))
        cache.length = start + len(ids)
        logits = np.zeros(26, np.float32)
        logits[(ids[-1] + 1) % 26] = 1.0
        return logits


def test_the_decode_loop_runs_any_model_of_the_protocol():
    """decoding/loop.py on a model with no torch: the prompt in one pass, then a pass a token at
    its position; it stops at EOS, at a stop string, or at the budget; a cache that holds the
    prompt's first tokens prefills the rest only."""
    plan = LayerPlan.full(2)
    model = _Letters()
    result = DecodeLoop(model, [0, 1, 2], plan, 40).run()
    assert (result.text, result.stop_reason, result.prompt_tokens) == ("defghijklmnopqrstuvwxy", "eos", 3)
    assert model.passes[:3] == [([0, 1, 2], 0), ([3], 3), ([4], 4)]
    assert DecodeLoop(_Letters(), [0], plan, 40, stop=["fg"]).run().text == "bcde"
    short = DecodeLoop(_Letters(), [0], plan, 3).run()
    assert (short.text, short.stop_reason) == ("bcd", "length")
    model, cache = _Letters(), _Letters.Cache(16)
    cache.length = 2
    assert DecodeLoop(model, [0, 1, 2, 3], plan, 2, cache=cache).run().text == "ef"
    assert model.passes[0] == ([2, 3], 2)
    with pytest.raises(ValueError, match="at least its last token must be left"):
        DecodeLoop(_Letters(), [0, 1], plan, 2, cache=cache)
    with pytest.raises(ValueError, match="the prompt is empty"):
        DecodeLoop(_Letters(), [], plan, 2)
