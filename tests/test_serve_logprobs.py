"""Log-probabilities from `layerplan serve`, in OpenAI's chat and legacy completion forms: each
token's number is the model's own log-softmax at its place (a forward pass of the prompt and the
reply says the same), whether the token was decoded plainly or came from an accepted draft; a
stream's chunks carry the logprobs of their own tokens, which join to the answer's; the bytes of a
reply's tokens join to its text, for byte-level and SentencePiece vocabularies. A tiny model with
a byte tokenizer keeps it fast."""

import json
import math

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from layerplan.app.serve import create_app
from layerplan.decoding.generate import generate
from layerplan.decoding.logprobs import LOGPROB_FLOOR, TokenSpeller, token_logprob
from layerplan.decoding.sampling_params import SamplingParams
from layerplan.engine.runner import forward

PROMPT = "the cat the cat the cat"
REPETITIVE = "xxxxxxxxxxxxxxx"  # the tiny model continues it with one byte over and over: drafts get accepted


@pytest.fixture(scope="module")
def tiny(tiny_text_model):  # (conftest.py's, as `client` is tiny_text_client: served as "tiny")
    return tiny_text_model


@pytest.fixture(scope="module")
def client(tiny_text_client):
    return tiny_text_client


def _completion(client, n: int = 24, options: dict | None = None, prompt: str = PROMPT, **extra) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0, **extra}
    answer = client.post("/v1/completions", json=body if options is None else {**body, "layerplan": options})
    assert answer.status_code == 200, answer.text
    return {**answer.json()["choices"][0], "layerplan": answer.json().get("layerplan")}


def _model_logprobs(model, prompt_ids: list[int], new_ids: list[int], plan: str | None = None) -> torch.Tensor:
    """The model's log-softmax (under the plan, or whole) at each new token's place, from one pass
    of prompt + reply."""
    ids = torch.tensor([prompt_ids + new_ids])
    with torch.inference_mode():
        logits = forward(model, ids, model.plan(plan))[0].float()
    return logits.log_softmax(-1)[len(prompt_ids) - 1: len(prompt_ids) - 1 + len(new_ids)]


# ----- the numbers ---------------------------------------------------------------------------------
def test_a_tokens_logprob_is_the_log_softmax_of_its_logits_in_torch_and_numpy():
    torch.manual_seed(0)
    logits = torch.randn(1000) * 4
    logits[7] = logits[9] = logits.max() + 1  # a tie for the top: the lower id first
    logits[3] = -math.inf
    for row in (logits, logits.numpy()):
        got = token_logprob(row, 42, 5)
        assert got.token == 42
        assert got.logprob == pytest.approx(float(logits.log_softmax(-1)[42]), abs=1e-5)
        assert [token for token, _ in got.top][:2] == [7, 9]
        assert [token for token, _ in got.top] == logits.argsort(descending=True, stable=True)[:5].tolist()
        assert all(a[1] >= b[1] for a, b in zip(got.top, got.top[1:]))
    assert token_logprob(logits, 3, 0) == token_logprob(logits.numpy(), 3, 0)
    assert token_logprob(logits, 3, 0).logprob == LOGPROB_FLOOR and token_logprob(logits, 3, 0).top == ()


def _reply_ids(model, n: int, **sampling) -> tuple[list[int], list[int]]:
    """The prompt's ids and the reply's, decoded alone (what the server's reply is)."""
    prompt_ids = model.tokenizer(PROMPT).input_ids
    seed = sampling.pop("seed", None)
    result = generate(model, prompt_ids, max_new_tokens=n, sampling=SamplingParams(**sampling), seed=seed)
    return prompt_ids, result.token_ids


