"""The work of the commands that study a model's layers on the torch front end: scan, ppl, search,
explore, train-exit, tune (their command lines: app/cli/scoring.py, searching.py, exploring.py,
tuning.py)."""

from __future__ import annotations

import json
from pathlib import Path

import click
import torch

from layerplan.app.bars import Progress, Stages
from layerplan.app.bench import load_for_timing, wants_transformers
from layerplan.app.cli.common import (attach, checked_probe_row, command_dtype, load, note, set_threads,
                                     user_errors)
from layerplan.app.cli.exploring import report_explore
from layerplan.app.cli.timing import frontier_line
from layerplan.app.cli.scoring import report_scan, scan_kinds
from layerplan.app.cli.searching import report_search
from layerplan.app.merges import export_commands, scan_blocks, study_merges, write_scan
from layerplan.app.prompts import PROMPTS, pick_prompts
from layerplan.app.report import frontier_plot, scan_heatmap, search_trajectory, tune_html
from layerplan.app.tune import tune as run_tune
from layerplan.corpus import default_corpus, given_text, read_texts
from layerplan.decoding.budget import token_budget
from layerplan.decoding.drafters.heads import default_head_path, save_head, train_exit_head
from layerplan.engine.choices import STORED
from layerplan.engine.load import load_model
from layerplan.files import write_json_atomic
from layerplan.machine import cpu_info
from layerplan.models.depth import model_depth
from layerplan.search.bayes import check_storage, quiet_optuna
from layerplan.search.blocks import MergeSpace, parse_range, parse_repeats, parse_scales
from layerplan.search.evaluate import calibration_ids, perplexity, perplexity_in_chunks
from layerplan.search.evaluate import compare as run_compare
from layerplan.search.evaluator import explore as run_explore
from layerplan.search.explore import explore_journal, grid_numbers, recompute_rewind_grid
from layerplan.search.measure_registry import MeasureInputs, check_measures
from layerplan.search.objectives import OBJECTIVES
from layerplan.search.plan_search import check_method
from layerplan.search.run import run_search
from layerplan.search.importance import ScanJournal, check_kinds, journal_path
from layerplan.search.scan import scan as run_scan


def run_scan_command(model, dtype, device, threads, base_plan, tokens, text, kinds, exits, no_reuse, out) -> None:
    """app/cli/scoring.py's `layerplan scan` on the torch front end."""
    set_threads(threads)
    with user_errors():
        check_kinds(scan_kinds(kinds, exits))  # (bad input fails before the model loads)
        calibration = given_text(text)
        loaded = load(model, dtype, device, dense="float32")
        plan = loaded.plan(base_plan)
        ids = calibration_ids(loaded, calibration, tokens)
        journal = ScanJournal(journal_path(out, exits), ids.flatten().tolist())
        with Progress("scan") as progress:
            result = run_scan(loaded, ids, plan, kinds=scan_kinds(kinds, exits), reuse=not no_reuse,
                              on_progress=progress, journal=journal)
        report_scan(result, out, exits)
        journal.remove()


def run_ppl_command(model, dtype, device, threads, plan, model_b, text, window, stride, max_tokens, compare,
                    protocol) -> None:
    """app/cli/scoring.py's `layerplan ppl` on the torch front end."""
    set_threads(threads)
    with user_errors():
        texts = read_texts(text) if text else [default_corpus()]
        loaded = attach(load(model, dtype, device, dense="float32"), model_b, device)
        layer_plan = loaded.plan(plan)
        token_ids = [loaded.tokenizer(t, return_tensors="pt").input_ids for t in texts]
        if max_tokens:
            token_ids = [ids[:, :max_tokens] for ids in token_ids]
        with Progress("perplexity") as progress:
            if protocol == "llama.cpp":  # one text, as llama-perplexity reads its file whole
                result = perplexity_in_chunks(loaded, torch.cat(token_ids, 1), layer_plan, window,
                                              on_progress=progress)
            else:
                result = perplexity(loaded, token_ids, layer_plan, window, stride, on_progress=progress)
        report = result.to_dict()
        if compare and not layer_plan.is_identity:
            ids = torch.cat(token_ids, 1)[:, : min(window, 512)]
            report["vs_full_model"] = run_compare(loaded, ids, layer_plan).to_dict()
    click.echo(json.dumps(report, indent=2))


def run_explore_command(model, dtype, device, threads, recompute, rewind, plans, tokens, text, blocks, layer_range,
                        max_len, repeats, measures, rank, probe_file, probe_items, task, include_path, seed, limit,
                        no_reuse, workers, report, study, trials, scales, sampler, storage, study_name, export, model_b,
                        out) -> None:
    """app/cli/exploring.py's `layerplan explore` on the torch front end."""
    set_threads(threads)
    if blocks or study:
        _explore_merges(model, dtype, device, blocks, layer_range, max_len, repeats, measures,
                        rank, MeasureInputs(tokens or 256, text, probe_file, probe_items, seed, task, include_path),
                        limit, no_reuse, workers, report, study, trials, scales, sampler, storage, study_name, export,
                        model_b, Path(out))
        return
    with user_errors():
        numbers = {name: grid_numbers(name, value) for name, value in (("recompute", recompute), ("rewind", rewind))}
        calibration = given_text(text)
        loaded = load(model, dtype, device, dense="float32")
        candidates = recompute_rewind_grid(loaded, numbers["recompute"], numbers["rewind"])
        candidates += [loaded.plan(p) for p in plans]
        ids = calibration_ids(loaded, calibration, tokens or 512)
        journal = explore_journal(out)
        with Progress("explore") as progress:
            result = run_explore(loaded, ids, candidates, on_progress=progress, journal=journal)
        report_explore(result, out)
        journal.remove()


