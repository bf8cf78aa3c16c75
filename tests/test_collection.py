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


def test_a_command_run_in_process_leaves_its_model_to_the_collector(tmp_path):
    """cli.common.load freezes what a load made only where the process is the command (the console
    entry): a caller running commands in-process (a test's CliRunner) gets its memory back. Frozen,
    each in-process `generate` of the packaged model kept ~118 MB for the rest of the suite."""
    import weakref

    from click.testing import CliRunner

    from layerplan.app import cli
    from layerplan.app.cli import common
    from tiny_text import save_tiny_with_tokenizer

    folder = save_tiny_with_tokenizer(tmp_path / "tok")
    loads = []
    real_load = common.load_model

    def recorded(*args, **kwargs):
        model = real_load(*args, **kwargs)
        loads.append(weakref.ref(model))
        return model

    frozen = gc.get_freeze_count()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(common, "load_model", recorded)
        for _ in range(2):
            done = CliRunner().invoke(cli.main, ["generate", "hi", "--model", str(folder), "--dtype", "float32",
                                                 "-n", "2"])
            assert done.exit_code == 0, done.output
    gc.collect()
    assert gc.get_freeze_count() == frozen
    assert len(loads) == 2 and all(ref() is None for ref in loads)  # both models freed
