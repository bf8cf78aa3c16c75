"""Peers for `layerplan bench` beyond transformers: llama.cpp's own C++ tools.

llama.cpp is timed by its own programs, built once from source with `layerplan peers build`
(llamacpp.py), never through a Python binding: a Python round trip per token is not llama.cpp's speed.

- `llama-bench` reports llama.cpp's decoding rate (tg: N one-token steps), the cost of a pass over
  k tokens (pp k, one batch, as a verify pass), and a whole call (pg: the prompt's length in one
  pass, then N steps) that is timed the way every other bench row is: prefill included, per token.
  llama-bench runs its own warm-up and repetitions (-r); the bench calls it once a round, so its
  samples interleave with the other methods' like everyone else's.
- `llama-lookup` is llama.cpp's n-gram drafting (prompt lookup plus its n-gram caches), the
  counterpart of layerplan's ngram / suffix / auto drafters: its own reported speed on the same prompt.
- `llama-server` (llama_server) answers what llama.cpp itself computes: its greedy tokens for token
  ids (the fidelity benchmark and the real-file tests), its continuous batching (serve_batch.py).

Each runs on two files: the GGUF as the user has it (the packaged default is a Q4_1 file), and the
same weights at layerplan's precision: `gguf_at_precision` writes the dequantised weights back as an
F32 / BF16 / F16 GGUF (metadata and tokenizer copied), so llama.cpp then runs what layerplan runs.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from layerplan.app import llamacpp
from layerplan.app.bench_runs import PLAIN
from layerplan.files import atomic_file, cache_dir

# layerplan dtype -> (GGUF tensor type name, general.file_type value of llama.cpp's LLAMA_FTYPE)
GGUF_PRECISIONS = {"float32": ("F32", 0), "bfloat16": ("BF16", 32), "float16": ("F16", 1),
                   "q8_0": ("Q8_0", 7), "q4_0": ("Q4_0", 2)}  # (GGUF type, llama.cpp's file type)
SHORT_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
# layerplan drafters whose llama.cpp counterpart is llama-lookup (n-gram drafts from the context)
LOOKUP_COUNTERPARTS = ("ngram", "suffix", "auto")
PASS_LENGTH = 8  # llama-bench's pp test: the cost of one pass over this many tokens, in steps
TOOL_TIMEOUT_S = 900


class LlamaToolError(RuntimeError):
    """A llama.cpp tool failed or printed what we cannot read; the message is one line."""


def gguf_at_precision(source: Path, dtype: str, target: Path) -> Path:
    """Write `source`'s tensors dequantised to `dtype` (1-D tensors stay F32, as llama.cpp's
    converter writes them) with its metadata; atomic, and skipped when `target` exists."""
    if target.exists():
        return target
    import gguf

    type_name, file_type = GGUF_PRECISIONS[dtype]
    qtype = gguf.GGMLQuantizationType[type_name]
    reader = gguf.GGUFReader(source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    with atomic_file(target) as staging:
        writer = gguf.GGUFWriter(staging, arch)
        for item in reader.fields.values():
            if item.name == gguf.Keys.General.ARCHITECTURE or item.name.startswith("GGUF."):
                continue
            value = file_type if item.name == gguf.Keys.General.FILE_TYPE else item.contents()
            sub_type = item.types[-1] if item.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(item.name, value, item.types[0], sub_type=sub_type)
        for tensor in reader.tensors:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
            kind = qtype if values.ndim > 1 else gguf.GGMLQuantizationType.F32
            writer.add_tensor(tensor.name, gguf.quants.quantize(values, kind), raw_dtype=kind)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return target


def gguf_file_type(path: Path) -> str:
    """The file's precision as llama.cpp names it: 'Q4_1', 'BF16', 'F32', … ('?' when unreadable)."""
    import gguf

    try:
        item = gguf.GGUFReader(path).fields.get(gguf.Keys.General.FILE_TYPE)
        name = gguf.LlamaFileType(int(item.contents())).name if item is not None else "?"
    except (OSError, ValueError, KeyError):
        return "?"
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