def test_a_greedy_replys_logprobs_are_the_models_own_at_each_token(client, tiny):
    choice = _completion(client, logprobs=3)
    kept = choice["logprobs"]
    prompt_ids, new_ids = _reply_ids(tiny, 24)
    assert len(kept["tokens"]) == len(new_ids) == 24
    speller = TokenSpeller(tiny.tokenizer)
    assert kept["tokens"] == [speller.text(t) for t in new_ids]
    # (the random model writes parts of characters: alone, their texts are the replacement character)
    assert b"".join(speller.bytes(t) for t in new_ids).decode(errors="replace") == choice["text"]
    expected = _model_logprobs(tiny, prompt_ids, new_ids)
    assert kept["token_logprobs"] == pytest.approx(expected.gather(1, torch.tensor(new_ids)[:, None])[:, 0].tolist(),
                                                   abs=1e-4)
    for top, row, token, logprob in zip(kept["top_logprobs"], expected, kept["tokens"], kept["token_logprobs"]):
        # greedy: the token is the most likely one, among the top 3 (by text: parts of characters,
        # all the replacement character, share one entry, the chosen token's)
        assert top[token] == logprob == pytest.approx(float(row.max()), abs=1e-4)
        best = row.topk(3).values.tolist()
        assert 1 <= len(top) <= 3 and all(min(abs(value - b) for b in best) < 1e-4 for value in top.values())
    offsets = kept["text_offset"]
    assert offsets == [sum(len(t) for t in kept["tokens"][:i]) for i in range(len(offsets))]


@pytest.mark.parametrize("draft", ["suffix", "suffix:tree", "ngram|exit:2"])
def test_drafted_tokens_report_what_plain_decoding_reports(client, draft):
    plain = _completion(client, 40, prompt=REPETITIVE, logprobs=2)
    drafted = _completion(client, 40, options={"draft": draft, "provenance": True}, prompt=REPETITIVE, logprobs=2)
    assert "accepted" in {piece["kind"] for piece in drafted["layerplan"]["tokens"]}
    assert drafted["text"] == plain["text"]
    assert drafted["logprobs"]["tokens"] == plain["logprobs"]["tokens"]
    assert drafted["logprobs"]["token_logprobs"] == pytest.approx(plain["logprobs"]["token_logprobs"], abs=1e-4)


def test_a_sampled_reply_reports_the_models_distribution_not_the_samplers(client, tiny):
    choice = _completion(client, 16, temperature=1.5, top_k=5, seed=3, logprobs=0)
    kept = choice["logprobs"]
    prompt_ids, new_ids = _reply_ids(tiny, 16, temperature=1.5, top_k=5, seed=3)
    expected = _model_logprobs(tiny, prompt_ids, new_ids).gather(1, torch.tensor(new_ids)[:, None])[:, 0]
    assert kept["token_logprobs"] == pytest.approx(expected.tolist(), abs=1e-4)
    assert all(list(top) == [token] for top, token in zip(kept["top_logprobs"], kept["tokens"]))


# ----- the forms -----------------------------------------------------------------------------------
def _chat(client, stream: bool, **extra):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "the cat"}], "max_tokens": 20,
            "temperature": 0, "logprobs": True, "top_logprobs": 2, "stream": stream, **extra}
    if not stream:
        answer = client.post("/v1/chat/completions", json=body)
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        return choice["message"]["content"], choice["logprobs"]["content"]
    text, content = "", []
    with client.stream("POST", "/v1/chat/completions", json=body) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[len("data: "):])["choices"][0]
                text += choice["delta"].get("content", "")
                content += (choice["logprobs"] or {}).get("content", [])
    return text, content


def test_chat_logprobs_stream_as_they_answer_and_spell_the_text(client):
    text, content = _chat(client, stream=False)
    streamed_text, streamed = _chat(client, stream=True)
    assert streamed_text == text and streamed == content
    assert b"".join(bytes(entry["bytes"]) for entry in content).decode(errors="replace") == text
    for entry in content:
        assert len(entry["top_logprobs"]) == 2 and entry["top_logprobs"][0]["token"] == entry["token"]
        assert entry["top_logprobs"][0]["logprob"] == entry["logprob"] <= 0
    gathered_text, gathered = _chat(client, stream=True, layerplan={"stream_interval": 1.0})
    assert gathered_text == text and gathered == content  # chunks gathered: their logprobs too


def test_a_completion_streams_its_logprobs_with_offsets_running_on(client):
    whole = _completion(client, logprobs=1)["logprobs"]
    parts = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "logprobs": 1, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as answer:
        for line in answer.iter_lines():
            if line.startswith("data: {"):
                kept = json.loads(line[len("data: "):])["choices"][0]["logprobs"]
                for key in parts if kept else ():
                    parts[key] += kept[key]
    assert parts == whole


