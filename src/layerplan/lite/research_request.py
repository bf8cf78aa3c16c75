"""The requests of the light front end's research commands (lite/research.py, lite/searching.py),
apart from lite/request.py's (a `generate` start does not wait for their classes): a `layerplan
ppl` request, a GGUF's perplexity under a plan of this model, in either protocol, and the plan's
comparison with the full model (app/cli/scoring.py light_ppl_request); a `layerplan scan`
request, a GGUF's sub-layer or exit scan of a plan of this model (app/cli/scoring.py
light_scan_request); a `layerplan search` request, every option of the command
(app/cli/searching.py light_search_request); a `layerplan explore` request, its grid of layer
orders (app/cli/exploring.py light_explore_request); a `layerplan probe` request, a GGUF's
native rows (app/cli/timing.py light_probe_request, lite/probing.py); a `layerplan bench`
request, its plain and drafted decodes against llama.cpp's tools (app/cli/timing.py
light_bench_request, app/light_timing.py); a `layerplan frontier` request over drafts given
(light_frontier_request)."""

from __future__ import annotations

from dataclasses import dataclass, field

from layerplan.lite.request import FileRequest


@dataclass
class LitePerplexityRequest(FileRequest):
    text: str | None = None  # --text: a .txt or .jsonl file (None: the built-in corpus)
    window: int = 512
    stride: int = 256
    max_tokens: int = 4096  # per text (0: all)
    plan: str | None = None  # a plan of this model (None: the full model)
    protocol: str = "sliding"  # search/windows.py PROTOCOLS
    compare: bool = True  # --compare: a plan's KL and top-1 agreement against the full model


@dataclass
class LiteScanRequest(FileRequest):
    plan: str | None = None  # --plan: the base plan (None: the full model)
    tokens: int = 512  # --tokens: the calibration text's first tokens
    text: str | None = None  # --text: a .txt or .jsonl file (None: the built-in corpus)
    kinds: list[str] = field(default_factory=lambda: ["attention", "mlp", "layer"])  # search/importance.py's
    exits: bool = False  # --exits: an exit scan (its outputs are named exits.*)
    reuse: bool = True  # --no-reuse: every candidate from the embeddings
    out: str = "runs/scan"


@dataclass
class LiteSearchRequest(FileRequest):
    """app/cli/searching.py's options, as the command reads them."""

    method: str = "both"
    objective: str = "speedup"
    multi: bool = False
    trials: int = 100
    budget: int | None = None
    max_cost_cut: float | None = None
    granularity: str = "sublayer"
    mode: str = "forward"
    sampler: str = "tpe"
    storage: str | None = None
    study_name: str | None = None
    storage_patience: float = 600
    tokens: int = 512
    text: str | None = None
    allow_ends: bool = False
    save_draft: bool | None = None
    seed: int | None = None
    out: str = "runs/search"


@dataclass
class LiteExploreRequest(FileRequest):
    """app/cli/exploring.py's grid of layer orders (no --blocks, --search or second model)."""

    recompute: str = "6,8,10,12"  # search/explore.py grid_numbers reads them
    rewind: str = "1,2,4,6"
    plans: list[str] = field(default_factory=list)  # --plan: extra plans of this model
    tokens: int = 512
    text: str | None = None
    out: str = "runs/explore"


@dataclass
class LiteProbeRequest(FileRequest):
    """app/cli/timing.py's `layerplan probe` on a GGUF's native rows (its stored arithmetics)."""

    dtypes: list[str] = field(default_factory=list)  # the rows' precisions, stored ones only
    max_length: int = 16  # passes over 1..max_length new tokens
    repeats: int = 5
    refresh: bool = False
    as_json: bool = False


@dataclass
class LiteBenchRequest(FileRequest):
    """app/cli/timing.py's `layerplan bench` on a GGUF as stored: layerplan's plain decoding and
    drafts the light front end runs, and llama.cpp's tools, on prompts read already."""

    prompts: dict[str, str] = field(default_factory=dict)  # {name: text}
    chat: list[str] = field(default_factory=list)  # the prompts that go through the chat template
    new_tokens: int = 64
    repeats: int = 3
    drafts: list[str] = field(default_factory=list)
    draft_length: str | None = None
    llama_cpp: bool = True
    llama_draft_max: int = 8
    out: str = "runs/bench.json"


@dataclass
class LiteFrontierRequest(FileRequest):
    """app/cli/timing.py's `layerplan frontier` on a GGUF as stored, over drafts the light front
    end runs (given: the default families include drafts that run torch modules)."""

    drafts: list[str] = field(default_factory=list)
    prompts: dict[str, str] = field(default_factory=dict)  # {name: text}
    new_tokens: int = 48
    gamma: int = 4
    out: str = "runs/frontier"
