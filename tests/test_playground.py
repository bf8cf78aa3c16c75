"""The web playground of `layerplan serve` (app/playground.py, app/playground/): its JSON endpoints
through httpx, and the page itself in Debian's chromium driven by selenium, as a person uses it:
type the API key, send a message and watch the reply stream in coloured tokens, switch the plan,
compare two plans side by side, run a scan and build a plan from its heatmap. A tiny random model
with a byte tokenizer serves it on 127.0.0.1 (a reply takes a fraction of a second)."""

import shutil
import time

import httpx
import pytest

from layerplan.app.serve import chat_prompt_ids, create_app
from layerplan.decoding.generate import generate
from layerplan.decoding.sampling_params import SamplingParams
from servers import serving

KEY = "playground-key"
NAME = "tiny"
BROWSER = shutil.which("chromium"), shutil.which("chromedriver")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from layerplan.engine.load import load_model
    from tiny_text import save_tiny_with_tokenizer

    folder = save_tiny_with_tokenizer(tmp_path_factory.mktemp("playground") / "tok")
    return load_model(str(folder), dtype="float32", engine="eager")


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    # scans are kept in the cache: this module's own, so that the page starts with none
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LAYERPLAN_CACHE", str(tmp_path_factory.mktemp("cache")))
        app = create_app(model, api_key=KEY, served_name=NAME)
        with serving(app) as base:
            yield base


def _client(base: str, key: str | None = KEY) -> httpx.Client:
    return httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=60)


def _greedy(model, text: str, n: int, plan: str | None = None) -> str:
    ids = chat_prompt_ids(model, [{"role": "user", "content": text}])
    return generate(model, ids, model.plan(plan), n, SamplingParams()).text


# ----- the endpoints ---------------------------------------------------------------------------
def test_the_key_guards_the_data_while_the_page_itself_loads_to_ask_for_it(server):
    with _client(server, key=None) as client:
        page = client.get("/")
        assert page.status_code == 200 and "<title>layerplan playground</title>" in page.text
        assert client.get("/playground/app.js").status_code == 200
        for path in ("/layerplan/info", "/layerplan/scan"):
            refused = client.get(path)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert client.post("/layerplan/plan", json={"plan": "0-2"}).status_code == 401
    with _client(server, key="wrong") as client:
        assert client.get("/layerplan/info").status_code == 401
    with _client(server) as client:
        info = client.get("/layerplan/info").json()
    assert info["model"] == NAME and info["layers"] == 3 and info["plan"] == "full"
    drafters = {d["keyword"]: d for d in info["drafters"]}
    assert drafters["ngram"]["example"] == "ngram" and drafters["exit"]["example"] == "exit:1"
    assert drafters[None]["syntax"] == "PLAN" and "skip:attn" in info["plan_help"]


def test_plans_are_read_and_written_by_the_servers_parser(server):
    with _client(server) as client:
        base = client.post("/layerplan/plan", json={}).json()
        assert base["plan"] == "full" and [s["layer"] for s in base["steps"]] == [0, 1, 2]
        toggled = client.post("/layerplan/plan", json={"plan": "0-2", "toggle": {"step": 1, "part": "attention"}}).json()
        assert toggled["plan"] == "skip:attn=1" and toggled["steps"][1] == {"step": 1, "layer": 1, "attention": False,
                                                                             "mlp": True}
        back = client.post("/layerplan/plan", json={"plan": toggled["plan"], "toggle": {"step": 1, "part": "attention"}})
        assert back.json()["plan"] == "full"
        for body, words in [({"plan": "0-9"}, "layer 9"), ({"plan": "skip:attn=0-2;mlp=0-2"}, "skips every"),
                            ({"plan": "0-2", "toggle": {"step": 7, "part": "mlp"}}, "step 7 is out of range"),
                            ({"plan": "0-2", "toggle": {"step": 0, "part": "head"}}, "toggle.part"),
                            ({"plan": "/etc/passwd"}, "")]:
            refused = client.post("/layerplan/plan", json=body)
            message = refused.json()["error"]["message"]
            assert refused.status_code == 400 and "\n" not in message and words in message, (body, message)