def test_not_asked_not_sent(client):
    assert _completion(client, 4)["logprobs"] is None
    assert _completion(client, 4, logprobs=False)["logprobs"] is None
    answer = client.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 4, "logprobs": False,
                                                        "messages": [{"role": "user", "content": "hi"}]})
    assert answer.json()["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),  # a count there, not a switch
    ("/v1/completions", {"logprobs": 2.5}, "logprobs"),
])
def test_logprobs_out_of_range_are_a_400_naming_them(client, path, extra, param):
    body = {"model": "tiny", "max_tokens": 4, **extra,
            **({"prompt": "hi"} if "chat" not in path else {"messages": [{"role": "user", "content": "hi"}]})}
    answer = client.post(path, json=body)
    assert answer.status_code == 400, answer.text
    assert param in answer.json()["error"]["param"]


# ----- spelling tokens -----------------------------------------------------------------------------
def test_the_bytes_of_a_byte_level_vocabularys_tokens_join_to_the_text(smollm2):
    speller = TokenSpeller(smollm2.tokenizer)
    text = "Grüße, 世界! naïve café\n\tdone 🙂"
    ids = smollm2.tokenizer(text, add_special_tokens=False).input_ids
    assert speller.byte_level and b"".join(speller.bytes(t) for t in ids) == text.encode()
    assert speller.text(smollm2.tokenizer.convert_tokens_to_ids("<|im_end|>")) == "<|im_end|>"


def test_the_bytes_of_a_sentencepiece_vocabularys_tokens_join_to_the_text():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    pieces = ["<unk>", "▁the", "▁cat", "▁", "t", "h", "e", "c", "a"] + [f"<0x{b:02X}>" for b in range(256)]
    core = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], unk_token="<unk>",
                                byte_fallback=True))
    core.pre_tokenizer = pre_tokenizers.Metaspace()
    core.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                      decoders.Strip(" ", 1, 0)])
    speller = TokenSpeller(core)
    text = "the cat é"
    ids = core.encode(text).ids
    assert not speller.byte_level and "<0xC3>" in [pieces[i] for i in ids]
    assert b"".join(speller.bytes(t) for t in ids) == (" " + text).encode()
    assert speller.text(pieces.index("<0xC3>")) == "\ufffd"  # half a character


def test_numpy_logits_give_the_light_front_ends_numbers():
    row = np.linspace(-3, 3, 50, dtype=np.float32)
    got = token_logprob(row, 49, 3)
    assert got.top[0][0] == 49 and got.logprob == pytest.approx(float(torch.from_numpy(row).log_softmax(-1)[49]))


# ----- echo: the prompt scored ---------------------------------------------------------------------
def test_an_echoed_prompts_tokens_are_scored_by_the_model(client, tiny):
    """echo + logprobs: the prompt's tokens, each given those before it (the first: null), then the
    completion's; the text is the prompt's and the completion's."""
    choice = _completion(client, 6, echo=True, logprobs=2)
    plain = _completion(client, 6, logprobs=2)
    prompt_ids = tiny.tokenizer(PROMPT).input_ids
    kept = choice["logprobs"]
    assert choice["text"] == PROMPT + plain["text"]
    assert kept["token_logprobs"][0] is None and kept["top_logprobs"][0] is None
    scored = _model_logprobs(tiny, prompt_ids[:1], prompt_ids[1:])  # each prompt token after the first
    assert kept["token_logprobs"][1:len(prompt_ids)] == pytest.approx(
        scored.gather(1, torch.tensor(prompt_ids[1:])[:, None])[:, 0].tolist(), abs=1e-4)
    assert kept["token_logprobs"][len(prompt_ids):] == pytest.approx(plain["logprobs"]["token_logprobs"], abs=1e-6)
    assert kept["tokens"][len(prompt_ids):] == plain["logprobs"]["tokens"]
    assert kept["text_offset"] == [sum(len(t) for t in kept["tokens"][:i]) for i in range(len(kept["tokens"]))]


