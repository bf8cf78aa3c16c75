import math

import pytest
import torch
import torch.nn.functional as F

from layerplan.corpus import default_corpus, read_texts
from layerplan.engine.runner import forward
from layerplan.search.evaluate import Reference, compare, perplexity, perplexity_in_chunks
from layerplan.search.windows import Divergence, logits_divergence
from tiny import VOCAB, tiny_model


def hf_sliding_perplexity(hf, ids, window, stride):
    """transformers' doc recipe, counting each scored token exactly once; each token's loss from
    transformers' logits in float64 (in float32, cross_entropy reads ~1e-5 nats a token low on a
    49,152-token vocabulary, ~2e-5 with torch's AVX2 kernels: search/windows.py)."""
    nll, count, prev_end = 0.0, 0, 0
    for begin in range(0, ids.shape[1], stride):
        end = min(begin + window, ids.shape[1])
        chunk = ids[:, begin:end]
        with torch.no_grad():
            logits = hf(chunk).logits
        losses = F.cross_entropy(logits[0, :-1].double(), chunk[0, 1:], reduction="none")
        first = max(prev_end, begin + 1) - begin - 1
        nll += float(losses[first:].sum())
        count += losses[first:].numel()
        prev_end = end
        if end == ids.shape[1]:
            break
    return math.exp(nll / count), count


class _Tokenizer:
    """A tokenizer that puts `bos` before a text where it adds special tokens (bos None: nothing),
    and says nothing of it in add_bos_token (as transformers' reads Gemma 3's)."""

    add_bos_token = False

    def __init__(self, bos):
        self.bos = bos

    def __call__(self, text, add_special_tokens=True):
        ids = [5 + ord(c) % 7 for c in text]
        return type("Encoding", (), {"input_ids": ([self.bos] if add_special_tokens and self.bos is not None else []) + ids})


@pytest.mark.parametrize("window, stride, scored", [(16, 16, 34), (16, 5, 36), (40, 40, 36), (12, 1, 36)])
def test_sliding_perplexity_matches_direct_computation(window, stride, scored):
    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (1, 37), generator=torch.Generator().manual_seed(0))
    expected, count = hf_sliding_perplexity(model.hf, ids, window, stride)
    result = perplexity(model, ids, window=window, stride=stride)
    assert result.tokens == count == scored  # without overlap a window's first token has no context
    assert result.perplexity == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("bos", [None, 1])
def test_chunked_perplexity_scores_each_chunks_second_half_as_llama_perplexity_does(bos):
    """llama-perplexity's protocol (its perplexity.cpp): chunks of n_ctx tokens, the rest of the text
    dropped; BOS in each chunk's first place where the tokenizer adds one; tokens n_ctx/2+1..n_ctx-1
    scored. Written out here from that description, on the model's own forward."""
    model = tiny_model("llama")
    model.tokenizer = _Tokenizer(bos)
    ids = torch.randint(3, VOCAB, (1, 37), generator=torch.Generator().manual_seed(1))
    nll, count = 0.0, 0
    for start in (0, 16):  # two chunks of 16; the last 5 tokens are dropped
        chunk = ids[:, start:start + 16].clone()
        if bos is not None:
            chunk[0, 0] = bos
        with torch.no_grad():
            logits = model.hf(chunk).logits
        losses = F.cross_entropy(logits[0, 8:15], chunk[0, 9:16], reduction="none")
        nll, count = nll + float(losses.sum()), count + losses.numel()
    result = perplexity_in_chunks(model, ids, context=16)
    assert result.tokens == count == 14 and result.protocol == "llama.cpp"
    assert result.perplexity == pytest.approx(math.exp(nll / count), rel=1e-5)
    with pytest.raises(ValueError, match="shorter than one chunk of 64"):
        perplexity_in_chunks(model, ids, context=64)


