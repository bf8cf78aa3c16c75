"""`layerplan serve` against a real HTTP client: a uvicorn server on 127.0.0.1 in a thread,
serving the packaged SmolLM2 (float32) with an n-gram drafter and an API key."""

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from layerplan.app.serve import ListenError, chat_prompt_ids, create_app, listen_socket
from layerplan.decoding.generate import generate
from layerplan.decoding.sampling_params import SamplingParams
from servers import serving

pytestmark = pytest.mark.real
KEY = "test-key"


@pytest.fixture(scope="module")
def server(smollm2):
    app = create_app(smollm2, draft="ngram", api_key=KEY)
    with serving(app) as base:
        yield base, app


def _client(base: str, key: str | None = KEY) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=base, headers=headers, timeout=120)


def _plain(model, prompt_ids, n):
    return generate(model, prompt_ids, max_new_tokens=n, sampling=SamplingParams()).text


def test_health_and_models(server, smollm2):
    base, _ = server
    health = httpx.get(f"{base}/health").json()
    assert health["status"] == "ok" and health["draft"] == "ngram"
    with _client(base) as client:
        models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [smollm2.name]


def test_completion_equals_plain_greedy_and_reports_usage(server, smollm2):
    base, _ = server
    prompt = "def fibonacci(n):\n    if n < 2:\n        return n\n    return"
    with _client(base) as client:
        response = client.post("/v1/completions", json={"model": smollm2.name, "prompt": prompt, "max_tokens": 12,
                                                        "temperature": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    ids = smollm2.tokenizer(prompt).input_ids
    assert body["choices"][0]["text"] == _plain(smollm2, ids, 12)
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(ids)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["speculative"]["drafter"] == "ngram" and usage["speculative"]["rounds"] >= 1


def test_chat_stream_matches_non_stream(server, smollm2):
    base, _ = server
    request = {"model": smollm2.name, "messages": [{"role": "user", "content": "Name three colours."}],
               "max_tokens": 10, "temperature": 0}
    with _client(base) as client:
        whole = client.post("/v1/chat/completions", json=request).json()
        chunks = []
        with client.stream("POST", "/v1/chat/completions",
                           json={**request, "stream": True, "stream_options": {"include_usage": True}}) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            for line in response.iter_lines():
                if line.startswith("data: "):
                    chunks.append(line[len("data: "):])
    assert chunks[-1] == "[DONE]"
    events = [json.loads(c) for c in chunks[:-1]]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    expected = _plain(smollm2, chat_prompt_ids(smollm2, request["messages"]), 10)
    assert text == whole["choices"][0]["message"]["content"] == expected
    finals = [e["choices"][0]["finish_reason"] for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert finals == [whole["choices"][0]["finish_reason"]]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]


def test_concurrent_requests_are_not_mixed(server, smollm2):
    base, _ = server
    prompts = ["The capital of France is", "1, 2, 3, 4,", "import numpy as", "Once upon a time", "The sky is"]

    def ask(prompt):
        with _client(base) as client:
            return client.post("/v1/completions", json={"model": smollm2.name, "prompt": prompt, "max_tokens": 8,
                                                        "temperature": 0}).json()["choices"][0]["text"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(ask, prompts))
    for prompt, answer in zip(prompts, answers):
        assert answer == _plain(smollm2, smollm2.tokenizer(prompt).input_ids, 8), prompt


def test_no_draft_nan_in_usage(server, smollm2):
    base, _ = server  # one new token: nothing is drafted, the acceptance rate is undefined -> null
    with _client(base) as client:
        response = client.post("/v1/completions", json={"model": smollm2.name, "prompt": "Hi", "max_tokens": 1})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["speculative"]["acceptance_rate"] is None


def test_a_request_without_a_model_goes_to_the_one_served(server, smollm2):
    """llama-server's and vLLM's clients may leave "model" out: it means the model served."""
    base, _ = server
    with _client(base) as client:
        named = client.post("/v1/completions", json={"model": smollm2.name, "prompt": "Hi", "max_tokens": 4,
                                                     "temperature": 0})
        bare = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "temperature": 0})
        chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                         "max_tokens": 4, "temperature": 0})
    assert bare.status_code == 200 and chat.status_code == 200, (bare.text, chat.text)
    assert bare.json()["choices"][0]["text"] == named.json()["choices"][0]["text"]
    assert bare.json()["model"] == chat.json()["model"] == smollm2.name


def test_sampling_with_seed_is_reproducible(server, smollm2):
    base, _ = server
    request = {"model": smollm2.name, "prompt": "My favourite food is", "max_tokens": 8, "temperature": 0.9,
               "top_p": 0.95, "seed": 7}
    with _client(base) as client:
        first, second = (client.post("/v1/completions", json=request).json() for _ in range(2))
    assert first["choices"][0]["text"] == second["choices"][0]["text"]


SERVED = object()  # stands for the served model's name


