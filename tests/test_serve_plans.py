"""`layerplan serve` per request: the `layerplan` extension object (a plan, a draft, a draft
length, provenance), refused in one line when it cannot be used; each request's reply is the one
its plan and draft give alone, batched with requests of other plans; a stream's chunks say which
tokens were plain, accepted drafts, corrections or bonuses. A tiny model with a byte tokenizer keeps
it fast; one test runs the packaged model."""

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fastapi.testclient import TestClient

from layerplan.app.serve import create_app
from layerplan.decoding.scheduler import Job
from layerplan.decoding.generate import generate
from layerplan.decoding.text import TOKEN_KINDS, TextStream
from layerplan.decoding.sampling_params import SamplingParams
from servers import serving

REPETITIVE = "xxxxxxxxxxxxxxx"  # the tiny model continues it with one byte over and over: drafts get accepted
PROMPTS = ["hello hello hello hello", "the cat the cat the cat", "0101010101", "aaaa"]


@pytest.fixture(scope="module")
def tiny(tiny_text_model):
    return tiny_text_model


@pytest.fixture(scope="module")
def client(tiny):
    with TestClient(create_app(tiny, served_name="tiny", max_batch=4)) as test_client:
        yield test_client


def _body(prompt: str, n: int, options: dict | None = None, **extra) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0, **extra}
    return body if options is None else {**body, "layerplan": options}


def _alone(model, prompt: str, n: int, plan: str | None = None, draft: str | None = None, **extra):
    ids = model.tokenizer(prompt).input_ids
    return generate(model, ids, model.plan(plan) if plan else None, n, sampling=SamplingParams(), draft=draft,
                    **extra)