def test_a_scan_from_the_page_runs_between_passes_and_is_kept(server, model):
    from layerplan.search.importance import ScanItem, load_cached_scan

    with _client(server) as client:
        started = client.post("/layerplan/scan", json={"tokens": 16}).json()
        assert started["job"]["state"] in ("running", "done")
        assert client.post("/layerplan/scan", json={"tokens": 4}).status_code == 400  # fewer than a scan reads
        for _ in range(200):
            state = client.get("/layerplan/scan").json()
            if state["job"]["state"] != "running":
                break
            time.sleep(0.05)
    assert state["job"]["state"] == "done", state["job"]
    assert state["job"]["done"] == state["job"]["total"] == 6  # 3 layers x (attention, MLP)
    kinds = {(item["kind"], item["layer"]) for item in state["scan"]["items"]}
    assert kinds == {(kind, layer) for kind in ("attention", "mlp") for layer in range(3)}
    assert load_cached_scan(model.name).items == [ScanItem(**item) for item in state["scan"]["items"]]


# ----- the page in a browser -------------------------------------------------------------------
@pytest.fixture(scope="module")
def browser(server):
    if not all(BROWSER):
        pytest.skip("Debian's chromium and chromium-driver are not installed (make test installs them: "
                    ".ci/install-chromium)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = BROWSER[0]
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(BROWSER[1]), options=options)
    driver.set_script_timeout(30)
    try:
        driver.get(server + "/")
        _wait(driver, lambda d: d.find_element("id", "key-form").is_displayed(), "the page asks for the key")
        driver.find_element("id", "key").send_keys(KEY + "\n")
        _wait(driver, lambda d: "3 layers" in d.find_element("id", "model-name").text, "the model's facts")
        yield driver
    finally:
        driver.quit()


def _wait(driver, condition, what: str, seconds: float = 30.0):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, seconds, poll_frequency=0.05).until(condition, f"waited {seconds:.0f} s for {what}")


def _text(driver, element_id: str) -> str:
    return driver.find_element("id", element_id).text


def _tab(driver, view: str) -> None:
    driver.find_element("id", f"tab-{view}").click()


def _send_chat(driver, text: str) -> dict:
    """Send a message; the reply's text (as the page shows it), token kinds and stats line."""
    replies = len(driver.find_elements("css selector", ".msg.assistant"))
    box = driver.find_element("id", "chat-input")
    box.send_keys(text + "\n")
    _wait(driver, lambda d: len(d.find_elements("css selector", ".msg.assistant .footer")) > replies
          and "tokens/s" in d.find_elements("css selector", ".msg.assistant .footer")[-1].text, "the reply")
    return driver.execute_script("""
        const reply = [...document.querySelectorAll('.msg.assistant')].pop();
        const spans = [...reply.querySelectorAll('.tok')];
        return {text: reply.firstChild.textContent, kinds: spans.map(s => s.className.split(' ')[1]),
                footer: reply.querySelector('.footer').textContent, stats: document.getElementById('chat-stats').textContent};
    """)


def test_a_message_streams_its_reply_in_tokens_with_the_servers_figures(browser, model, tmp_path):
    _tab(browser, "chat")
    browser.find_element("id", "chat-max").clear()
    browser.find_element("id", "chat-max").send_keys("12")
    reply = _send_chat(browser, "hello")
    assert reply["text"] == _greedy(model, "hello", 12)
    assert len(reply["kinds"]) >= 1 and set(reply["kinds"]) <= {"plain", "accepted", "correction", "bonus"}
    assert "12 tokens" in reply["stats"] and "tokens/s" in reply["stats"]
    assert "plan full" in reply["footer"]
    browser.save_screenshot(str(tmp_path / "chat.png"))


def test_switching_the_plan_changes_the_request_and_its_reply(browser, model):
    _tab(browser, "chat")
    browser.find_element("id", "chat-reset").click()
    plan = browser.find_element("id", "chat-plan")
    plan.clear()
    plan.send_keys("skip:attn=1")
    reply = _send_chat(browser, "hello")
    assert "plan skip:attn=1" in reply["footer"]
    assert reply["text"] == _greedy(model, "hello", 12, "skip:attn=1")
    plan.clear()


def test_a_bad_plan_in_the_chat_gets_the_servers_line_and_the_chat_goes_on(browser, model):
    _tab(browser, "chat")
    browser.find_element("id", "chat-reset").click()
    plan = browser.find_element("id", "chat-plan")
    plan.clear()
    plan.send_keys("0-9")
    browser.find_element("id", "chat-input").send_keys("hello\n")
    _wait(browser, lambda d: "layer 9" in _text(d, "error"), "the error line")
    assert "\n" not in _text(browser, "error") and "failed" in _text(browser, "chat-log")
    plan.clear()
    reply = _send_chat(browser, "hello")
    assert reply["text"] == _greedy(model, "hello", 12) and not browser.find_element("id", "error").is_displayed()