def test_an_echo_streams_the_prompt_first_and_scores_it_under_the_requests_plan(client, tiny):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 1,
            "layerplan": {"plan": "skip:mlp=1"}}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]
    texts, parts = [], {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as answer:
        for line in answer.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[len("data: "):])["choices"][0]
                texts.append(choice["text"])
                for key in parts if choice["logprobs"] else ():
                    parts[key] += choice["logprobs"][key]
    assert texts[0].startswith(PROMPT) and "".join(texts) == whole["text"] and parts == whole["logprobs"]
    prompt_ids = tiny.tokenizer(PROMPT).input_ids
    under_plan = _model_logprobs(tiny, prompt_ids[:1], prompt_ids[1:], plan="skip:mlp=1")
    assert whole["logprobs"]["token_logprobs"][1:len(prompt_ids)] == pytest.approx(
        under_plan.gather(1, torch.tensor(prompt_ids[1:])[:, None])[:, 0].tolist(), abs=1e-4)


def test_an_echo_of_token_ids_with_no_new_tokens_is_the_prompt_alone(client, tiny):
    ids = tiny.tokenizer("hello there").input_ids
    for prompt in (ids, [ids]):  # (a batch of one, as lm-evaluation-harness sends it)
        choice = _completion(client, 0, prompt=prompt, echo=True, logprobs=0)
        assert choice["text"] == tiny.tokenizer.decode(ids) and choice["finish_reason"] == "length"
        assert len(choice["logprobs"]["tokens"]) == len(ids)
    assert _completion(client, 2, echo=True)["text"].startswith(PROMPT)  # echo without logprobs


def test_a_reply_ended_by_eos_keeps_the_eos_logprob_out_of_its_text(tiny):
    """Every new token has its logprob, an EOS that ended the reply too (lm-evaluation-harness
    counts them); a stop string's tokens, cut from the text, have none."""
    from layerplan.decoding.generate import Decoding

    prompt_ids = tiny.tokenizer(REPETITIVE).input_ids
    first = generate(tiny, prompt_ids, max_new_tokens=1, sampling=SamplingParams()).token_ids[0]
    ended = Decoding(tiny, prompt_ids, tiny.plan(), 5, stop_at_eos=[first])
    ended.out.keep_logprobs(0)
    result = ended.run()
    assert result.stop_reason == "eos" and result.text == "" and [k.token for k in result.logprobs] == [first]
    full = generate(tiny, prompt_ids, max_new_tokens=8, sampling=SamplingParams()).text
    stopped = Decoding(tiny, prompt_ids, tiny.plan(), 8, stop=[full[3:5]])
    stopped.out.keep_logprobs(0)
    result = stopped.run()
    assert result.stop_reason == "stop" and len(result.logprobs) == stopped.out.stream.text_tokens() < 8


# ----- the tokenizer routes --------------------------------------------------------------------------
def test_the_tokenizer_routes_answer_in_vllms_and_llama_servers_words(client, tiny):
    ids = tiny.tokenizer("the cat").input_ids
    assert client.post("/tokenize", json={"prompt": "the cat"}).json() == {"tokens": ids, "count": len(ids),
                                                                           "max_model_len": 128}
    assert client.post("/tokenize", json={"content": "the cat"}).json()["tokens"] == \
        tiny.tokenizer("the cat", add_special_tokens=False).input_ids
    assert client.post("/detokenize", json={"tokens": ids}).json() == {"prompt": tiny.tokenizer.decode(ids),
                                                                       "content": tiny.tokenizer.decode(ids)}
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] == "</s>" and info["chat_template"] == tiny.tokenizer.chat_template
    bad = client.post("/detokenize", json={"tokens": [10 ** 6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert client.post("/tokenize", json={}).status_code == 400


def test_the_tokenizer_routes_need_the_key_where_the_server_has_one(tiny):
    with TestClient(create_app(tiny, served_name="tiny", api_key="k")) as guarded:
        for method, path, body in (("post", "/tokenize", {"prompt": "a"}), ("post", "/detokenize", {"tokens": [5]}),
                                   ("get", "/tokenizer_info", None)):
            assert getattr(guarded, method)(path, **({"json": body} if body else {})).status_code == 401
            assert getattr(guarded, method)(path, headers={"Authorization": "Bearer k"},
                                            **({"json": body} if body else {})).status_code == 200
