"""The work of the commands that run a model: generate, chat, serve, eval, export (their command
lines: app/cli/generating.py, chatting.py, serving.py, exporting.py)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import click
import torch

from layerplan.app.cli.common import attach, checked_probe_row, freeze, load, set_threads, user_errors
from layerplan.app.prompts import PromptUsageError, one_prompt, read_prompt_file
from layerplan.decoding.budget import token_budget
from layerplan.decoding.drafters.registry import drafts_by_lookup, make_drafter
from layerplan.decoding.generate import generate as run_generate
from layerplan.decoding.output import prompt_ids
from layerplan.decoding.sampling_params import SamplingParams
from layerplan.decoding.scheduler import generate_batch
from layerplan.decoding.text import prompt_notes
from layerplan.engine.choices import STORED
from layerplan.export import export_checkpoint, export_gguf
from layerplan.export_formats import export_format_of
from layerplan.files import check_output, write_json_atomic, write_text_atomic
from layerplan.machine import read_cpuinfo
from layerplan.models.depth import model_depth
from layerplan.models.loading import gguf_of
from layerplan.plan.formats import load_plan, to_mergekit
from layerplan.search.probes import task_manager


def run_generate_command(prompt, prompt_option, prompt_path, model, dtype, device, engine, threads, max_new_tokens,
                         ctx_size, temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty,
                         frequency_penalty, seed, logit_bias, plan, model_b, stop, chat, stream, draft, draft_length,
                         draft_model, draft_confidence, exit_policy, stats, verbose, as_json, prompt_file,
                         max_batch) -> None:
    """`layerplan generate` (app/cli/generating.py reads its command line), carried out."""
    set_threads(threads)
    with user_errors():
        # refused before the model loads
        params = SamplingParams(temperature, top_k, top_p, repetition_penalty, min_p, tuple(logit_bias),
                                presence_penalty, frequency_penalty)
        try:
            prompt = one_prompt(prompt, prompt_option, prompt_path)
        except PromptUsageError as error:
            raise click.UsageError(str(error)) from None
        if draft_model:
            if draft:
                raise ValueError("give either --draft or -md/--model-draft, not both")
            draft = f"model:{draft_model}"
        if (prompt is None) == (prompt_file is None):
            raise click.UsageError("give a PROMPT (or -p TEXT, -f FILE) or --prompt-file FILE (one of them)")
        if prompt_file is not None:
            if exit_policy or model_b:
                raise ValueError("--prompt-file decodes plainly or with a lookup draft; --exit-policy and "
                                 "--model-b run one prompt at a time")
            prompts, chat_names = read_prompt_file(prompt_file)
            loaded = load(model, dtype, device, engine, ctx_size=ctx_size)
            params.check_vocabulary(loaded.hf.config.vocab_size)
            for record in generate_prompt_file(loaded, loaded.plan(plan), prompts,
                                               chat_names | (set(prompts) if chat else set()), max_new_tokens,
                                               params, seed, stop, draft, draft_length, max_batch):
                click.echo(json.dumps(record))
            return
        loaded = load(model, dtype, device, engine, ctx_size=ctx_size)
        loaded = attach(loaded, model_b, device, engine)
        params.check_vocabulary(loaded.hf.config.vocab_size)
        layer_plan = loaded.plan(plan)
        ids = prompt_ids(loaded, prompt, chat)  # the server's context check, before any decoding
        max_new_tokens = token_budget(ids.shape[1], max_new_tokens, loaded.context_length,
                                      new_tokens_name="--max-new-tokens")
        on_text = (lambda piece: click.echo(piece, nl=False)) if stream else None
        result = run_generate(loaded, ids, layer_plan, max_new_tokens, params, seed, stop,
                              chat=chat, on_text=on_text, draft=draft, draft_length=draft_length,
                              draft_confidence=draft_confidence, exit_policy=exit_policy,
                              probe_row=checked_probe_row(loaded))
    click.echo("" if stream else result.text)
    for line in prompt_notes(result, chat, bool(getattr(loaded.tokenizer, "chat_template", None)), max_new_tokens):
        click.echo(line, err=True)
    if stats or verbose:
        cpu = read_cpuinfo()[0] or "unknown CPU"
        for line in result.summary_lines(loaded.precision, torch.get_num_threads(), cpu):
            click.echo(line, err=True)
    if as_json:
        summary = {k: v for k, v in result.to_dict().items() if k not in ("text", "token_ids")}
        click.echo(json.dumps(summary, indent=2), err=True)


def generate_prompt_file(loaded, plan, prompts: dict[str, str], chat: set[str], max_new_tokens: int, params, seed,
                         stop, draft, draft_length, max_batch: int) -> list[dict]:
    """generate --prompt-file: every prompt through generate_batch, a record each (its name, text,
    tokens, stop reason, rate) in the file's order; prompt i samples with seed + i."""
    if draft is not None and not drafts_by_lookup(make_drafter(draft, loaded, plan)):
        raise ValueError(f"--prompt-file drafts with a lookup drafter (ngram, suffix), each prompt its own; "
                         f"'{draft}' runs a model: give the prompts one at a time")
    ids = {name: prompt_ids(loaded, text, name in chat)[0].tolist() for name, text in prompts.items()}
    budgets = [token_budget(len(tokens), max_new_tokens, loaded.context_length, new_tokens_name="--max-new-tokens")
               for tokens in ids.values()]  # every prompt's context check before any decoding
    seeds = [seed + i if seed is not None else None for i in range(len(ids))]
    results = generate_batch(loaded, list(ids.values()), plan, budgets, params, seeds, stop,
                             max_batch=max_batch, draft=draft, draft_length=draft_length)
    return [{"name": name, "text": result.text, "tokens": len(result.token_ids), "stop_reason": result.stop_reason,
             "tokens_per_second": round(result.tokens_per_second, 2)} for name, result in zip(ids, results)]


