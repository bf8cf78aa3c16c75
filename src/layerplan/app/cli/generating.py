"""`layerplan generate`'s command line: its options and what they take, defined without torch, so
that app/launch.py reads a command line with the command itself before it chooses a front end
(light_request: the light one where it carries the line out as this one does). Running it
imports the rest (app/cli/running.py run_generate_command)."""

from __future__ import annotations

import importlib
from pathlib import Path

import click

from layerplan.app.options import (DRAFT_LENGTH_HELP, ctx_size_option, decoding_model_options, light_context,
                                   light_runs_draft, logit_bias_option, model_b_option, n_predict_option,
                                   output_penalty_options, sampling_options)
from layerplan.corpus import read_text_file
from layerplan.decoding.draft_length import DRAFT_LENGTHS
from layerplan.decoding.drafters.kinds import drafter_help
from layerplan.decoding.sampling_params import SamplingError
from layerplan.lite.request import LiteRequest

# the options the light front end carries out no differently for any value the command takes:
# whatever else a line gives must be the option's default (greedy sampling, no draft, ...)
_CARRIED = {"prompt", "prompt_option", "prompt_path", "model", "model_b", "dtype", "engine", "device", "threads",
            "max_new_tokens", "plan", "stop", "chat", "stream", "stats", "verbose", "as_json", "temperature",
            "top_k", "top_p", "min_p", "seed", "max_batch", "repetition_penalty", "presence_penalty",
            "frequency_penalty", "logit_bias", "draft", "draft_length", "draft_confidence", "draft_model"}


@click.command()
@click.argument("prompt", required=False)
@click.option("--prompt", "-p", "prompt_option", default=None, metavar="TEXT",
              help="the prompt (as the first argument; llama.cpp's -p)")
@click.option("--file", "-f", "prompt_path", type=click.Path(dir_okay=False), default=None,
              help="read the prompt from this file (its whole text; llama.cpp's -f)")
@decoding_model_options
@n_predict_option(128, low=0, help="at most this many new tokens (prompt and new tokens fit the context)",
                  until_context=True)
@ctx_size_option
@sampling_options
@output_penalty_options
@logit_bias_option
@click.option("--plan", default=None, help="run the model by this plan (lossy unless it is the full model)")
@model_b_option
@click.option("--stop", multiple=True, help="stop string (repeatable)")
@click.option("--chat/--no-chat", default=False, help="wrap the prompt in the model's chat template")
@click.option("--stream/--no-stream", default=True, show_default=True)
@click.option("--draft", default=None, help="lossless speculative decoding with this drafter: " + drafter_help())
@click.option("--draft-length", default=None, type=click.Choice(list(DRAFT_LENGTHS)), help=DRAFT_LENGTH_HELP)
@click.option("--model-draft", "-md", "--draft-model", "draft_model", type=click.Path(), default=None,
              help="a smaller model of the same vocabulary as the draft (llama.cpp's -md; --draft model:PATH)")
@click.option("--draft-confidence", type=click.FloatRange(0.0, 1.0), default=0.0, show_default=True,
              help="a drafter that runs a model (a layer plan, exit, window, dynamic exit or model:PATH) stops "
                   "a round when its top-1 probability falls below this; n-gram lookup ignores it")
@click.option("--exit-policy", default=None,
              help="lossy dynamic early exit per token: confidence=P | entropy=H | cosine=C, then min=N, every=K, "
                   "vocab=K (as a lossless draft: --draft dynamic:POLICY)")
@click.option("--stats", is_flag=True, help="after the text, a summary on stderr: prompt and new tokens with their "
                                            "rates, the draft's acceptance, plan, dtype, threads, CPU")
@click.option("--verbose", "-v", is_flag=True, help="the same summary as --stats")
@click.option("--json", "as_json", is_flag=True,
              help="the run's statistics as one JSON object on stderr (every field, for scripts)")
@click.option("--prompt-file", type=click.Path(dir_okay=False), default=None,
              help="generate for every prompt of this file (.jsonl records or one prompt a line), up to "
                   "--max-batch at once (continuous batching); one JSON line a prompt on stdout")
@click.option("--max-batch", type=click.IntRange(1, 64), default=8, show_default=True,
              help="with --prompt-file: prompts decoded at once")
def generate(**options) -> None:
    """Generate a continuation of PROMPT (or -p TEXT, -f FILE), or of every prompt of --prompt-file."""
    # (the work's modules import torch: imported once the command line has been read)
    importlib.import_module("layerplan.app.cli.running").run_generate_command(**options)


def light_request(argv: list[str]) -> LiteRequest | None:
    """The light front end's request (lite/request.py) of `layerplan generate ...` (argv without the
    program), read by this command as it reads any line: where the light front end carries the
    line out as the torch one does. Any other option or value (a draft that runs a model, a file of
    prompts, a device, help), and any line the command refuses, give None: the torch front
    end reads the line then, and says what it says of it."""
    context = light_context(generate, argv)
    if context is None:
        return None
    given = context.params
    defaults = {p.name: p.get_default(context) for p in generate.params}
    if any(given[name] != defaults[name] for name in given if name not in _CARRIED):
        return None
    prompts = [p for p in (given["prompt"], given["prompt_option"]) if p is not None]
    if given["prompt_path"] is not None:  # -f: read as the torch front end reads it (app/prompts.py one_prompt)
        try:
            prompts.append(read_text_file(Path(given["prompt_path"])))
        except ValueError:  # (said by the torch front end, in its words)
            return None
    if len(prompts) != 1 or not prompts[0] or given["engine"] == "eager":
        return None
    draft = given["draft"]
    if given["draft_model"] is not None:  # -md FILE: --draft model:FILE (app/cli/running.py)
        if draft is not None:
            return None  # (both given: the torch front end's message)
        draft = f"model:{given['draft_model']}"
    if draft is not None and not light_runs_draft(draft):
        return None  # (a draft that runs torch modules, a token tree, a draft model that is no GGUF)
    request = LiteRequest(prompt=prompts[0], model=given["model"], model_b=given["model_b"], dtype=given["dtype"],
                          engine=given["engine"], threads=given["threads"], plan=given["plan"],
                          max_new_tokens=given["max_new_tokens"], stop=list(given["stop"]), stream=given["stream"],
                          chat=given["chat"], stats=given["stats"] or given["verbose"], as_json=given["as_json"],
                          repetition_penalty=given["repetition_penalty"], presence_penalty=given["presence_penalty"],
                          frequency_penalty=given["frequency_penalty"], logit_bias=tuple(given["logit_bias"]),
                          temperature=given["temperature"], top_k=given["top_k"], top_p=given["top_p"],
                          min_p=given["min_p"], seed=given["seed"], draft=draft, draft_length=given["draft_length"],
                          draft_confidence=given["draft_confidence"] if draft is not None else 0.0)
    try:
        request.sampling()
    except SamplingError:  # (said by the torch front end, in its words)
        return None
    return request


COMMANDS = (generate,)  # registered on main (the package's __init__: COMMAND_INDEX)