# --- llama-bench -----------------------------------------------------------------------------------

@dataclass
class LlamaBenchRun:
    """One llama-bench invocation's tests (each a mean over its -r repetitions)."""
    tg_tokens_per_second: float  # decoding: N one-token steps
    n_gen: int
    pp_tokens_per_second: dict[int, float] = field(default_factory=dict)  # k -> a pass over k tokens, k/s
    pg_seconds: float | None = None  # prompt in one pass, then N steps: the whole call
    pg_prompt: int = 0
    model_type: str = ""
    build: str = ""
    depth: int = 0  # tokens in the context before the tests (-d), as llama-bench reports it

    def pass_steps(self, k: int) -> float | None:
        """A pass over k tokens in one-token steps (1.0: as cheap as one step)."""
        rate = self.pp_tokens_per_second.get(k)
        return (k / rate) * self.tg_tokens_per_second if rate else None


def parse_llama_bench_json(text: str) -> LlamaBenchRun:
    """llama-bench's `-o json` output: a list of tests with n_prompt, n_gen, avg_ns, avg_ts."""
    start = text.find("[")
    try:
        tests = json.loads(text[start:]) if start >= 0 else None
    except json.JSONDecodeError as error:
        raise LlamaToolError(f"llama-bench printed JSON that does not parse ({error.msg})") from None
    if not isinstance(tests, list) or not all(isinstance(t, dict) for t in tests):
        raise LlamaToolError("llama-bench printed no JSON list of tests")
    tg = pg = None
    pp: dict[int, float] = {}
    for test in tests:
        try:
            n_prompt, n_gen, avg_ns, avg_ts = int(test["n_prompt"]), int(test["n_gen"]), test["avg_ns"], test["avg_ts"]
        except (KeyError, TypeError, ValueError):
            raise LlamaToolError("llama-bench's JSON lacks n_prompt / n_gen / avg_ns / avg_ts") from None
        if n_prompt == 0 and n_gen > 0:
            tg = (float(avg_ts), n_gen, test)
        elif n_gen == 0 and n_prompt > 0:
            pp[n_prompt] = float(avg_ts)
        elif n_prompt > 0 and n_gen > 0:
            pg = (float(avg_ns) / 1e9, n_prompt)
    if tg is None:
        raise LlamaToolError("llama-bench's JSON has no text-generation (tg) test")
    rate, n_gen, first = tg
    build = f"build {first.get('build_number', '?')} ({first.get('build_commit', '?')})"
    return LlamaBenchRun(rate, n_gen, pp, pg[0] if pg else None, pg[1] if pg else 0,
                         str(first.get("model_type", "")), build, int(first.get("n_depth") or 0))


def _run_tool(command: list[str], what: str, stdout_only: bool = False) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, errors="replace", timeout=TOOL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise LlamaToolError(f"{what} ran past {TOOL_TIMEOUT_S} s: {' '.join(command)}") from None
    except OSError as error:
        raise LlamaToolError(f"cannot run {command[0]}: {error.strerror or error}") from None
    if done.returncode != 0:
        lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
        reason = next((line for line in reversed(lines) if "error" in line.lower()), lines[-1] if lines else "no message")
        raise LlamaToolError(f"{what} failed (exit {done.returncode}): {reason}")
    return done.stdout if stdout_only else done.stdout + done.stderr


def llama_bench(tool: Path, gguf: Path, threads: int, new_tokens: int, prompt_tokens: int = 0,
                pass_length: int = PASS_LENGTH, repetitions: int = 1, depth: int = 0) -> LlamaBenchRun:
    """tg `new_tokens`, pp `pass_length`, and (with prompt_tokens) pg prompt_tokens,new_tokens;
    depth: the tests run after that many tokens in the context (llama-bench's -d)."""
    command = [str(tool), "-m", str(gguf), "-t", str(threads), "-n", str(new_tokens), "-p", str(pass_length),
               "-r", str(repetitions), "-o", "json"]
    if prompt_tokens:
        command += ["-pg", f"{prompt_tokens},{new_tokens}"]
    if depth:
        command += ["-d", str(depth)]
    return parse_llama_bench_json(_run_tool(command, f"llama-bench on {gguf.name}", stdout_only=True))