def run_export_command(plan, model, dtype, out, fmt, source, model_b) -> None:
    """`layerplan export`'s work (its command line: exporting.py)."""
    with user_errors():
        fmt = fmt or export_format_of(out)
        check_output(out, "checkpoint" if fmt == "checkpoint" else "file")  # before any work
        if fmt == "gguf":
            if model_b:  # (before the load: seconds for a 7B, to say no)
                raise click.UsageError("--to gguf writes one model's layers; a plan over two models exports "
                                       "--to checkpoint")
            # (the file's blocks are copied, never run: its panels are not packed for the kernels)
            loaded = load(model, STORED if gguf_of(model) is not None else dtype, engine="eager")
            path = export_gguf(loaded, loaded.plan(plan), out)
            click.echo(f"wrote {path} ({len(loaded.plan(plan).active_steps)} layers, the source's stored types)")
            return
        if fmt == "mergekit":
            depth, name = model_depth(model)
            text = to_mergekit(load_plan(plan, depth, name), source or model, dtype,
                               {"b": model_b} if model_b else None)
            write_text_atomic(out, text)
        else:
            loaded = attach(load(model, dtype), model_b)
            folder = export_checkpoint(loaded, loaded.plan(plan), out)
            click.echo(f"wrote {folder} ({len(loaded.plan(plan).active_steps)} layers)")
            return
    click.echo(f"wrote {out}")


def run_eval_command(tasks, model, dtype, device, engine, threads, plan, draft, include_path, limit, num_fewshot,
                     out) -> None:
    """`layerplan eval`'s work (its command line: serving.py)."""
    set_threads(threads)
    with user_errors():
        try:
            import lm_eval
            from lm_eval.utils import make_table
        except ImportError:
            raise ValueError("lm-evaluation-harness is not installed: pip install 'layerplan[eval]'") from None
        from layerplan.app.integrations.harness import LayerplanLM

        names = [t.strip() for t in tasks.split(",") if t.strip()]
        manager = task_manager(names, include_path)  # unknown tasks are refused before the model loads
        lm = LayerplanLM(pretrained=load(model, dtype, device, engine, dense="float32"), plan=plan, draft=draft)
        result = lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=manager, limit=limit,
                                         num_fewshot=num_fewshot)
    click.echo(make_table(result))
    summary = {"model": model, "plan": lm.plan.to_string(), "results": result["results"],
               "config": {k: v for k, v in result.get("config", {}).items() if isinstance(v, (str, int, float, type(None)))}}
    write_json_atomic(out, summary)
    click.echo(f"wrote {out}")