@pytest.mark.parametrize("body, status, needle", [
    ("{not json", 400, "malformed JSON"),
    ({"model": "gpt-4", "prompt": "hi"}, 404, "not served here"),
    ({"model": SERVED, "prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ({"model": SERVED, "prompt": "hi", "n": 17}, 400, "n"),
    ({"model": SERVED, "prompt": "hi", "max_tokens": 10**6}, 400, "context"),
    ({"model": SERVED, "prompt": "word " * 9000}, 400, "context"),
    ({"model": SERVED, "prompt": [10**9]}, 400, "out of range"),
    ({"model": SERVED, "prompt": "hi", "logprobs": 21}, 400, "logprobs"),
])
def test_bad_requests_get_4xx_and_the_server_stays_up(server, smollm2, body, status, needle):
    base, _ = server
    with _client(base) as client:
        if isinstance(body, str):
            response = client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
        else:
            body = {k: smollm2.name if v is SERVED else v for k, v in body.items()}
            response = client.post("/v1/completions", json=body)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert needle in error["message"], error
        assert client.get("/v1/models").status_code == 200


@pytest.mark.parametrize("extra, param, needle", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools", "function calling"),
    ({"tool_choice": "auto"}, "tool_choice", "function calling"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", "function calling"),
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions", "function calling"),
    ({"function_call": "auto"}, "function_call", "function calling"),
    ({"response_format": {"type": "json_object"}}, "response_format", "plain text only"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, "response_format",
     "plain text only"),
    ({"messages": [{"role": "user"}]}, "messages.0.content", "message 0 (user) has no content"),
    ({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": None}]},
     "messages.1.content", "message 1 (user) has no content"),
    ({"messages": [{"role": "user", "content": []}]}, "messages.0.content", "has no content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     "messages.0.content", "image_url are not supported"),
])
def test_chat_refuses_what_it_would_silently_ignore(server, smollm2, extra, param, needle):
    base, _ = server
    request = {"model": smollm2.name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, **extra}
    with _client(base) as client:
        for stream in (False, True):
            response = client.post("/v1/chat/completions", json={**request, "stream": stream})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert needle in error["message"] and error["param"] == param, error


@pytest.mark.parametrize("extra", [{"tool_choice": "none"}, {"tools": []}, {"response_format": {"type": "text"}},
                                   {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}])
def test_chat_accepts_the_forms_that_ask_for_nothing_more(server, smollm2, extra):
    base, _ = server
    request = {"model": smollm2.name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, **extra}
    with _client(base) as client:
        assert client.post("/v1/chat/completions", json=request).status_code == 200


def test_the_role_chunk_is_sent_when_decoding_starts_not_while_queued(server, smollm2):
    from layerplan.decoding.scheduler import Job

    base, app = server
    gate, busy = threading.Event(), threading.Event()

    def hold() -> None:  # a job ahead in the queue that keeps the decode thread until the gate opens
        busy.set()
        gate.wait(30)

    app.state.scheduler.submit(Job([1, 2, 3], 1, SamplingParams(), None, (), on_start=hold))
    assert busy.wait(30)
    lines: list[tuple[float, str]] = []

    def read() -> None:
        request = {"model": smollm2.name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                   "temperature": 0, "stream": True}
        with _client(base) as client, client.stream("POST", "/v1/chat/completions", json=request) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    lines.append((time.monotonic(), line[len("data: "):]))

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(1.5)  # the request is queued behind the held job
    assert lines == []
    released = time.monotonic()
    gate.set()
    reader.join(60)
    first = json.loads(lines[0][1])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert lines[0][0] >= released
    assert lines[-1][1] == "[DONE]"


def test_api_key_is_required(server, smollm2):
    base, _ = server
    for key in (None, "wrong"):
        with _client(base, key) as client:
            response = client.get("/v1/models")
        assert response.status_code == 401 and "API key" in response.json()["error"]["message"]
    assert httpx.get(f"{base}/health").status_code == 200  # health stays open for load balancers


def test_client_disconnect_mid_stream_stops_its_generation(server, smollm2):
    base, app = server
    counters = app.state.scheduler.counters
    cancelled_before = counters.cancelled
    request = {"model": smollm2.name, "prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 400,
               "temperature": 0, "stream": True}
    with _client(base) as client:
        with client.stream("POST", "/v1/completions", json=request) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    break  # got the first piece of text: hang up
    deadline = time.time() + 30
    while counters.cancelled == cancelled_before and time.time() < deadline:
        time.sleep(0.05)
    assert counters.cancelled == cancelled_before + 1
    assert counters.running == 0
    with _client(base) as client:  # the queue moved on
        response = client.post("/v1/completions", json={"model": smollm2.name, "prompt": "Hello", "max_tokens": 3})
    assert response.status_code == 200


def test_replies_are_not_held_back_by_nagle():
    """The server's connections send at once (TCP_NODELAY): with Nagle's algorithm, a reply written
    in two parts waited for the client's delayed acknowledgement, ~40 ms a request."""
    listening = listen_socket("127.0.0.1", 0)
    with listening, socket.create_connection(listening.getsockname()) as client:
        accepted, _ = listening.accept()
        with accepted:
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    with pytest.raises(ListenError, match="cannot listen on '127.0.0.1':70000: not an address"):
        listen_socket("127.0.0.1", 70000)
