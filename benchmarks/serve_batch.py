"""Continuous batching against one client and against llama.cpp's own server, in one run: the
aggregate tokens/s of C concurrent clients to `layerplan serve` on 127.0.0.1, its ratio to one
client, the median time per token of the requests, whether every reply equals its solo run, and
the same clients against `llama-server --parallel N` (continuous batching, the same GGUF file and
threads; `layerplan peers build` once).

    python benchmarks/serve_batch.py [--model smollm2] [--dtype stored-fast] [--clients 1,4,8] [--tokens 64]
                                     [--requests 24] [--draft suffix] [--first-token]

--first-token streams layerplan's replies and reports each round's median and longest time to a
request's first text, and the longest against first-come-first-served's bound: the prefills of
the request and of the C - 1 others ahead of it at most (each at most one client's longest wait)
and the pass under way when it came.
Prints one JSON object. Greedy decoding; the requests ask for --tokens tokens and stop at EOS.
Every round sends the same --requests requests (the prompts in turn); its C clients are a closed
loop, each sending its next request when its last reply came, so the batch holds C requests
until the last ones; one client sends them one after another (the baseline rate).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch

from layerplan.app.peers import free_port, llama_server
from layerplan.decoding.generate import generate
from layerplan.decoding.sampling_params import SamplingParams
from layerplan.engine.load import load_model
from layerplan.machine import read_cpuinfo
from layerplan.models.loading import gguf_of

PROMPTS = ["Write a short poem about the sea.", "def quicksort(items):", "The three laws of motion are",
           "Explain what a compiler does.", "List five European capitals:", "Once upon a time, in a small village,",
           "The recipe for pancakes needs", "In 1969, the first person to walk on the moon"]


def _wait(url: str, seconds: float = 120) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} did not answer within {seconds} s")


def _round(base: str, model: str, clients: int, tokens: int, extra: dict, prompts: list[str],
           stream: bool = False) -> dict:
    """C clients at once, closed loop: each sends its next request as soon as its last reply came,
    taking them in order from `prompts` until none is left (so a batch stays full but at the very
    end, as a busy server's does). Every round sends the same requests. Wall, tokens, each
    request's seconds per token, texts (in prompts' order); streamed (server-sent events), also
    each request's time to its first text."""
    texts: list[str | None] = [None] * len(prompts)
    done_tokens, per_token, first = [0] * len(prompts), [0.0] * len(prompts), [0.0] * len(prompts)
    next_index, lock = [0], threading.Lock()

    def client(session: httpx.Client) -> None:
        while True:
            with lock:
                index = next_index[0]
                next_index[0] += 1
            if index >= len(prompts):
                return
            start = time.perf_counter()
            body = {"model": model, "prompt": prompts[index], "max_tokens": tokens, "temperature": 0, **extra}
            if stream:
                first[index], texts[index], done_tokens[index] = _streamed(session, body, start)
            else:
                reply = session.post("/v1/completions", json=body).json()
                done_tokens[index] = reply["usage"]["completion_tokens"]
                texts[index] = reply["choices"][0]["text"]
            seconds = time.perf_counter() - start
            per_token[index] = seconds / max(done_tokens[index], 1)

    # the clients made before the clock starts: making one (its SSL context, ~60 ms of a core
    # holding the GIL) while other clients' requests run delayed their replies' reading by up to
    # 0.2 s and took ~10% off a short round's rate
    sessions = [httpx.Client(base_url=base, timeout=600) for _ in range(clients)]
    try:
        start = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            for future in [pool.submit(client, session) for session in sessions]:
                future.result()
        wall = time.perf_counter() - start
    finally:
        for session in sessions:
            session.close()
    total = sum(done_tokens)
    row = {"clients": clients, "requests": len(prompts), "wall_seconds": wall, "tokens": total,
           "tokens_per_second": total / wall, "median_seconds_per_token": statistics.median(per_token),
           "texts": texts}
    if stream:
        waits = [seconds for seconds, text in zip(first, texts) if text] or [0.0]  # a reply without text has none
        row["first_token_seconds"] = {"median": statistics.median(waits), "longest": max(waits)}
    return row