def run_serve_command(model, dtype, device, engine, threads, plan, model_b, draft, draft_length, host, port, api_key,
                      served_name, ctx_size, max_batch) -> None:
    """`layerplan serve`'s work (its command line: serving.py)."""
    # deferred: the web stack is heavy
    from layerplan.app.serve import DEFAULT_MAX_BATCH, ListenError, serve as run_server

    set_threads(threads)
    with user_errors():  # a bad plan or draft fails here, before the server starts
        loaded = attach(load(model, dtype, device, engine, ctx_size=ctx_size), model_b, device, engine)
        probe_row = checked_probe_row(loaded)
        batch_source = "--parallel"
        if max_batch is None:  # the fewest requests a pass carries near its best rate here
            max_batch = probe_row.fullest_pass() if probe_row is not None else DEFAULT_MAX_BATCH
            batch_source = "this machine's probe" if probe_row is not None else "no probe cached"

        def listening(bound_host: str, bound_port: int, at_once: int) -> None:
            freeze()  # bound and serving: this process is the server now, however it was started
            batch = (f"up to {at_once} requests at once, {batch_source}" if at_once > 1 or max_batch == 1
                     else "one request at a time: its draft runs a model")
            click.echo(f"serving '{served_name or loaded.name}' on http://{bound_host}:{bound_port}/v1 "
                       f"(draft: {draft or 'none'}; {batch}), the playground on http://{bound_host}:{bound_port}/; "
                       "Ctrl-C stops", err=True)
            if not getattr(loaded.tokenizer, "chat_template", None):  # (decoding/output.py chat_prompt_ids)
                click.echo("(this model has no chat template: /v1/chat/completions sends a conversation as 'role: "
                           "content' lines, which a base model continues rather than answers, each answer ending "
                           "where it starts a 'user:' line; /v1/completions takes text as it is)", err=True)

        try:
            run_server(loaded, host, port, on_listening=listening, plan=loaded.plan(plan) if plan else None,
                       draft=draft, draft_length=draft_length, api_key=api_key, served_name=served_name,
                       probe_row=probe_row, max_batch=max_batch)
        except ListenError as error:
            raise click.ClickException(str(error)) from None


def run_chat_command(model, dtype, device, engine, threads, model_b, ctx_size, load_file, **settings) -> None:
    """`layerplan chat` on the torch front end (app/cli/chatting.py reads its command line; `settings`:
    the conversation's options), carried out; or the light front end's conversation, handed on
    (chatting.py hand_off) with its line."""
    from layerplan.app.chat import ChatSession
    from layerplan.app.chat_loop import run_chat
    from layerplan.app.cli.chatting import command_line_settings, handed_off
    from layerplan.decoding.chat_state import Totals, open_chat

    set_threads(threads)
    given, named = command_line_settings(click.get_current_context())
    handoff = handed_off(load_file)
    with user_errors():
        try:
            opening = open_chat(given, named, load_file)
        finally:
            if handoff is not None:
                _take_handed_off(handoff)
        loaded = attach(load(model, dtype, device, engine, ctx_size=ctx_size), model_b, device, engine)
        note = opening.model_note(loaded.name) if handoff is None else None
        if note:
            click.echo(note, err=True)
        opening.settings.sampling().check_vocabulary(loaded.hf.config.vocab_size)
        session = ChatSession(loaded, opening.settings, opening.messages, probe_row=checked_probe_row(loaded))
    if handoff is not None:  # (the light front end's counts go on)
        session.session = Totals(**handoff["totals"])
    return run_chat(session, guard=user_errors, first_lines=[handoff["line"]] if handoff is not None else ())


def _take_handed_off(handoff: dict) -> None:
    """A hand-off's line history into this process's (at a terminal), and its private folder removed."""
    history = handoff.get("history")
    if history and sys.stdin.isatty():
        try:
            import readline

            readline.read_history_file(history)
        except (ImportError, OSError):
            pass
    shutil.rmtree(Path(handoff["file"]).parent, ignore_errors=True)