def _explore_merges(model, dtype, device, blocks, layer_range, max_len, repeats, measures, rank,
                    inputs: MeasureInputs, limit, no_reuse, workers, report, study, trials, scales, sampler, storage,
                    study_name, export, model_b, out_dir: Path) -> None:
    """explore --blocks and/or --search (the scan's best blocks seed the study)."""
    with user_errors():
        names = list(dict.fromkeys(list(measures) or ["ppl", "arithmetic"]))
        names += [extra for extra, given in (("text", inputs.text), ("file", inputs.probe_file), ("task", inputs.task))
                  if given and extra not in names]
        if rank is not None:
            names = [rank] + [n for n in names if n != rank]
        scale_range = parse_scales(scales)
        if study:
            check_storage(storage)
        check_measures(names, inputs)  # bad input fails before the model loads
        span = parse_range(layer_range, model_depth(model)[0])
        counts = parse_repeats(repeats)
        loaded = attach(load(model, dtype, device, dense="float32"), model_b, device)
        best_blocks = []  # (start, end, repeats) of the scan's best: the study's first trials
        if blocks:
            with Stages() as stages:
                def stage(line: str) -> None:
                    click.echo(f"· {line}", err=True)
                    stages.start(line.partition(":")[0])

                result = scan_blocks(loaded, names, inputs, span, max_len, counts, limit, not no_reuse,
                                     workers or torch.get_num_threads(), checkpoint=out_dir / "blocks.partial.json",
                                     on_stage=stage, on_progress=stages)
            click.echo(result.table(top=20))
            written = write_scan(result, out_dir, loaded, model, report)
            best = result.best()
            sure = len(result.better())
            resumed = f", {result.resumed} of them resumed" if result.resumed else ""
            click.echo(f"\n{len(result.rows)} blocks in {result.seconds:.1f}s ({'shared prefix' if result.reuse else 'naive'}"
                       f"{resumed});"
                       f" best by {names[0]}: {best.plan} (change {best.score(names[0]).change:+.4g} "
                       f"[{best.score(names[0]).change_low:+.4g}, {best.score(names[0]).change_high:+.4g}]); "
                       f"{sure} block(s) better beyond the 95% interval")
            for command in export_commands(best.plan, loaded, model):
                click.echo(f"export it: {command}")
            click.echo("wrote " + ", ".join(str(p) for p in written))
            best_blocks = [(r.start, r.end, r.repeats) for r in result.ranked()[:3]]
        if study:
            quiet_optuna()
            space = MergeSpace(span, max_len or (span[1] - span[0] + 1), counts[-1], scale_range,
                               ("", "b") if model_b else ("",))
            seeds = [space.seed(*block) for block in best_blocks]
            with Progress("study") as progress:
                outcome = study_merges(loaded, names[0], inputs, space, trials, out_dir, model, storage, study_name,
                                       sampler, inputs.seed, seeds, export, model_b, on_trial=progress)
            found = outcome.study
            click.echo(f"study '{found.study}': {len([t for t in found.trials if t.state == 'COMPLETE'])} finished "
                       f"trials; {names[0]} of the model {outcome.base_value:.4g}, best {found.best_value:.4g} "
                       f"with plan {found.best_plan}")
            written = [p for p in (outcome.mergekit, outcome.checkpoint) if p] + [str(out_dir / "merge-study.json")]
            if outcome.mergekit is None:
                click.echo("no mergekit YAML: its scale filters cannot express this architecture's scaled updates "
                           "(the checkpoint can)")
            click.echo("wrote " + ", ".join(written))


def run_search_command(model, dtype, threads, method, objective, multi, trials, budget, max_cost_cut, granularity,
                       mode, sampler, storage, study_name, storage_patience, tokens, text, allow_ends, save_draft, seed,
                       out) -> None:
    """app/cli/searching.py's `layerplan search` on the torch front end."""
    set_threads(threads)
    with user_errors():
        check_method(method, objective)  # (before the model loads)
        if method != "greedy":
            check_storage(storage)
        calibration = given_text(text)
        loaded = load(model, dtype, dense="float32")
        ids = calibration_ids(loaded, calibration, tokens)
        prompts = [loaded.encode(p) for p in PROMPTS.values()] if OBJECTIVES[objective].needs_prompts else None
        if method != "greedy":
            quiet_optuna()
        probe_row = checked_probe_row(loaded) if prompts is not None else None  # timed decoding's verify costs
        with Stages() as stages:
            result = run_search(loaded, ids, objective, method, prompts=prompts, probe_row=probe_row, multi=multi,
                                trials=trials, budget=budget, max_cost_cut=max_cost_cut, granularity=granularity,
                                mode=mode, sampler=sampler, storage=storage, study_name=study_name,
                                allow_ends=allow_ends, seed=seed, folder=out, on_stage=stages.start,
                                on_progress=stages, save_draft=save_draft, storage_patience=storage_patience)
        report_search(result, loaded, model, out, save_draft)