def _streamed(session: httpx.Client, body: dict, start: float) -> tuple[float, str, int]:
    """One streamed completion: (seconds from `start` to its first text, its text, its tokens)."""
    first, text, tokens = 0.0, "", 0
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with session.stream("POST", "/v1/completions", json=body) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            piece = event["choices"][0].get("text", "") if event.get("choices") else ""
            if piece and not text:
                first = time.perf_counter() - start
            text += piece
    return first, text, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="stored-fast")
    parser.add_argument("--clients", default="1,4,8")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=24,
                        help="requests each round sends (the prompts in turn), whatever its clients")
    parser.add_argument("--draft", default=None, help="serve with this (lookup) drafter: ngram or suffix")
    parser.add_argument("--no-llama-server", action="store_true")
    parser.add_argument("--first-token", action="store_true",
                        help="stream layerplan's replies and time each request's first text (starvation)")
    args = parser.parse_args()
    counts = [int(c) for c in args.clients.split(",")]
    threads = torch.get_num_threads()
    model = load_model(args.model, dtype=args.dtype)
    # every round sends the same requests, the prompts in turn: one client sends them one after
    # another (no concurrency), C clients C at a time
    every = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    solo = {p: generate(model, model.tokenizer(p).input_ids, max_new_tokens=args.tokens,
                        sampling=SamplingParams()).text for p in set(every)}
    # `layerplan serve` as a user runs it: a process of its own, decoding on its main thread
    port = free_port()
    process = subprocess.Popen(["layerplan", "serve", "--model", args.model, "--dtype", args.dtype, "--threads",
                                str(threads), "--port", str(port), "--max-batch", str(max(counts)),
                                *(["--draft", args.draft] if args.draft else [])],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        _wait(f"{base}/health", 300)
        _round(base, model.name, 1, 8, {}, PROMPTS[:1])  # warm-up
        ours = [_round(base, model.name, c, args.tokens, {}, every, stream=args.first_token) for c in counts]
    finally:
        process.terminate()
        process.wait(timeout=30)
    for row in ours:
        row["equal_to_solo"] = f"{sum(text == solo[p] for text, p in zip(row.pop('texts'), every))}/{row['requests']}"
    one = next((r for r in ours if r["clients"] == 1), None)
    for row in ours:
        if one is not None:
            row["vs_one_client"] = row["tokens_per_second"] / one["tokens_per_second"]
            row["time_per_token_vs_solo"] = row["median_seconds_per_token"] / one["median_seconds_per_token"]
            if args.first_token:
                # first come, first served: no request waits longer than its own prompt's prefill
                # and those of the requests ahead of it (at most the C - 1 others; each at most one
                # client's longest wait, the longest prompt's pass alone) and the pass under way
                # when it came (a pass at this load: the median time per token)
                bound = row["clients"] * one["first_token_seconds"]["longest"] + row["median_seconds_per_token"]
                row["longest_first_token_vs_fcfs_bound"] = row["first_token_seconds"]["longest"] / bound
    theirs = []
    gguf = gguf_of(args.model)
    if not args.no_llama_server and gguf is not None:
        from layerplan.app.llamacpp import find_tools

        tools = find_tools(("llama-server",))
        if tools is not None:
            parallel = max(counts)
            with llama_server(tools, gguf, threads, context=parallel * 1024, parallel=parallel) as base:
                _round(base, "x", 1, 8, {}, PROMPTS[:1])
                theirs = [_round(base, "x", c, args.tokens, {}, every) for c in counts]
                for row in theirs:
                    row.pop("texts")
    for ours_row, theirs_row in zip(ours, theirs):
        ours_row["vs_llama_server"] = ours_row["tokens_per_second"] / theirs_row["tokens_per_second"]
    print(json.dumps({"model": args.model, "dtype": args.dtype, "draft": args.draft, "cpu": read_cpuinfo()[0], "threads": threads,
                      "tokens": args.tokens, "layerplan": ours, "llama-server": theirs,
                      "load_average": os.getloadavg()[0]}, indent=2))


if __name__ == "__main__":
    main()
