"""Several choices in one request (OpenAI's `n`, and a completion's list of prompts): decoded
together, each choice what its request alone gives (choice k sampled with seed + k), in index
order, with usage summed; streamed too, each chunk under its choice's index; best_of's candidates,
the best n answered; refused in one line where there are too many. A tiny model with a byte
tokenizer keeps it fast."""

import json

import pytest

from layerplan.app.serve import MAX_CHOICES, create_app

PROMPTS = ["the cat the cat", "0101010101", "hello hello", "xxxxxxxx"]


@pytest.fixture(scope="module")
def client(tiny_text_client):  # (conftest.py's: tiny_text_model served as "tiny")
    return tiny_text_client


def _post(client, path: str, **body) -> dict:
    answer = client.post(path, json={"model": "tiny", "max_tokens": 12, **body})
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_a_list_of_prompts_answers_each_as_alone(client):
    many = _post(client, "/v1/completions", prompt=PROMPTS, temperature=0, logprobs=1, echo=True)
    alone = [_post(client, "/v1/completions", prompt=p, temperature=0, logprobs=1, echo=True) for p in PROMPTS]
    assert [c["index"] for c in many["choices"]] == list(range(len(PROMPTS)))
    for choice, single in zip(many["choices"], alone):
        assert choice["text"] == single["choices"][0]["text"]
        assert choice["logprobs"]["tokens"] == single["choices"][0]["logprobs"]["tokens"]
        assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(
            single["choices"][0]["logprobs"]["token_logprobs"][1:], abs=1e-5)
    assert many["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    assert many["usage"]["completion_tokens"] == sum(a["usage"]["completion_tokens"] for a in alone)
    ids = [[5, 6, 7], [8, 9]]  # token ids, several
    by_ids = _post(client, "/v1/completions", prompt=ids, temperature=0)
    assert [c["text"] for c in by_ids["choices"]] == [
        _post(client, "/v1/completions", prompt=one, temperature=0)["choices"][0]["text"] for one in ids]


@pytest.mark.parametrize("path, prompt", [("/v1/completions", {"prompt": PROMPTS[0]}),
                                          ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})])
def test_n_choices_are_sampled_with_seed_plus_their_index(client, path, prompt):
    many = _post(client, path, **prompt, n=3, temperature=1.0, seed=11)
    texts = [c["text"] if "text" in c else c["message"]["content"] for c in many["choices"]]
    alone = []
    for k in range(3):
        one = _post(client, path, **prompt, temperature=1.0, seed=11 + k)["choices"][0]
        alone.append(one["text"] if "text" in one else one["message"]["content"])
    assert texts == alone and len(set(texts)) > 1
    assert [c["index"] for c in many["choices"]] == [0, 1, 2]
    greedy = _post(client, path, **prompt, n=2, temperature=0)
    assert len({str(c.get("text", c.get("message"))) for c in greedy["choices"]}) == 1


@pytest.mark.parametrize("body, param, says", [
    ({"prompt": ["a"] * 17, "n": 4}, "prompt", f"at most {MAX_CHOICES} a request"),
    ({"prompt": "a", "n": 17}, "n", "less than or equal to 16"),
    ({"prompt": "a", "n": 3, "best_of": 2}, "best_of", "must be at least n"),
    ({"prompt": "a", "best_of": 2, "stream": True}, "best_of", "cannot be streamed"),
    ({"prompt": ["a"] * 5, "best_of": 16}, "prompt", "best_of=16 is 80 completions"),
    ({"prompt": "a", "best_of": 17}, "best_of", "less than or equal to 16"),
])
def test_choices_the_server_will_not_decode_are_a_400_naming_them(client, body, param, says):
    answer = client.post("/v1/completions", json={"model": "tiny", "max_tokens": 2, **body})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text
    assert says in answer.json()["error"]["message"]


