"""The playground's screenshots in docs/, from `layerplan serve` on the packaged SmolLM2 driven in
Debian's chromium (as tests/test_playground.py drives it on a tiny model): a chat with a plan
switched mid-conversation, an A/B of the full model against a plan from the heatmap, and the plan
builder over the model's layer scan (the cached one, or one run from the page).

    python benchmarks/playground_screens.py [--model smollm2] [--dtype D] [--draft ngram] [--out docs]
                                            [--scan-tokens 128] [--skip 2] [--measure N]

--measure N: afterwards, N rounds of the same greedy request through the page and through the API
(httpx, streamed), alternating; prints the server's tokens/s of each (its decode clock, the
`usage` block) and their ratio as one JSON object. The page asks nothing extra of the decode, so
the ratio should be 1 within the machine's noise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

CHAT = ["Write a Python function that reverses a string.", "Now make it reverse the words instead."]
AB_PROMPT = "Name three colours and one thing of each colour."
MEASURE_PROMPT = "Explain what a compiler does, step by step."


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _browser(width: int = 1360, height: int = 1000):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        sys.exit("needs Debian's chromium and chromium-driver: bash .ci/install-chromium")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", f"--window-size={width},{height}",
                 "--hide-scrollbars"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(driver), options=options)


def _wait(driver, condition, what: str, seconds: float = 600.0, poll: float = 0.1):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, seconds, poll_frequency=poll).until(condition, f"waited {seconds:.0f} s for {what}")


def _fill(driver, element_id: str, text: str) -> None:
    box = driver.find_element("id", element_id)
    box.clear()
    box.send_keys(text)


def _chat(driver, text: str, poll: float = 0.1) -> str:
    """Send a message; the stats line of its reply once the server's usage came. poll: seconds
    between looks at the page (each look is work for the browser, on the cores that decode)."""
    replies = len(driver.find_elements("css selector", ".msg.assistant .footer"))
    _fill(driver, "chat-input", text + "\n")
    _wait(driver, lambda d: len(d.find_elements("css selector", ".msg.assistant .footer")) > replies
          and "tokens/s" in d.find_elements("css selector", ".msg.assistant .footer")[-1].text, "the reply", poll=poll)
    return driver.find_element("id", "chat-stats").text


def _rate(stats: str) -> float:
    return float(re.search(r"([\d.]+) tokens/s", stats).group(1))


def _api_rate(base: str, model: str, tokens: int) -> float:
    """The server's tokens/s for the request the page sends (provenance asked for, as the page does)."""
    body = {"model": model, "messages": [{"role": "user", "content": MEASURE_PROMPT}], "max_tokens": tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "layerplan": {"provenance": True, "stream_interval": 0.25}}
    usage = None
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
    return usage["tokens_per_second"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default=None, help="serve's --dtype (default: serve's own)")
    parser.add_argument("--draft", default="ngram", help="serve's --draft; none: plain decoding (the steadiest rate "
                        "to compare page and API by: an adaptive draft's speed moves from run to run)")
    parser.add_argument("--out", default="docs")
    parser.add_argument("--scan-tokens", type=int, default=128, help="tokens of a scan run from the page, if none is cached")
    parser.add_argument("--skip", type=int, default=2, help="sub-layers to switch off in the plan builder")
    parser.add_argument("--measure", type=int, default=0, metavar="N")
    parser.add_argument("--measure-tokens", type=int, default=128)
    args = parser.parse_args()

    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    command = [str(Path(sys.executable).with_name("layerplan")), "serve", "--model", args.model, "--port", str(port)]
    command += (["--draft", args.draft] if args.draft != "none" else []) + (["--dtype", args.dtype] if args.dtype else [])
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    driver = None
    try:
        for _ in range(1200):
            try:
                info = httpx.get(f"{base}/health").json()
                break
            except httpx.TransportError:
                time.sleep(0.25)
        else:
            sys.exit("the server did not start in 5 minutes")
        out = Path(args.out)
        driver = _browser()
        driver.get(base + "/")
        _wait(driver, lambda d: "layers" in d.find_element("id", "model-name").text, "the page")

        # the plan builder first: its plan goes into the chat and the A/B
        driver.find_element("id", "tab-builder").click()
        status = driver.find_element("id", "scan-status").text
        if "base perplexity" not in status:
            _fill(driver, "scan-tokens", str(args.scan_tokens))
            driver.find_element("id", "scan-run").click()
            _wait(driver, lambda d: "base perplexity" in d.find_element("id", "scan-status").text, "the scan", 3600)
        # the --skip sub-layers the scan finds least harmful to switch off, clicked as a person would
        cheapest = driver.execute_script("""
            return builder.scan.items.filter(it => it.kind === 'attention' || it.kind === 'mlp')
                .sort((a, b) => a.kl - b.kl).slice(0, arguments[0]).map(it => [it.kind, it.step]);""", args.skip)
        for kind, step in cheapest:
            before = driver.find_element("id", "builder-plan").get_attribute("value")
            driver.find_element("id", f"cell-{kind}-{step}").click()
            _wait(driver, lambda d: d.find_element("id", "builder-plan").get_attribute("value") != before, "the plan")
        plan = driver.find_element("id", "builder-plan").get_attribute("value")
        driver.save_screenshot(str(out / "playground-plan.png"))

        driver.find_element("id", "tab-chat").click()
        _fill(driver, "chat-max", "96")
        _chat(driver, CHAT[0])
        _fill(driver, "chat-plan", plan)  # the conversation goes on under the builder's plan
        _chat(driver, CHAT[1])
        driver.save_screenshot(str(out / "playground-chat.png"))

        driver.find_element("id", "tab-ab").click()
        _fill(driver, "ab-plan-b", plan)
        _fill(driver, "ab-max", "64")
        _fill(driver, "ab-input", AB_PROMPT)
        driver.find_element("id", "ab-send").click()
        _wait(driver, lambda d: d.find_element("id", "ab-agreement").text.startswith("agreement"), "the A/B")
        driver.save_screenshot(str(out / "playground-ab.png"))
        print(f"wrote {out}/playground-plan.png, playground-chat.png, playground-ab.png (plan {plan})", file=sys.stderr)

        if args.measure:
            driver.find_element("id", "tab-chat").click()
            _fill(driver, "chat-plan", "")
            _fill(driver, "chat-draft", "")
            _fill(driver, "chat-max", str(args.measure_tokens))
            page, api = [], []
            for _ in range(args.measure):
                driver.find_element("id", "chat-reset").click()
                page.append(_rate(_chat(driver, MEASURE_PROMPT, poll=1.0)))
                api.append(_api_rate(base, info["model"], args.measure_tokens))
            print(json.dumps({"model": info["model"], "plan": info["plan"], "draft": info["draft"],
                              "tokens": args.measure_tokens, "page_tokens_per_second": page,
                              "api_tokens_per_second": api, "page_median": statistics.median(page),
                              "api_median": statistics.median(api),
                              "ratio": statistics.median(page) / statistics.median(api)}))
    finally:
        if driver is not None:
            driver.quit()
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
