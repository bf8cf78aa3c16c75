"""What the HTTP server costs: concurrent clients against the same generations called directly.

    python benchmarks/serve_load.py [--dtype bfloat16] [--draft ngram] [--clients 4] [--requests 3] [--tokens 48]

Runs the built-in prompts through `generate` in-process (the peer), then sends the same requests
from --clients concurrent httpx clients to `layerplan serve`'s app on 127.0.0.1, and prints
wall time, tokens/s and their ratio, the queue waits, and whether every answer equals the
direct one.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import uvicorn

from layerplan.app.prompts import PROMPTS
from layerplan.app.serve import create_app
from layerplan.decoding.generate import generate
from layerplan.decoding.sampling_params import SamplingParams
from layerplan.engine.load import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--draft", default="ngram")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--requests", type=int, default=3, help="per client")
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    model = load_model("smollm2", dtype=args.dtype)
    prompts = list(PROMPTS.values())
    jobs = [prompts[(c + r) % len(prompts)] for c in range(args.clients) for r in range(args.requests)]

    start = time.perf_counter()
    direct = {}
    tokens = 0  # the same greedy tokens are decoded both ways; a fixed draft length keeps bf16 rounding equal
    for prompt in jobs:
        result = generate(model, model.tokenizer(prompt).input_ids, max_new_tokens=args.tokens,
                          sampling=SamplingParams(), draft=args.draft, draft_length="fixed")
        direct[prompt] = result.text
        tokens += len(result.token_ids)
    direct_s = time.perf_counter() - start

    # as `layerplan serve` does it: HTTP on a background thread, decoding on this (the main) thread
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    app = create_app(model, draft=args.draft, draft_length="fixed", decode_thread=False)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    while True:
        try:
            httpx.get(f"{base}/health")
            break
        except httpx.TransportError:
            time.sleep(0.05)

    def client(index: int) -> list[tuple[str, str, float]]:
        answers = []
        with httpx.Client(base_url=base, timeout=600) as http:
            for r in range(args.requests):
                prompt = prompts[(index + r) % len(prompts)]
                sent = time.perf_counter()
                body = http.post("/v1/completions", json={"model": model.name, "prompt": prompt, "temperature": 0,
                                                          "max_tokens": args.tokens}).json()
                latency = time.perf_counter() - sent
                answers.append((prompt, body["choices"][0]["text"], latency - body["usage"]["decode_seconds"],
                                body["usage"]["decode_seconds"]))
        return answers

    def all_clients() -> list:
        with ThreadPoolExecutor(args.clients) as pool:
            found = [a for batch in pool.map(client, range(args.clients)) for a in batch]
        app.state.scheduler.close()
        return found

    start = time.perf_counter()
    with ThreadPoolExecutor(1) as outside:
        pending = outside.submit(all_clients)
        app.state.scheduler.run()  # returns once the clients are done
        answers = pending.result()
    served_s = time.perf_counter() - start
    server.should_exit = True

    same = all(direct[prompt] == text for prompt, text, _, _ in answers)
    waits = [wait for _, _, wait, _ in answers]
    decoding = sum(seconds for *_, seconds in answers)
    print(f"{model.name}, {args.dtype}, draft {args.draft}: {len(jobs)} requests of up to {args.tokens} tokens, "
          f"{args.clients} concurrent clients")
    print(f"direct generate: {direct_s:.1f}s ({tokens / direct_s:.1f} tok/s); server: {served_s:.1f}s "
          f"({tokens / served_s:.1f} tok/s) -> {direct_s / served_s:.2f}x of direct")
    print(f"decoding inside the server: {decoding:.1f}s in all")
    print(f"time outside decoding per request (queue + HTTP): median {statistics.median(waits):.2f}s, "
          f"max {max(waits):.2f}s; every answer equals the direct one: {same}")


if __name__ == "__main__":
    main()