def run_train_exit_command(exits, model, dtype, threads, tokens, text, steps, out) -> None:
    """`layerplan train-exit`'s work (its command line: tuning.py)."""
    set_threads(threads)
    with user_errors():
        if out and len(exits) > 1:
            raise ValueError("--out names one file: give one --exit with it")
        calibration = given_text(text)
        # a GGUF as stored (its LM head alone dequantized for the training: heads.py FrozenHead), any
        # other model in float32
        loaded = load(model, dtype, dense="float32")
        ids = calibration_ids(loaded, calibration, tokens)
        rows = tokens // 512 if tokens % 512 == 0 else 1
        ids = ids.reshape(rows, -1)
        for exit in exits:
            target = Path(out or default_head_path(loaded, exit))
            checkpoint = target.with_name(target.name + ".partial")  # (an interrupted run goes on from it)
            with Progress(f"exit {exit}") as progress:
                head, report = train_exit_head(loaded, ids, exit, steps=steps, on_progress=progress,
                                               checkpoint=checkpoint)
            path = save_head(head, target, loaded, report)
            checkpoint.unlink(missing_ok=True)
            click.echo(f"exit {exit}: held-out top-1 agreement {report.agreement_before:.3f} -> {report.agreement_after:.3f}, "
                       f"KL {report.kl_before:.3f} -> {report.kl_after:.3f} ({report.seconds:.0f}s); saved {path}")


def run_tune_command(model, dtype, engine, threads, tokens, steps, repeats, new_tokens, prompt_names, transformers,
                     out) -> None:
    """`layerplan tune`'s work (its command line: tuning.py)."""
    set_threads(threads)
    out_dir = Path(out)
    with user_errors():
        prompts = pick_prompts(prompt_names)
        dtype = command_dtype(model, dtype, engine)
        transformers = wants_transformers(model, dtype) if transformers is None else transformers
        stock, fast = load_for_timing(model, dtype, engine, on_note=note, transformers=transformers)
        token_budget(1, new_tokens, fast.context_length, new_tokens_name="--new-tokens")  # before any decoding
        click.echo(cpu_info().line(), err=True)

        def stage(text: str) -> None:  # "scan: every attention and MLP..." -> a line, and a bar named "scan"
            click.echo(f"· {text}", err=True)
            stages.start(text.partition(":")[0])

        def exact_model():
            """The float32 check's model: transformers' float32 copy where it is loaded (no second copy
            beside it); for a GGUF as stored, its blocks with exact products (float32 arithmetic,
            transformers' numbers, in the file's memory), else float32 whole."""
            if stock is not None and stock.dtype == torch.float32:
                return stock
            if not wants_transformers(model, dtype):  # a GGUF at a block precision
                return fast if fast.precision == STORED else load_model(model, dtype=STORED, engine="native")
            return load_model(model, dtype="float32", engine=engine)

        with Stages() as stages:
            result = run_tune(fast, exact_model, prompts, tokens, steps, repeats,
                              new_tokens, stock=stock, on_stage=stage, on_progress=stages,
                              probe_row=checked_probe_row(fast), scan_journal=journal_path(out_dir, exits=False))
    scan_heatmap(result.scan, out_dir / "scan.png")
    if result.greedy.steps:
        search_trajectory([s.value for s in result.greedy.steps], "maximize", "predicted speedup",
                          out_dir / "search.png")
    if result.frontier is not None:
        frontier_plot(result.frontier, out_dir / "frontier.png")
    write_json_atomic(out_dir / "report.json", result.to_dict())
    tune_html(result, {"Damage from skipping each sub-layer": out_dir / "scan.png",
                       "Greedy search for a faster draft": out_dir / "search.png",
                       "The draft frontier: acceptance against cost, and where a draft pays": out_dir / "frontier.png"},
              out_dir / "report.html")
    best = result.best
    click.echo(f"\nbest draft: {best.draft}: {best.speedup_median:.2f}x {result.bench.reference_words} "
               f"(range {best.speedup_min:.2f}-{best.speedup_max:.2f}x over prompts); identical to plain greedy "
               f"in float32 ({result.exact_precision}): {'yes' if best.same_as_plain_fp32 else 'NO'}")
    click.echo(f"searched skip plan: {result.saved_plan or 'none pays on this model (lookup drafting does)'}")
    if result.frontier is not None:
        click.echo(frontier_line(result.frontier))
    click.echo(f"use it: {result.command()}")
    journal_path(out_dir, exits=False).unlink(missing_ok=True)  # (the report holds the scan now)
    click.echo(f"wrote {out_dir / 'report.html'} and {out_dir / 'report.json'}")

