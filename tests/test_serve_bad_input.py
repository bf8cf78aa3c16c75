"""The server's answers to client mistakes: a 4xx with OpenAI's error shape, never a 500, and the
server stays healthy. A tiny model with a byte tokenizer (context 128 tokens) keeps every request
fast; the fuzz draws request bodies from the app's own OpenAPI schema."""

import json
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from hypothesis import given
from hypothesis import strategies as st

from fuzzing import fuzz_settings
from layerplan.app.serve import create_app
from servers import serving


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from tiny_text import save_tiny_with_tokenizer

    return save_tiny_with_tokenizer(tmp_path_factory.mktemp("serve") / "tok")


def _load(folder):
    from layerplan.engine.load import load_model

    return load_model(str(folder), dtype="float32", engine="eager")


@pytest.fixture(scope="module")
def client(tiny_folder):
    model = _load(tiny_folder)
    with TestClient(create_app(model, served_name="tiny")) as test_client:
        yield test_client


def _healthy(client) -> dict:
    health = client.get("/health")
    assert health.status_code == 200
    return health.json()


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 2}


@pytest.mark.parametrize("field, value, param", [
    ("seed", 2 ** 70, "seed"),  # torch: "Overflow when unpacking long long", a 500
    ("temperature", 1e-300, "temperature"),  # logits / 1e-300: inf, NaN probabilities, a 500
    ("repetition_penalty", 1e-300, "repetition_penalty"),
    ("repetition_penalty", 1e300, "repetition_penalty"),
])
@pytest.mark.parametrize("path, body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
def test_settings_whose_arithmetic_fails_are_a_400_naming_them(client, path, body, field, value, param):
    before = _healthy(client)["failed"]
    answer = client.post(path, json={**body, field: value})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert _healthy(client)["failed"] == before


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/completions", {"best_of": 3, "stream": True}, "best_of"),
    ("/v1/completions", {"suffix": "the end"}, "suffix"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages.0.content.0"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                          {"type": "text", "text": 5}]}]},
     "messages.0.content.1"),
])
def test_what_the_server_cannot_honour_is_refused_not_ignored(client, path, extra, param):
    body = {**(COMPLETION if "chat" not in path else CHAT), **extra}
    answer = client.post(path, json=body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param


def test_what_it_can_honour_still_answers(client):
    assert client.post("/v1/completions", json={**COMPLETION, "best_of": 1, "suffix": "", "seed": 2 ** 63}).status_code == 200
    assert client.post("/v1/completions", json={**COMPLETION, "best_of": 2}).status_code == 200
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": ""}]}]}
    assert client.post("/v1/chat/completions", json={**CHAT, **parts}).status_code == 200


def test_a_conversation_the_chat_template_refuses_is_a_400(tiny_folder):
    model = _load(tiny_folder)
    model.tokenizer.chat_template = "{{ raise_exception('roles must alternate user/assistant/user/assistant') }}"
    with TestClient(create_app(model, served_name="tiny")) as test_client:
        answer = test_client.post("/v1/chat/completions", json=CHAT)
    assert answer.status_code == 400 and "roles must alternate" in answer.json()["error"]["message"]


class _SlowTokenizer:
    """The model's tokenizer, taking `delay` seconds per call (as a 1 MB prompt takes ~2 s)."""

    def __init__(self, inner, delay: float) -> None:
        self.inner, self.delay = inner, delay

    def __call__(self, *args, **kwargs):
        time.sleep(self.delay)
        return self.inner(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        time.sleep(self.delay)
        return self.inner.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("path, body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
def test_tokenizing_a_long_prompt_does_not_hold_up_health(tiny_folder, path, body):
    model = _load(tiny_folder)
    model.tokenizer = _SlowTokenizer(model.tokenizer, 2.0)
    with serving(create_app(model, served_name="tiny"), wait_seconds=20.0) as base:
        slow = threading.Thread(target=lambda: httpx.post(f"{base}{path}", json=body, timeout=60))
        slow.start()
        time.sleep(0.5)  # the request is being tokenized now
        start = time.perf_counter()
        assert httpx.get(f"{base}/health", timeout=30).status_code == 200
        waited = time.perf_counter() - start
        slow.join(timeout=60)
        assert waited < 1.0, f"/health waited {waited:.2f}s behind the tokenizer"


# ----- the fuzz: request bodies from the OpenAPI schema --------------------------------------------
EDGE_NUMBERS = [0, 1, -1, 2, 0.5, 1e-300, 1e-5, 1e300, -0.0, 2 ** 63, 2 ** 64, 2 ** 70, -(2 ** 70), 1.5, 3]
EDGE_TEXTS = ["", " ", "tiny", "hi", "\x00", "\ud7ff", "x" * 200, "user", "assistant", "system", "tool", "text",
              "image_url", "none", "auto", "json_object"]
json_scalars = st.none() | st.booleans() | st.sampled_from(EDGE_NUMBERS) | st.integers() | st.floats(
    allow_nan=False, allow_infinity=False) | st.sampled_from(EDGE_TEXTS) | st.text(max_size=12)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.sampled_from(EDGE_TEXTS) | st.text(max_size=5), inner, max_size=3),
                           max_leaves=8)


def _from_schema(schema: dict, components: dict, depth: int = 0):
    """Values for a JSON schema: inside it and at and beyond its bounds."""
    if "$ref" in schema:
        return _from_schema(components[schema["$ref"].rsplit("/", 1)[1]], components, depth + 1)
    if "anyOf" in schema:
        return st.one_of([_from_schema(option, components, depth) for option in schema["anyOf"]])
    kind = schema.get("type")
    if kind == "string":
        return st.sampled_from(EDGE_TEXTS) | st.text(max_size=30)
    if kind in ("integer", "number"):
        bounds = [schema[k] for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum") if k in schema]
        near = [type_(b) + d for b in bounds for d in (-1, 0, 1) for type_ in ((int,) if kind == "integer" else (int, float))]
        values = st.sampled_from(EDGE_NUMBERS + near) | st.integers(-(2 ** 70), 2 ** 70)
        return values if kind == "integer" else values | st.floats(allow_nan=False, allow_infinity=False)
    if kind == "boolean":
        return st.booleans()
    if kind == "array":
        items = _from_schema(schema.get("items", {}), components, depth + 1) if depth < 4 else json_scalars
        return st.lists(items, max_size=3)
    if kind == "object" and "properties" in schema:
        return _object(schema, components, depth + 1)
    return json_values


def _object(schema: dict, components: dict, depth: int = 0):
    properties = {name: _from_schema(sub, components, depth) | json_values for name, sub in schema["properties"].items()}
    required = {name: properties[name] for name in schema.get("required", [])}
    return st.fixed_dictionaries(required, optional={k: v for k, v in properties.items() if k not in required})


UNSUPPORTED = st.fixed_dictionaries({}, optional={
    "best_of": st.sampled_from([0, 1, 2, None, "2"]), "suffix": st.sampled_from(["", "x", None, 3]),
    "tools": json_values, "tool_choice": json_values, "functions": json_values, "response_format": json_values,
    "user": json_values, "logit_bias": json_values, "logprobs": json_values, "echo": json_values})


# the `layerplan` extension object: plans and drafts that fit the tiny model (3 layers), that do not,
# and that would read the server's files or load a second model
PLANS = ["full", "skip:attn=1", "exit:2", "0,1,1,2", "skip:mlp=0;exit:1", "exit:9", "bogus", "", "plan.json", "a\nb"]
DRAFTS = ["ngram", "suffix", "suffix:tree", "exit:1", "skip:attn=0", "dynamic:confidence=0.5", "ngram|exit:1",
          "exit:1+vocab=8", "auto", "suffix:corpus=/etc/hostname", "exit:1+head=/etc/hostname", "model:/tmp",
          "self:bits=q4_0", "bogus", ""]
LAYERPLAN = st.fixed_dictionaries({}, optional={
    "plan": st.sampled_from(PLANS) | json_values, "draft": st.sampled_from(DRAFTS) | json_values,
    "draft_length": st.sampled_from(["fixed", "adaptive", "heuristic", "often"]) | json_values,
    "provenance": st.booleans() | json_values, "plans": json_values})


@pytest.fixture(scope="module")
def schemas(client):
    components = client.get("/openapi.json").json()["components"]["schemas"]
    return {path: _object(components[name], components) for path, name in
            (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatRequest"))}


@fuzz_settings(quick=200, full=4000)
@given(data=st.data())
def test_fuzzed_request_bodies_get_a_4xx_or_an_answer_never_a_500(client, schemas, data):
    path = data.draw(st.sampled_from(sorted(schemas)))
    kind = data.draw(st.integers(0, 19))
    if kind == 0:  # not a JSON object at all
        raw = data.draw(st.sampled_from([b"", b"{", b"[]", b"null", b"\xff\xfe", b'{"model": "tiny"', b"1e999"])
                        | st.binary(max_size=40))
        answer = client.post(path, content=raw, headers={"Content-Type": "application/json"})
    else:
        body = data.draw(schemas[path])
        if kind < 15:  # mostly past the first checks: the served model, a short answer
            body.setdefault("model", "tiny")
            body.setdefault("max_tokens", data.draw(st.integers(0, 4)))
            if data.draw(st.booleans()):
                body["model"] = "tiny"
        body.update(data.draw(UNSUPPORTED) if kind % 3 == 0 else {})
        if kind % 4 == 1:
            body["layerplan"] = data.draw(LAYERPLAN)
        answer = client.post(path, content=json.dumps(body, allow_nan=True), headers={"Content-Type": "application/json"})
    assert answer.status_code < 500, answer.text
    if answer.status_code >= 400:
        assert answer.json()["error"]["message"]
    else:
        assert "server_error" not in answer.text and "generation failed" not in answer.text
    health = _healthy(client)
    assert health["failed"] == 0 and health["running"] == 0