# ----- refused in one line -----------------------------------------------------------------------
@pytest.mark.parametrize("options, param, says", [
    ({"plan": "skip:attn=9"}, "layerplan.plan", "layer 9"),
    ({"plan": "bogus"}, "layerplan.plan", "cannot read 'bogus'"),
    ({"plan": "skip:attn=1\nmlp=9"}, "layerplan.plan", ""),  # the client's line break: still one line
    ({"plan": "plan.json"}, "layerplan.plan", "cannot read"),  # a plan string only: no files of the server
    ({"plan": "0-2," * 4 + "0"}, "layerplan.plan", "runs at most 12 here"),  # 13 steps of a 3-layer model
    ({"draft": "bogus"}, "layerplan.draft", "cannot read 'bogus'"),
    ({"draft": "ngram:x"}, "layerplan.draft", "expected ngram or ngram:N"),
    ({"draft": "suffix:corpus=/etc/hostname"}, "layerplan.draft", "would read a corpus file on the server"),
    ({"draft": "exit:1+head=/etc/hostname"}, "layerplan.draft", "would read a head file"),
    ({"draft": "model:/tmp"}, "layerplan.draft", "would load a second model"),
    ({"draft": "self:bits=q4_0"}, "layerplan.draft", "would load a quantized copy"),
    ({"plan": "exit:1", "draft": "exit:2"}, "layerplan.draft", "is not a sub-plan of the target"),
    ({"draft": "ngram", "draft_length": "often"}, "layerplan.draft_length", "unknown draft length policy"),
    ({"draft_length": "fixed"}, "layerplan.draft_length", "decodes plainly"),
    ({"plans": "exit:1"}, "layerplan.plans", "Extra inputs are not permitted"),
    ({"plan": 3}, "layerplan.plan", "valid string"),
    ({"stream_interval": 2}, "layerplan.stream_interval", "less than or equal to 1"),
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_plan_or_draft_that_cannot_be_used_is_a_400_in_one_line_naming_it(client, path, options, param, says):
    body = _body("hi", 2, options)
    if "chat" in path:
        body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
    answer = client.post(path, json=body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and says in error["message"] and "\n" not in error["message"]
    assert client.get("/health").json()["failed"] == 0


# ----- each reply is its plan's and draft's alone --------------------------------------------------
@pytest.mark.parametrize("plan", ["skip:attn=1", "exit:2", "0,1,1,2", "skip:mlp=0;exit:2"])
def test_a_requests_plan_gives_the_greedy_text_generate_gives_with_it(client, tiny, plan):
    answer = client.post("/v1/completions", json=_body(PROMPTS[0], 24, {"plan": plan}))
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == _alone(tiny, PROMPTS[0], 24, plan).text
    chat = client.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 12, "temperature": 0,
                                                      "messages": [{"role": "user", "content": "hi"}],
                                                      "layerplan": {"plan": plan}})
    ids = tiny.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"]
    solo = generate(tiny, list(ids), tiny.plan(plan), 12, sampling=SamplingParams())
    assert chat.json()["choices"][0]["message"]["content"] == solo.text


def test_requests_of_different_plans_batched_together_each_get_their_plans_reply(tiny):
    """Three plans (the server's among them) and a model-running draft in flight at once: each
    reply is its solo run's, greedy and seeded."""
    app = create_app(tiny, served_name="tiny", max_batch=8)
    engine = app.state.scheduler
    in_flight: list[int] = []
    step = engine._step

    def counting_step(batch):  # how many decodes were in flight at each pass
        in_flight.append(engine.batch)
        step(batch)

    engine._step = counting_step
    cases = [(PROMPTS[0], 20, None, None, {}), (PROMPTS[1], 14, "skip:attn=1", None, {}),
             (PROMPTS[2], 26, "exit:2", None, {}), (PROMPTS[3], 9, None, None, {}),
             (PROMPTS[1], 18, "skip:attn=1", None, {"temperature": 0.8, "seed": 3}),
             (REPETITIVE, 22, "skip:mlp=2", "suffix", {}),  # a lookup draft: in its plan's batch
             (PROMPTS[0], 16, None, "skip:attn=0,1", {})]  # a self-draft runs a model: it decodes alone
    with serving(app) as base:
        gate, held = threading.Event(), threading.Event()

        def hold() -> None:  # holds the decode thread until every request has queued
            held.set()
            gate.wait(30)

        engine.submit(Job([5, 6, 7], 1, SamplingParams(), None, (), on_start=hold))
        assert held.wait(30)

        def ask(case):
            prompt, n, plan, draft, extra = case
            options = {k: v for k, v in (("plan", plan), ("draft", draft)) if v is not None}
            with httpx.Client(base_url=base, timeout=120) as http:
                answer = http.post("/v1/completions", json={**_body(prompt, n, options or None), **extra})
            assert answer.status_code == 200, answer.text
            return answer.json()["choices"][0]["text"]

        with ThreadPoolExecutor(len(cases)) as pool:
            replies = [pool.submit(ask, case) for case in cases]
            while engine.counters.waiting < len(cases):  # every request queued behind the held job
                threading.Event().wait(0.02)
            gate.set()
            replies = [reply.result() for reply in replies]
    for (prompt, n, plan, draft, extra), reply in zip(cases, replies):
        sampling = SamplingParams(temperature=extra["temperature"]) if extra else SamplingParams()
        ids = tiny.tokenizer(prompt).input_ids
        solo = generate(tiny, ids, tiny.plan(plan) if plan else None, n, sampling=sampling, seed=extra.get("seed"),
                        draft=draft)
        assert reply == solo.text, (prompt, plan, draft)
    assert max(in_flight) >= len(cases)  # they were decoding together, not one after another
    assert engine.counters.running == 0 and engine.counters.failed == 0


def test_a_server_that_drafts_with_a_model_makes_its_draft_for_a_requests_plan(tiny):
    """serve --draft exit:2 (one request at a time): a request's own plan gets the server's draft
    made for that plan; "draft": null decodes plainly; the replies stay the plan's greedy ones."""
    with TestClient(create_app(tiny, served_name="tiny", draft="exit:2")) as test_client:
        assert test_client.app.state.scheduler.max_batch == 1
        for options, drafter in (({"plan": "skip:attn=0"}, "skip:attn=0;exit:2"),
                                 ({"plan": "skip:attn=0", "draft": None}, None),
                                 ({"plan": "skip:attn=0", "draft": "suffix", "draft_length": "fixed"}, "suffix")):
            answer = test_client.post("/v1/completions", json=_body(REPETITIVE, 20, options))
            assert answer.status_code == 200, answer.text
            reply = answer.json()
            assert reply["choices"][0]["text"] == _alone(tiny, REPETITIVE, 20, "skip:attn=0").text
            assert reply["usage"].get("speculative", {}).get("drafter") == drafter, options
        short = test_client.post("/v1/completions", json=_body("hi", 2, {"plan": "exit:1"}))
        assert short.status_code == 400 and short.json()["error"]["param"] == "layerplan.plan"  # exit:2 > exit:1


# ----- provenance ----------------------------------------------------------------------------------
def _stream(client, body: dict) -> tuple[list[dict], dict]:
    """The stream's chunks with text (each: its text, and its layerplan.tokens) and its usage."""
    chunks, usage = [], {}
    with client.stream("POST", body.pop("path", "/v1/completions"),
                       json={**body, "stream": True, "stream_options": {"include_usage": True}}) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("usage"):
                usage = chunk["usage"]
            elif chunk["choices"]:
                choice = chunk["choices"][0]
                text = choice["delta"].get("content", "") if "delta" in choice else choice["text"]
                if text:
                    chunks.append({"text": text, "tokens": chunk.get("layerplan", {}).get("tokens")})
    return chunks, usage


def test_a_stream_says_where_each_token_came_from(client, tiny):
    chunks, usage = _stream(client, _body(REPETITIVE, 40, {"draft": "suffix", "provenance": True}))
    for chunk in chunks:  # each chunk's pieces are its text, token by token
        assert "".join(piece["text"] for piece in chunk["tokens"]) == chunk["text"]
    kinds = {piece["kind"] for chunk in chunks for piece in chunk["tokens"]}
    assert "accepted" in kinds and kinds <= set(TOKEN_KINDS)
    counts = usage["provenance"]
    assert counts["accepted"] > 0 and sum(counts.values()) == usage["completion_tokens"] == 40
    # one token a round ends a round (the prefill's first token is plain), unless the budget cut it off
    rounds = usage["speculative"]["rounds"]
    assert counts["accepted"] <= usage["speculative"]["accepted"] and counts["correction"] + counts["bonus"] <= rounds
    assert rounds <= counts["correction"] + counts["bonus"] + counts["plain"] <= rounds + 1
    assert "".join(chunk["text"] for chunk in chunks) == _alone(tiny, REPETITIVE, 40).text


@pytest.mark.parametrize("draft", ["suffix", "suffix:tree", "ngram|exit:2", "skip:attn=0"])
def test_every_drafter_labels_every_token_and_keeps_the_plain_text(tiny, draft):
    pieces: list = []
    result = _alone(tiny, REPETITIVE, 40, draft=draft, on_text=pieces.append)
    assert result.text == _alone(tiny, REPETITIVE, 40).text == "".join(pieces)
    assert sum(result.provenance.values()) == len(result.token_ids)
    assert result.provenance["accepted"] <= result.stats["accepted"]
    assert result.provenance["correction"] + result.provenance["bonus"] <= result.stats["rounds"] - \
        result.stats["plain_rounds"]
    assert all("".join(piece.text for piece in delta.pieces) == delta for delta in pieces)


def test_a_stream_interval_gathers_the_tokens_that_come_within_it_into_one_chunk(client, tiny):
    """stream_interval: fewer chunks, the same text, every token still labelled in order."""
    each, _ = _stream(client, _body(PROMPTS[1], 40, {"provenance": True}))
    gathered, usage = _stream(client, _body(PROMPTS[1], 40, {"provenance": True, "stream_interval": 1.0}))
    assert len(each) >= 30  # a chunk a token (a byte of a character may wait for the next)
    assert len(gathered) <= 3  # the tiny model's 40 tokens take well under the second
    assert len(gathered[0]["tokens"]) == 1 < len(gathered[-1]["tokens"])  # the first goes at once
    assert "".join(c["text"] for c in gathered) == "".join(c["text"] for c in each) == _alone(tiny, PROMPTS[1], 40).text
    assert all("".join(p["text"] for p in c["tokens"]) == c["text"] for c in gathered)
    assert [p for c in gathered for p in c["tokens"]] == [p for c in each for p in c["tokens"]]
    assert usage["completion_tokens"] == 40


def test_a_plain_stream_is_all_plain_and_provenance_is_only_sent_when_asked(client):
    chunks, usage = _stream(client, _body(PROMPTS[0], 30, {"provenance": True}))
    assert {piece["kind"] for chunk in chunks for piece in chunk["tokens"]} == {"plain"}
    assert usage["provenance"]["plain"] == usage["completion_tokens"] == 30 and "speculative" not in usage
    chat = {"path": "/v1/chat/completions", "model": "tiny", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "hi"}], "layerplan": {"provenance": True, "draft": "ngram"}}
    chunks, usage = _stream(client, chat)
    assert all("".join(p["text"] for p in c["tokens"]) == c["text"] for c in chunks)
    assert sum(usage["provenance"].values()) == usage["completion_tokens"]
    chunks, usage = _stream(client, _body(PROMPTS[0], 10))  # not asked: plain OpenAI chunks
    assert chunks and all(chunk["tokens"] is None for chunk in chunks) and "provenance" not in usage


