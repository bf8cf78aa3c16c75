"""`layerplan explore --blocks` and `--search`: the block-repeat scan and the merge study, with
their files (JSON, heatmaps, report.html, the best plan exported). Printing is the CLI's."""

from __future__ import annotations

import hashlib
import json
import shlex
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from layerplan.app.report import block_heatmap, blocks_html, times_in_words
from layerplan.export import export_checkpoint, export_gguf, gguf_refusal
from layerplan.files import write_json_atomic, write_text_atomic
from layerplan.models.architectures import arch_spec
from layerplan.models.loading import DEFAULT_MODEL, LoadedModel
from layerplan.plan.formats import save_plan, to_mergekit
from layerplan.plan.plan import parse_plan
from layerplan.search.bayes import StudyResult
from layerplan.search.blocks import BlockRow, BlockScanResult, MergeSpace, block_candidates, block_scan, merge_study
from layerplan.search.measure_registry import MEASURES, MeasureInputs
from layerplan.search.measures import build_scorers, point_value


def export_commands(plan: str, model: LoadedModel, model_source: str, out: str = "merged") -> list[str]:
    """The commands that write `plan` of `model` (loaded from model_source) as a file of the model:
    a GGUF's as a GGUF in its stored types where export_gguf can write it (no dense copy), else as
    a checkpoint; and as mergekit YAML."""
    named = "" if model_source == DEFAULT_MODEL else f" --model {shlex.quote(model_source)}"
    whole = f"{out}.gguf" if gguf_refusal(model, model.plan(plan)) is None else f"{out}/"
    return [f"layerplan export {shlex.quote(plan)}{named} --out {whole}",
            f"layerplan export {shlex.quote(plan)}{named} --out {out}.yaml"]


PARTIAL_FORMAT = "layerplan-block-scan-partial"
SAVE_EVERY = 10.0  # seconds between saves of an unfinished scan's rows


def scan_settings(model: LoadedModel, measures: list[str], inputs: MeasureInputs, reuse: bool) -> dict:
    """What a row's scores depend on; an interrupted scan resumes only under the same settings
    (its range, --max-len, --limit, repeats and workers may differ: rows are per block and count)."""
    files = {}
    for name, path in (("text", inputs.text), ("probe_file", inputs.probe_file)):
        if path and Path(path).is_file():
            files[name] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return {"model": model.name, "source": str(model.source), "dtype": str(model.dtype).replace("torch.", ""),
            "engine": "native" if model.native is not None else "eager", "measures": list(measures),
            "inputs": asdict(inputs), "files": files, "reuse": reuse}


def _resumable_rows(checkpoint: Path, settings: dict) -> list[BlockRow]:
    """The rows an interrupted scan with these settings saved in `checkpoint` (none otherwise)."""
    try:
        saved = json.loads(checkpoint.read_text())
        if saved.get("format") != PARTIAL_FORMAT or saved.get("settings") != settings:
            return []
        return [BlockRow.from_dict(row) for row in saved["rows"]]
    except (OSError, ValueError, KeyError, TypeError):
        return []  # none, or not one we wrote: the scan starts afresh and replaces it


def scan_blocks(model: LoadedModel, measures: list[str], inputs: MeasureInputs, layer_range: tuple[int, int],
                max_len: int | None, repeats: int | list[int], limit: int | None = None, reuse: bool = True, workers: int = 1,
                checkpoint: Path | None = None, on_stage: Callable[[str], None] | None = None,
                on_progress: Callable[[int, int], None] | None = None) -> BlockScanResult:
    """Every block in the range (the first `limit` of them, by end then start) repeated `repeats`
    times (a count or several). checkpoint: a file that keeps the rows scored so far (saved every
    SAVE_EVERY seconds and when the scan is interrupted); a scan run again with the same settings
    resumes from it, and a finished one removes it."""
    blocks = block_candidates(model.num_layers, layer_range, max_len)[:limit]
    settings = scan_settings(model, measures, inputs, reuse)
    done = _resumable_rows(checkpoint, settings) if checkpoint is not None else []
    if on_stage:
        on_stage(f"measures: {', '.join(measures)} on the model itself (kept before every layer)")
    scorers = build_scorers(model, measures, inputs, reuse=reuse)
    wanted = {(*block, count) for block in blocks for count in ([repeats] if isinstance(repeats, int) else repeats)}
    reused = sum(row.key in wanted for row in done)
    if on_stage:
        on_stage(f"blocks: {len(blocks)} candidates" + (f", {reused} row(s) resumed from {checkpoint}" if reused else ""))
    rows = list(done)  # everything saved stays saved, also rows outside this run's range
    saved_at = time.monotonic()

    def save() -> None:
        write_json_atomic(checkpoint, {"format": PARTIAL_FORMAT, "settings": settings,
                                       "rows": [asdict(row) for row in rows]})

    def keep(new_rows: list[BlockRow]) -> None:
        nonlocal saved_at
        rows.extend(new_rows)
        if time.monotonic() - saved_at >= SAVE_EVERY:
            save()
            saved_at = time.monotonic()

    try:
        result = block_scan(model, scorers, blocks, repeats, inputs.seed, on_progress, workers, done,
                            keep if checkpoint is not None else None)
    except BaseException:  # interrupted (Ctrl-C, an error): what was scored is kept for the next run
        if checkpoint is not None and len(rows) > len(done):
            save()
        raise
    if checkpoint is not None:
        checkpoint.unlink(missing_ok=True)
    return result