@pytest.mark.parametrize("logprobs", [None, 1])
def test_best_of_answers_the_n_candidates_of_highest_mean_logprob(client, logprobs):
    """best_of 4, n 2: each prompt's four candidates (candidate k sampled with seed + k, as choices
    are), the two with the highest mean token logprob answered, best first; usage counts all four."""
    asked = {"logprobs": logprobs} if logprobs is not None else {}
    answer = _post(client, "/v1/completions", prompt=PROMPTS[:2], best_of=4, n=2, temperature=1.0, seed=3, **asked)
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    completion_tokens = 0
    for p, prompt in enumerate(PROMPTS[:2]):
        alone = [_post(client, "/v1/completions", prompt=prompt, temperature=1.0, seed=3 + k, logprobs=0)
                 for k in range(4)]
        completion_tokens += sum(a["usage"]["completion_tokens"] for a in alone)
        means = [sum(a["choices"][0]["logprobs"]["token_logprobs"]) / len(a["choices"][0]["logprobs"]["token_logprobs"])
                 for a in alone]
        best = sorted(range(4), key=lambda k: means[k], reverse=True)[:2]
        assert len({a["choices"][0]["text"] for a in alone}) > 1
        for rank, k in enumerate(best):
            mine = answer["choices"][p * 2 + rank]
            assert mine["text"] == alone[k]["choices"][0]["text"]
            if logprobs is None:
                assert mine["logprobs"] is None
            else:
                assert mine["logprobs"]["tokens"] == alone[k]["choices"][0]["logprobs"]["tokens"]
    assert answer["usage"]["completion_tokens"] == completion_tokens


def test_best_of_equal_to_n_is_n(client):
    one = _post(client, "/v1/completions", prompt=PROMPTS[0], best_of=3, n=3, temperature=1.0, seed=9)
    other = _post(client, "/v1/completions", prompt=PROMPTS[0], n=3, temperature=1.0, seed=9)
    assert [c["text"] for c in one["choices"]] == [c["text"] for c in other["choices"]]


def _streamed(client, path: str, **body) -> list[dict]:
    chunks = []
    with client.stream("POST", path, json={"model": "tiny", "max_tokens": 12, "stream": True, **body}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[len("data: "):])
    assert chunks[-1] == "[DONE]"
    return [json.loads(chunk) for chunk in chunks[:-1]]


@pytest.mark.parametrize("path, prompt", [
    ("/v1/completions", {"prompt": PROMPTS[:3], "echo": True, "logprobs": 2}),
    ("/v1/completions", {"prompt": PROMPTS[0], "n": 3}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 3, "logprobs": True,
                              "top_logprobs": 1}),
])
@pytest.mark.parametrize("interval", [0.0, 0.05])
def test_several_choices_stream_each_under_its_index_as_answered_whole(client, path, prompt, interval):
    """Each choice's chunks, joined, are its text in the answer not streamed (the same seeds); one
    reason a choice, last among its chunks; a chat choice's role first; the usage the answer's."""
    body = {**prompt, "temperature": 1.0, "seed": 5}
    whole = _post(client, path, **body)
    chunks = _streamed(client, path, **body, stream_options={"include_usage": True},
                       layerplan={"stream_interval": interval})
    usage = chunks.pop()
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    assert usage["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    for choice in whole["choices"]:
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == choice["index"]]
        if "message" in choice:
            assert mine[0]["delta"] == {"role": "assistant", "content": ""}
            assert "".join(c["delta"].get("content", "") for c in mine) == choice["message"]["content"]
            tokens = [t["token"] for c in mine if c["logprobs"] for t in c["logprobs"]["content"]]
            assert tokens == [t["token"] for t in choice["logprobs"]["content"]]
        else:
            assert "".join(c["text"] for c in mine) == choice["text"]
            if "logprobs" in prompt:
                assert [t for c in mine if c["logprobs"] for t in c["logprobs"]["tokens"]] == \
                    choice["logprobs"]["tokens"]
        reasons = [c["finish_reason"] for c in mine if c["finish_reason"] is not None]
        assert reasons == [choice["finish_reason"]] and mine[-1]["finish_reason"] is not None


def test_lm_evals_batches_score_as_its_single_requests(tiny_text_model):
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from servers import serving

    pairs = [("the cat sat on", " the mat"), ("hello", " world"), ("0101010", "1010"), ("abc", "def"), ("x", "y")]
    with serving(create_app(tiny_text_model, served_name="tiny", max_batch=8)) as base:
        scored = {}
        for batch in (1, 4):
            lm = LocalCompletionsAPI(base_url=f"{base}/v1/completions", model="tiny", tokenizer_backend="auto",
                                     max_length=128, batch_size=batch)
            scored[batch] = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)])
    assert [greedy for _, greedy in scored[4]] == [greedy for _, greedy in scored[1]]
    assert [value for value, _ in scored[4]] == pytest.approx([value for value, _ in scored[1]], abs=1e-5)