def test_an_answer_not_streamed_says_where_each_token_came_from(client, tiny):
    """provenance without a stream: the answer's `layerplan.tokens`, its text by token with each
    one's kind (GenerationResult.pieces: character for character what the streamed deltas say);
    not asked, not sent."""
    def by_character(pieces) -> list[str]:
        return [piece.kind for piece in pieces for _ in piece.text]

    answer = client.post("/v1/completions", json=_body(REPETITIVE, 40, {"draft": "suffix", "provenance": True})).json()
    tokens, counts = answer["layerplan"]["tokens"], answer["usage"]["provenance"]
    assert "".join(piece["text"] for piece in tokens) == answer["choices"][0]["text"]
    assert "accepted" in {piece["kind"] for piece in tokens}
    assert all(sum(piece["kind"] == kind for piece in tokens) <= counts[kind] for kind in TOKEN_KINDS)
    assert "layerplan" not in client.post("/v1/completions", json=_body(REPETITIVE, 10)).json()
    deltas: list = []
    result = _alone(tiny, REPETITIVE, 40, draft="suffix", on_text=deltas.append)
    assert by_character(result.pieces) == by_character([piece for delta in deltas for piece in delta.pieces])
    assert "".join(piece.text for piece in result.pieces) == result.text


def test_streamed_pieces_split_a_token_held_back_for_a_stop_string_and_join_bytes_of_a_character():
    """The text pieces of each delta concatenate to it, whatever the stop strings hold back: a
    token's text may end in a later delta; a character of two byte tokens is the second one's."""
    from tiny_text import byte_tokenizer

    tokenizer = byte_tokenizer()
    deltas: list = []
    stream = TextStream(tokenizer, ["ldX"], deltas.append)
    ids = tokenizer("hé world").input_ids  # 'é' is two byte tokens
    kinds = ["plain", "accepted", "correction", "accepted", "bonus"] + ["plain"] * (len(ids) - 5)
    for n in range(1, len(ids) + 1):
        stream.update(ids[:n], kinds[:n])
    stream.finish()
    assert "".join(deltas) == "hé world"
    for delta in deltas:
        assert "".join(piece.text for piece in delta.pieces) == delta
    pieces = [piece for delta in deltas for piece in delta.pieces]
    assert pieces[:3] == [type(pieces[0])("h", "plain"), type(pieces[0])("é", "correction"),
                          type(pieces[0])(" ", "accepted")]
    assert any(len(delta.pieces) > 1 for delta in deltas)  # "ld" held back for "ldX", sent with what follows


