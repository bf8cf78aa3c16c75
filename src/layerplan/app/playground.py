"""The web playground of `layerplan serve`: the page at `/` (static files in playground/, plain
JavaScript, nothing fetched from elsewhere) and the small JSON endpoints it reads under
/layerplan/:

- GET /layerplan/info: the model (name, layers, context), the server's plan and draft, and the
  choices for the page's pickers, from the registries: drafter kinds (decoding/drafters/registry.py)
  and plan syntax (plan/plan.py).
- POST /layerplan/plan {"plan": PLAN or null, "toggle": {"step": I, "part": "attention"|"mlp"}}:
  the plan parsed as the server parses it (null: the server's plan), optionally with one step's
  sub-layer switched, written back as a plan string with its steps; a bad plan is a 400 with the
  parser's one line. The page's plan builder writes plans through this, never by itself.
- GET /layerplan/scan: the model's latest sub-layer scan (search/scan.py, kept by `layerplan scan`
  and by the page) and the state of a scan the page started; POST /layerplan/scan {"tokens": N}
  starts one. It runs on the decode thread between passes (Scheduler.call): decodes wait while it
  runs rather than share the model with it.

Chat and A/B go through the OpenAI endpoints themselves, with the request's "layerplan" object
for the plan and draft, so a reply costs what the same request through the API costs.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from fastapi import FastAPI, HTTPException
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, Field

import layerplan.plan.plan as plan_module
from layerplan.decoding.drafters.kinds import DRAFTERS, PLAN
from layerplan.decoding.drafters.saved import saved_draft_path
from layerplan.models.loading import LoadedModel
from layerplan.plan.formats import load_plan
from layerplan.plan.plan import LayerPlan, PlanError, parse_plan
from layerplan.search.evaluate import calibration_ids
from layerplan.search.importance import ScanResult, load_cached_scan, save_cached_scan
from layerplan.search.scan import scan

STATIC = Path(__file__).parent / "playground"
SCAN_TOKENS = (16, 2048)  # what the page may ask a scan to read: enough to rank, not a server's hour


class PlanRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    class Toggle(BaseModel):
        model_config = ConfigDict(extra="forbid")
        step: int = Field(ge=0)
        part: Literal["attention", "mlp"]

    plan: str | None = None  # None: the server's own plan
    toggle: Toggle | None = None


class ScanRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tokens: int = Field(128, ge=SCAN_TOKENS[0], le=SCAN_TOKENS[1])


@dataclass
class ScanJob:
    """A scan the page started: its progress, polled by the page."""

    state: Literal["idle", "running", "done", "failed"] = "idle"
    done: int = 0
    total: int = 0
    tokens: int = 0
    error: str | None = None


def drafter_choices(num_layers: int) -> list[dict]:
    """The drafter registry's kinds for the page's picker: syntax and help as the CLI shows them,
    and a spec that works as written where the syntax needs no value of the user's (exit: the
    middle of the model)."""
    choices = []
    for keyword, kind in [*DRAFTERS.items(), ("", PLAN)]:
        first = kind.syntax.split(",")[0].split("[")[0].strip()
        example = first if first == keyword else (f"exit:{max(1, num_layers // 2)}" if keyword == "exit" else None)
        choices.append({"keyword": keyword or None, "syntax": kind.syntax, "help": kind.help, "example": example})
    return choices


def plan_steps(plan: LayerPlan) -> list[dict]:
    return [{"step": i, "layer": s.layer, "attention": s.attention, "mlp": s.mlp} for i, s in enumerate(plan.steps)]


def add_playground(app: FastAPI, model: LoadedModel, scheduler, name: str) -> None:
    """The page and its endpoints on `app`, serving `model` through `scheduler` (decoding/
    scheduler.py: its plan, drafter and decode thread) under the served `name`."""
    job = ScanJob()
    lock = threading.Lock()  # one scan at a time
    found: dict[str, ScanResult | None] = {"scan": load_cached_scan(model.name)}

    def parse(text: str | None) -> LayerPlan:
        if text is None:
            return scheduler.plan
        # the string syntax only: a file name from a web page must not read the server's files
        plan = parse_plan(text, model.num_layers, model.name)
        model.check_plan(plan)
        return plan

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(STATIC / "index.html", media_type="text/html")

    app.mount("/playground", StaticFiles(directory=STATIC), name="playground")

    @app.get("/layerplan/info")
    async def info():
        plans = [{"name": "the server's plan", "plan": scheduler.plan.to_string()},
                 {"name": "the full model", "plan": model.plan().to_string()}]
        saved = saved_draft_path(model)
        if saved.is_file():  # a search's or tune's best draft plan for this model
            try:
                plans.append({"name": "saved draft plan", "plan": load_plan(saved, model.num_layers, model.name).to_string()})
            except (PlanError, OSError, ValueError):
                pass  # a stale file is the registry's concern, not the page's
        return {"model": name, "layers": model.num_layers, "context_length": model.context_length,
                "plan": scheduler.plan.to_string(), "draft": getattr(scheduler.drafter, "name", None),
                "max_batch": scheduler.max_batch, "plans": plans, "drafters": drafter_choices(model.num_layers),
                "plan_help": (plan_module.__doc__ or "").strip()}

    @app.post("/layerplan/plan")
    async def plan(body: PlanRequest):
        try:
            result = parse(body.plan)
            if body.toggle is not None:
                index, part = body.toggle.step, body.toggle.part
                if index >= len(result.steps):
                    raise PlanError(f"step {index} is out of range: the plan has {len(result.steps)} steps")
                step = result.steps[index]
                result = result.with_step(index, **{part: not getattr(step, part)})
        except (PlanError, ValueError) as error:
            raise HTTPException(400, str(error)) from None
        return {"plan": result.to_string(), "exit": result.exit, "steps": plan_steps(result)}

    def scan_state() -> dict:
        result = found["scan"]
        return {"job": asdict(job), "scan": result.to_dict() if result is not None else None}

    @app.get("/layerplan/scan")
    async def get_scan():
        return scan_state()

    @app.post("/layerplan/scan")
    async def start_scan(body: ScanRequest | None = None):
        tokens = (body or ScanRequest()).tokens
        if not lock.acquire(blocking=False):
            raise HTTPException(409, "a scan is running already: poll GET /layerplan/scan for its progress")
        job.state, job.done, job.total, job.tokens, job.error = "running", 0, 0, tokens, None

        def progress(done: int, total: int) -> None:
            job.done, job.total = done, total

        def run() -> ScanResult:  # on the decode thread
            return scan(model, calibration_ids(model, None, tokens), model.plan(), kinds=("attention", "mlp"),
                        on_progress=progress)

        def finished(future) -> None:
            try:
                result = future.result()
                try:
                    save_cached_scan(result)
                except OSError as error:  # the scan stands; only keeping it for the next start failed
                    job.error = f"not kept: {error}"
                found["scan"], job.state = result, "done"
            except Exception as error:  # noqa: BLE001 - the page shows it; the server stays up
                job.state, job.error = "failed", (f"{type(error).__name__}: {error}".splitlines() or [""])[0]
            finally:
                lock.release()

        scheduler.call(run).add_done_callback(finished)
        return scan_state()