def llama_bench_runner(tool: Path, gguf: Path, threads: int, pass_length: int = PASS_LENGTH):
    """A bench Runner: one llama-bench call (its own warm-up, -r 1) a round. Seconds are the pg
    test's (the prompt's length in one pass, then the new tokens), as every row is timed; the
    stats carry llama-bench's decoding rate (tg) and the pass cost (pp)."""

    def run(ids: list[int], new_tokens: int):
        result = llama_bench(tool, gguf, threads, new_tokens, len(ids), pass_length)
        seconds = result.pg_seconds if result.pg_seconds is not None else result.n_gen / result.tg_tokens_per_second
        steps = result.pass_steps(pass_length)
        return seconds, result.n_gen, {"decode_tokens_per_second": result.tg_tokens_per_second,
                                       "pass_steps": {str(pass_length): steps} if steps else {},
                                       "peer_build": result.build}

    return run


# --- llama-lookup ----------------------------------------------------------------------------------

@dataclass
class LookupRun:
    prompt_tokens: int
    prompt_seconds: float
    tokens: int
    decode_seconds: float
    decode_tokens_per_second: float  # as llama-lookup reports it
    drafted: int | None = None
    accepted: int | None = None
    draft_max: int | None = None

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


_NUMBER = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|nan|inf)"


def parse_lookup_output(text: str) -> LookupRun:
    """llama-lookup's summary (stderr, each line after a log time stamp such as '0.17.294.656 I '):
    'encoded N tokens in S seconds, speed: R t/s', 'decoded …', then n_draft, n_drafted, n_accept."""
    def timing(kind: str):
        match = re.search(rf"{kind}\s+(\d+)\s+tokens in\s+{_NUMBER}\s+seconds, speed:\s+{_NUMBER}\s+t/s", text)
        return (int(match.group(1)), float(match.group(2)), float(match.group(3))) if match else None

    def count(name: str) -> int | None:
        match = re.search(rf"\b{name}\s*=\s*(\d+)\s*$", text, re.MULTILINE)  # after the log's time stamp
        return int(match.group(1)) if match else None

    encoded, decoded = timing("encoded"), timing("decoded")
    if encoded is None or decoded is None:
        raise LlamaToolError("llama-lookup printed no 'encoded/decoded N tokens in S seconds' summary")
    return LookupRun(encoded[0], encoded[1], decoded[0], decoded[1], decoded[2],
                     count("n_drafted"), count("n_accept"), count("n_draft"))


def llama_lookup(tool: Path, gguf: Path, threads: int, prompt: str, new_tokens: int, draft_max: int) -> LookupRun:
    """Greedy n-gram-drafted generation of `prompt` (a file, so any text goes through unchanged)."""
    fd, prompt_file = tempfile.mkstemp(prefix="layerplan-prompt-", suffix=".txt")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(prompt)
        command = [str(tool), "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-f", prompt_file,
                   "-n", str(new_tokens), "--temp", "0", "--spec-draft-n-max", str(draft_max), "-c", "2048"]
        return parse_lookup_output(_run_tool(command, f"llama-lookup on {gguf.name}"))
    finally:
        os.unlink(prompt_file)


def llama_lookup_runner(tool: Path, gguf: Path, threads: int, prompt_text, draft_max: int = 8):
    """A bench Runner: llama-lookup's own timing of the prompt (prefill + decoding) per token.
    prompt_text(ids) gives the text whose tokens are `ids` (chat template applied)."""

    def run(ids: list[int], new_tokens: int):
        result = llama_lookup(tool, gguf, threads, prompt_text(ids), new_tokens, draft_max)
        return (result.prompt_seconds + result.decode_seconds, result.tokens,
                {"decode_tokens_per_second": result.decode_tokens_per_second,
                 "acceptance_rate": result.acceptance_rate})

    return run


