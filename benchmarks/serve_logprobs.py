"""What log-probabilities cost `layerplan serve`, and whether its scored prompts agree with `ppl`.

    python benchmarks/serve_logprobs.py MODEL.gguf [--rounds 5] [--tokens 64] [--text-tokens 300]

On the model at default settings (a GGUF as stored), served on 127.0.0.1 in this process:
- decode: a greedy chat reply of --tokens tokens without logprobs and with `logprobs: true,
  top_logprobs: 5`, alternated --rounds times; the server's own decode rate (usage), median (range);
- echo: a --text-tokens prompt of the built-in corpus, `max_tokens: 1` plainly and with `echo:
  true, logprobs: 1` (the prompt scored), wall time, alternated; the echoed perplexity against
  `layerplan ppl` on the same tokens (one window holding them all);
- lm_eval: lm-evaluation-harness's `local-completions` (remote tokenizer) scoring 20
  continuations of the corpus's sentences through the server, wall time.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from layerplan.app.serve import create_app
from layerplan.corpus import default_corpus
from layerplan.engine.load import load_model


def _median(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 3), "range": [round(min(values), 3), round(max(values), 3)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--text-tokens", type=int, default=300)
    args = parser.parse_args()
    model = load_model(args.model)
    app = create_app(model, served_name="m")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    client = httpx.Client(base_url=base, timeout=600)
    while True:
        try:
            if client.get("/health").status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.1)

    # decode with and without logprobs, alternated
    chat = {"messages": [{"role": "user", "content": "Explain in a paragraph how a hash map works."}],
            "max_tokens": args.tokens, "temperature": 0}
    rates: dict[str, list[float]] = {"plain": [], "logprobs": []}
    texts: dict[str, set[str]] = {"plain": set(), "logprobs": set()}
    for _ in range(args.rounds):
        for name, extra in (("plain", {}), ("logprobs", {"logprobs": True, "top_logprobs": 5})):
            answer = client.post("/v1/chat/completions", json={**chat, **extra}).json()
            rates[name].append(answer["usage"]["tokens_per_second"])
            texts[name].add(answer["choices"][0]["message"]["content"])
    decode_ratio = [b / a for a, b in zip(rates["plain"], rates["logprobs"])]

    # a prompt scored (echo) against its plain prefill, and against `layerplan ppl`
    ids = client.post("/tokenize", json={"prompt": default_corpus()}).json()["tokens"][:args.text_tokens]
    seconds: dict[str, list[float]] = {"prefill": [], "echo": []}
    echoed = None
    for _ in range(args.rounds):
        for name, extra in (("prefill", {}), ("echo", {"echo": True, "logprobs": 1})):
            start = time.perf_counter()
            answer = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 1, "temperature": 0, **extra})
            seconds[name].append(time.perf_counter() - start)
            if name == "echo":
                echoed = answer.json()["choices"][0]["logprobs"]["token_logprobs"][1:len(ids)]
    served_ppl = math.exp(-sum(echoed) / len(echoed))
    text = client.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "text.txt"
        path.write_text(text, encoding="utf-8")
        ppl = subprocess.run([sys.executable, "-m", "layerplan.app.launch", "ppl", "-m", args.model, "--text",
                              str(path), "--max-tokens", str(args.text_tokens), "--window", "512"],
                             capture_output=True, text=True, check=True)
    ppl_report = json.loads(ppl.stdout)

    # lm-evaluation-harness's own API client through the server
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    sentences = [s.strip() for s in default_corpus().split(".") if len(s.split()) > 8][:20]
    pairs = [(" ".join(s.split()[:-3]), " " + " ".join(s.split()[-3:])) for s in sentences]
    lm = LocalCompletionsAPI(base_url=f"{base}/v1/completions", model="m", tokenizer_backend="auto", max_length=4096)
    start = time.perf_counter()
    scored = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)])
    lm_eval_s = time.perf_counter() - start

    print(json.dumps({
        "model": args.model, "precision": model.precision,
        "decode_tokens_per_second": {name: _median(values) for name, values in rates.items()},
        "decode_with_logprobs_over_plain": _median(decode_ratio),
        "same_text_with_logprobs": texts["plain"] == texts["logprobs"] and len(texts["plain"]) == 1,
        "prompt_tokens": len(ids),
        "seconds": {name: _median(values) for name, values in seconds.items()},
        "echo_over_prefill": _median([b / a for a, b in zip(seconds["prefill"], seconds["echo"])]),
        "echoed_perplexity": served_ppl, "ppl_perplexity": ppl_report["perplexity"], "ppl_tokens": ppl_report["tokens"],
        "lm_eval_pairs": len(pairs), "lm_eval_seconds": round(lm_eval_s, 2),
        "lm_eval_greedy": sum(greedy for _, greedy in scored),
    }, indent=2))
    server.should_exit = True


if __name__ == "__main__":
    main()
