"""The collector pause around imports and loads (layerplan/collection.py)."""

import gc
import subprocess
import sys

import pytest

from layerplan.collection import collection_paused


@pytest.fixture(autouse=True)
def restore_collector():
    was = gc.isenabled()
    yield
    (gc.enable if was else gc.disable)()


def test_paused_inside_and_back_after():
    gc.enable()
    with collection_paused():
        assert not gc.isenabled()
        with collection_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer block's pause holds
    assert gc.isenabled()


def test_a_disabled_collector_stays_disabled():
    gc.disable()
    with collection_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_back_after_an_error():
    gc.enable()
    with pytest.raises(RuntimeError):
        with collection_paused():
            raise RuntimeError("load failed")
    assert gc.isenabled()


def test_the_package_import_leaves_the_collector_on():
    # a process of its own: here layerplan was imported long ago
    done = subprocess.run([sys.executable, "-c", "import gc, layerplan; print(gc.isenabled(), layerplan.load_model)"],
                          capture_output=True, text=True, check=True)
    assert done.stdout.startswith("True <function load_model")
