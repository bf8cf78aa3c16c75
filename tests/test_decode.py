import pytest
import torch

from layerplan.decoding.generate import generate
from layerplan.decoding.sampling import SamplingParams, next_token_probs, process_logits
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
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, -3.0])
    penalised = process_logits(logits, SamplingParams(repetition_penalty=2.0), torch.tensor([0, 3]))
    assert penalised.tolist() == [1.0, 1.0, 0.5, -2.0, -3.0]
    top_k = next_token_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (top_k[2:] == 0).all() and top_k[:2].sum() == pytest.approx(1.0)
    probs = torch.softmax(logits, -1)  # [0.61, 0.22, 0.14, 0.03, 0.004]
    top_p = next_token_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert (top_p > 0).tolist() == [True, True, False, False, False]
    assert probs[0] < 0.7 <= probs[0] + probs[1]
    greedy = next_token_probs(logits, SamplingParams())
    assert greedy.tolist() == [1.0, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams(top_p=0.0)


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