def test_provenance_on_the_packaged_model(smollm2):
    """The packaged model, a chat stream with the suffix draft on a prompt it repeats: some tokens
    are accepted drafts, the pieces make the text, and the text is plain greedy's."""
    prompt = "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the lazy dog."
    with TestClient(create_app(smollm2)) as test_client:
        chunks, usage = _stream(test_client, {"path": "/v1/chat/completions", "model": smollm2.name,
                                              "max_tokens": 40, "temperature": 0,
                                              "messages": [{"role": "user", "content": prompt}],
                                              "layerplan": {"draft": "suffix", "provenance": True}})
        plain = test_client.post("/v1/chat/completions", json={
            "model": smollm2.name, "max_tokens": 40, "temperature": 0,
            "messages": [{"role": "user", "content": prompt}]}).json()["choices"][0]["message"]["content"]
    assert all("".join(p["text"] for p in c["tokens"]) == c["text"] for c in chunks)
    assert "".join(c["text"] for c in chunks) == plain
    assert usage["provenance"]["accepted"] > 0 and sum(usage["provenance"].values()) == usage["completion_tokens"]


def test_a_server_with_a_second_model_runs_plans_that_take_its_layers(tiny, tmp_path):
    """`serve --model-b`: a request's plan may take layers from model b, alone or batched with others
    (a list of prompts), each reply the one generate gives under that plan; a plan naming b where
    none is attached is a 400."""
    import torch

    from layerplan.engine.load import load_model
    from tiny_text import save_tiny_with_tokenizer

    model = load_model(str(save_tiny_with_tokenizer(tmp_path / "a", context=256)), dtype="float32")
    other = load_model(str(save_tiny_with_tokenizer(tmp_path / "b", context=256)), dtype="float32")
    with torch.no_grad():  # (the same seed made it: weights of its own)
        for weight in other.hf.model.layers.parameters():
            weight.add_(torch.randn_like(weight, generator=torch.Generator().manual_seed(1)) * 0.5)
    model.attach(other, "b")
    with TestClient(create_app(model, served_name="tiny", max_batch=4)) as client:
        texts = {}
        for plan in ("0,b:1,2", "b:0-2", "full"):
            answer = client.post("/v1/completions", json=_body(PROMPTS[:2], 12, {"plan": plan}))
            assert answer.status_code == 200, answer.text
            texts[plan] = [c["text"] for c in answer.json()["choices"]]
            assert texts[plan] == [_alone(model, prompt, 12, plan).text for prompt in PROMPTS[:2]], plan
        assert len({tuple(t) for t in texts.values()}) == 3  # (model b's layers change the replies)
    answer = TestClient(create_app(tiny, served_name="tiny")).post(
        "/v1/completions", json=_body(PROMPTS[0], 4, {"plan": "0,b:1,2"}))
    assert answer.status_code == 400 and "only a is loaded" in answer.json()["error"]["message"]