def llama_cpp_peers(source: str, dtype: str | None, threads: int, decode: Callable[[list[int]], str], drafts,
                    draft_max: int, on_note: Callable[[str], None] = lambda _: None) -> tuple[dict, dict]:
    """llama.cpp's own tools on the model's GGUF `source` as stored and rewritten at layerplan's
    `dtype` (None: layerplan runs the file as stored, the same precision), on `threads` threads:
    ({method: runner}, {peer method: the layerplan methods it is compared with}); ({}, {}) with a
    one-line note saying why not. decode(ids): the text whose tokens are ids, chat template and
    special tokens kept (llama-lookup reads a prompt as text). on_note: what is left out, and a
    file written for the tools."""
    if not source.endswith(".gguf"):
        on_note("llama.cpp rows left out: they need the model as a GGUF file (--model FILE.gguf)")
        return {}, {}
    bin_dir = llamacpp.find_tools()
    if bin_dir is None:
        on_note(llamacpp.missing_message())
        return {}, {}
    path = Path(source)
    stored = gguf_file_type(path)
    files = {f"{stored} file": path}
    if dtype is None:
        pass
    elif dtype not in GGUF_PRECISIONS:
        on_note(f"llama.cpp rows at layerplan's precision left out: no {dtype} GGUF is written here")
    elif GGUF_PRECISIONS[dtype][0] != stored:
        target = cache_dir() / "gguf" / f"{path.stem}-{dtype}.gguf"
        if not target.exists():
            on_note(f"writing {target.name} for llama.cpp (once)…")
        files[SHORT_DTYPES[dtype]] = gguf_at_precision(path, dtype, target)
    runners, pairs = {}, {}
    for label, file in files.items():
        name = f"llama.cpp llama-bench ({label})"
        runners[name], pairs[name] = llama_bench_runner(bin_dir / "llama-bench", file, threads), [PLAIN]
    counterparts = [f"layerplan draft={d}" for d in drafts if d.split(":")[0].split("+")[0] in LOOKUP_COUNTERPARTS]
    if counterparts:
        for label, file in files.items():
            name = f"llama.cpp llama-lookup ({label})"
            runners[name] = llama_lookup_runner(bin_dir / "llama-lookup", file, threads, decode, draft_max)
            pairs[name] = counterparts
    return runners, pairs


def free_port() -> int:
    """A TCP port of 127.0.0.1 free now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def llama_server_call(base: str, route: str, body: dict | None = None, timeout: float = 300) -> dict:
    """A JSON request to a llama-server (GET without a body, POST with one), its JSON answer."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(base + route, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return json.loads(reply.read())


@contextmanager
def llama_server(tools: Path, gguf: Path | str, threads: int, context: int = 1024, parallel: int = 1,
                 wait_s: float = 300) -> Iterator[str]:
    """llama.cpp's own server on `gguf` at 127.0.0.1 (tools: the folder with llama-server; a free
    port), once it answers /health: its base URL. Stopped on leaving; a server that exits or does
    not answer within wait_s is a LlamaToolError."""
    port = free_port()
    process = subprocess.Popen([str(tools / "llama-server"), "-m", str(gguf), "-t", str(threads), "--host", "127.0.0.1",
                                "--port", str(port), "--parallel", str(parallel), "-c", str(context)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                llama_server_call(base, "/health", timeout=5)
                break
            except (urllib.error.URLError, OSError, ValueError):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise LlamaToolError(f"llama-server on {gguf} did not come up "
                                         f"({'exited ' + str(process.returncode) if process.poll() is not None else f'no answer in {wait_s:.0f} s'})")
                time.sleep(0.3)
        yield base
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def llama_server_greedy(base: str, ids: Sequence[int], count: int) -> list[int]:
    """llama.cpp's greedy continuation of the token ids `ids`: `count` tokens, EOS or not."""
    return llama_server_call(base, "/completion", {
        "prompt": list(ids), "n_predict": count, "temperature": 0, "top_k": 1, "cache_prompt": True,
        "return_tokens": True, "ignore_eos": True, "samplers": ["top_k"]})["tokens"]