def test_reference_divergence_matches_textbook_formulas():
    model = tiny_model("gemma3")
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    full = forward(model, ids)
    skipped = forward(model, ids, model.plan("skip:attn=1"))
    d = Reference(full, ids).divergence(skipped)
    p, q = F.log_softmax(full.double(), -1), F.log_softmax(skipped.double(), -1)
    assert d.kl == pytest.approx(float((p.exp() * (p - q)).sum(-1).mean()), rel=1e-4)
    assert d.top1_agreement == pytest.approx(float((full.argmax(-1) == skipped.argmax(-1)).double().mean()))
    nll = F.cross_entropy(skipped[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    assert d.perplexity == pytest.approx(math.exp(float(nll)), rel=1e-5)
    same = Reference(full, ids).divergence(full)
    assert same.kl == pytest.approx(0.0, abs=1e-6) and same.top1_agreement == 1.0


def test_the_commands_divergence_is_the_scorers_and_the_textbooks():
    """search/windows.py logits_divergence (ppl's comparison, either front end) in float64 against
    the textbook formulas, and against Reference (the scan's and search's float32 scorer), over two
    rows of a batch; compare() gives it."""
    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (2, 70), generator=torch.Generator().manual_seed(2))  # > NLL_ROWS positions
    plan = model.plan("skip:attn=1;mlp=0")
    full, skipped = forward(model, ids), forward(model, ids, plan)
    d = logits_divergence(full.numpy(), skipped.numpy(), ids.tolist(), "p")
    p, q = F.log_softmax(full.double(), -1), F.log_softmax(skipped.double(), -1)
    assert d.kl == pytest.approx(float((p.exp() * (p - q)).sum(-1).mean()), rel=1e-9)
    assert d.top1_agreement == float((full.argmax(-1) == skipped.argmax(-1)).double().mean()) < 1
    for logits, reported in ((q, d.perplexity), (p, d.reference_perplexity)):
        nll = -logits[:, :-1].gather(-1, ids[:, 1:, None]).mean()
        assert reported == pytest.approx(math.exp(float(nll)), rel=1e-7)  # (token_nll: float32 exponentials)
    assert d.tokens == 140 and d.complete
    scorer = Reference(full, ids).divergence(skipped, "p")
    assert d.kl == pytest.approx(scorer.kl, rel=1e-4) and d.top1_agreement == scorer.top1_agreement
    assert d.perplexity == pytest.approx(scorer.perplexity, rel=1e-5)
    assert compare(model, ids, plan) == Divergence(**{**d.to_dict(), "plan": plan.to_string()})
    with pytest.raises(ValueError, match="the same"):
        logits_divergence(full.numpy(), skipped[:, :-1].numpy(), ids.tolist(), "p")


def test_compare_identity_is_perfect():
    model = tiny_model("qwen2")
    ids = torch.randint(3, VOCAB, (1, 10))
    result = compare(model, ids, model.plan())
    assert result.top1_agreement == 1.0 and result.kl < 1e-6


def test_corpus_needs_no_download(tmp_path):
    text = default_corpus()
    assert len(text) > 20000
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text('{"text": "a"}\n\n{"text": "b"}\n')
    assert read_texts(jsonl) == ["a", "b"]
    (tmp_path / "bad.jsonl").write_text('{"body": "a"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: no 'text' field"):
        read_texts(tmp_path / "bad.jsonl")
    with pytest.raises(FileNotFoundError, match="text file not found"):
        read_texts(tmp_path / "nope.txt")


@pytest.mark.real
def test_real_model_perplexity_agrees_with_transformers(smollm2):
    ids = smollm2.tokenizer(default_corpus(), return_tensors="pt").input_ids[:, :300]
    expected, _ = hf_sliding_perplexity(smollm2.hf, ids, 128, 64)
    assert perplexity(smollm2, ids, window=128, stride=64).perplexity == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("chunk, head_rows", [(1, 256), (5, 256), (64, 256), (3, 4), (5, 4)])
def test_chunked_divergence_of_hidden_equals_whole_logits(chunk, head_rows):
    from layerplan.engine.runner import head, run_hidden

    model = tiny_model("gemma3")
    ids = torch.randint(3, VOCAB, (2, 13), generator=torch.Generator().manual_seed(3))
    reference = Reference(forward(model, ids), ids)
    hidden = run_hidden(model, ids, model.plan("skip:mlp=1"))
    whole = reference.divergence(head(model, hidden))
    chunked = reference.divergence_of_hidden(lambda h: head(model, h), hidden, chunk=chunk, head_rows=head_rows)
    assert chunked.kl == pytest.approx(whole.kl, rel=1e-5, abs=1e-8)
    assert chunked.perplexity == pytest.approx(whole.perplexity, rel=1e-6)
    assert chunked.top1_agreement == whole.top1_agreement