def test_tokens_are_coloured_by_their_provenance(browser):
    _tab(browser, "chat")
    browser.find_element("id", "chat-reset").click()
    browser.find_element("id", "chat-draft").send_keys("ngram")
    browser.find_element("id", "chat-max").clear()
    browser.find_element("id", "chat-max").send_keys("40")
    reply = _send_chat(browser, "abcabcabcabcabcabcabcabc")
    browser.find_element("id", "chat-draft").clear()
    assert "accepted" in reply["kinds"], reply
    assert "acceptance" in reply["stats"]
    colours = browser.execute_script("""return [...new Set([...document.querySelectorAll('.msg.assistant .tok.accepted')]
        .map(s => getComputedStyle(s).backgroundColor))]""")
    assert colours and colours != ["rgba(0, 0, 0, 0)"]


def test_ab_answers_one_prompt_with_two_plans_and_measures_their_agreement(browser, model):
    _tab(browser, "ab")
    browser.find_element("id", "ab-plan-b").send_keys("skip:mlp=0")
    browser.find_element("id", "ab-max").clear()
    browser.find_element("id", "ab-max").send_keys("10")
    browser.find_element("id", "ab-input").send_keys("hello")
    browser.find_element("id", "ab-send").click()
    _wait(browser, lambda d: d.find_element("id", "ab-agreement").text.startswith("agreement"), "the comparison")
    a, b = _text(browser, "ab-out-a"), _text(browser, "ab-out-b")
    assert a and b
    assert "tokens/s" in _text(browser, "ab-stats-a") and "tokens/s" in _text(browser, "ab-stats-b")
    assert _text(browser, "ab-label-a") == "full" and _text(browser, "ab-label-b") == "skip:mlp=0"
    texts = browser.execute_script("return [document.getElementById('ab-out-a').textContent, "
                                   "document.getElementById('ab-out-b').textContent]")
    same = next((i for i, (x, y) in enumerate(zip(*texts)) if x != y), min(map(len, texts)))
    agreement = _text(browser, "ab-agreement")
    assert (agreement.startswith("agreement: the same text") if texts[0] == texts[1]
            else f"the first {same} of {max(map(len, texts))} characters" in agreement), agreement


def test_the_plan_builder_runs_a_scan_and_writes_the_plan_a_click_asks_for(browser):
    _tab(browser, "builder")
    browser.find_element("id", "scan-tokens").clear()
    browser.find_element("id", "scan-tokens").send_keys("16")
    browser.find_element("id", "scan-run").click()
    _wait(browser, lambda d: "base perplexity" in _text(d, "scan-status"), "the scan")
    cell = browser.find_element("id", "cell-attention-1")
    assert "KL" in cell.get_attribute("title") and cell.value_of_css_property("background-color") != "rgba(0, 0, 0, 0)"
    cell.click()
    _wait(browser, lambda d: d.find_element("id", "builder-plan").get_attribute("value") == "skip:attn=1", "the plan")
    assert "off" in browser.find_element("id", "cell-attention-1").get_attribute("class")
    browser.find_element("id", "cell-mlp-2").click()
    _wait(browser, lambda d: d.find_element("id", "builder-plan").get_attribute("value") == "skip:attn=1;mlp=2",
          "the second cell")
    browser.find_element("id", "builder-use").click()
    assert browser.find_element("id", "chat-plan").get_attribute("value") == "skip:attn=1;mlp=2"
    assert browser.find_element("id", "view-chat").is_displayed()


def test_a_bad_plan_shows_the_parsers_line_and_the_page_goes_on(browser):
    _tab(browser, "builder")
    box = browser.find_element("id", "builder-plan")
    box.clear()
    box.send_keys("0-9\n")
    _wait(browser, lambda d: "layer 9" in _text(d, "error"), "the error line")
    box.clear()
    box.send_keys("0-2\n")
    _wait(browser, lambda d: not d.find_element("id", "error").is_displayed(), "the error to clear")
    assert "off" not in browser.find_element("id", "cell-attention-1").get_attribute("class")