def write_scan(result: BlockScanResult, out_dir: Path, model: LoadedModel, model_source: str,
               report: bool = False) -> list[Path]:
    """blocks.json, a heatmap per measure, the best plan, and with `report` report.html (with the
    commands that export the best: export_commands)."""
    written = [write_json_atomic(out_dir / "blocks.json", result.to_dict())]
    images = {}
    for measure in result.measures:
        for count in result.repeats:  # a heatmap per repeat count (named by it where there are several)
            name = f"blocks-{measure}.png" if len(result.repeats) == 1 else f"blocks-{measure}-x{count}.png"
            path = block_heatmap(result, measure, MEASURES[measure].direction == "minimize", out_dir / name, count)
            images[f"Change in {measure} when block i..j is repeated {times_in_words([count])}"] = path
            written.append(path)
    best = parse_plan(result.best().plan, result.num_layers, result.model)
    written.append(save_plan(best, out_dir / "best_block.json"))
    if report:
        written.append(blocks_html(result, images, export_commands(result.best().plan, model, model_source),
                                   out_dir / "report.html"))
    return written


def _mergekit_scales_right(model: LoadedModel) -> bool:
    """mergekit's scale filters on o_proj / down_proj scale the residual updates exactly when
    those are the layer's output projections and no post-norm follows them (not Gemma, GPT-2)."""
    spec = arch_spec(model.hf.config.model_type)
    return (spec.attention_post_norm is None and spec.mlp_post_norm is None
            and spec.attention_output == "self_attn.o_proj" and spec.mlp_output == "mlp.down_proj")


@dataclass
class MergeStudyOutcome:
    study: StudyResult
    measure: str
    base_value: float
    best_plan: str
    checkpoint: str | None
    mergekit: str | None  # None: the plan scales a residual update mergekit's o_proj/down_proj filters cannot

    def to_dict(self) -> dict:
        return asdict(self)


def study_merges(model: LoadedModel, measure: str, inputs: MeasureInputs, space: MergeSpace, trials: int,
                 out_dir: Path, model_source: str, storage: str | None = None, study_name: str | None = None,
                 sampler: str = "tpe", seed: int = 0, seeds: list[dict] = (), export: bool = True,
                 model_b: str | None = None, on_trial: Callable[[int, int], None] | None = None) -> MergeStudyOutcome:
    """The study (storage default out/study.db, so that the same command resumes), then its best
    plan as a file of the model (out/best-merge.gguf for a GGUF's that export_gguf writes, else a
    checkpoint, out/best-merge/) and mergekit YAML (out/best-merge.yaml)."""
    scorer = build_scorers(model, [measure], inputs)[measure]
    study = merge_study(model, scorer, measure, space, trials, str(storage or out_dir / "study.db"), study_name,
                        sampler, seed, seeds, on_trial)
    best = model.plan(study.best_plan)
    save_plan(best, out_dir / "best_merge.json")
    yaml_path = None
    if _mergekit_scales_right(model) or all(s.scale == 1.0 for s in best.active_steps):
        yaml_path = str(write_text_atomic(out_dir / "best-merge.yaml",
                                          to_mergekit(best, model_source, str(model.dtype).replace("torch.", ""),
                                                      {"b": model_b} if model_b else None)))
    folder = None
    if export:  # a GGUF's plan as a GGUF in its stored types where it can be (no dense copy), else a checkpoint
        folder = str(export_gguf(model, best, out_dir / "best-merge.gguf") if gguf_refusal(model, best) is None
                     else export_checkpoint(model, best, out_dir / "best-merge"))
    outcome = MergeStudyOutcome(study, measure, point_value(scorer, model.plan()), study.best_plan, folder, yaml_path)
    write_json_atomic(out_dir / "merge-study.json", outcome.to_dict())
    return outcome
