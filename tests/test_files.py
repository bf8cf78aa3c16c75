"""What layerplan writes (files.py): atomically, never over what it does not own, with the user's
umask, leaving no staging debris that a later run of the same kind does not clean."""

import json
import os
import stat
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from layerplan.app.cli import main
from layerplan.files import (WriteError, check_output, clean_debris, replace_folder, staging, write_bytes_atomic,
                             write_text_atomic)
from layerplan.models.gguf_index import SOURCE_RECORD


@pytest.fixture
def place(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.mkfifo("fifo")
    os.mkdir("folder")
    Path("target.txt").write_text("the link's target\n")
    os.symlink("target.txt", "link")
    return tmp_path


@pytest.mark.parametrize("name, what", [("fifo", "is a FIFO"), ("folder", "is a folder"), ("link", "symbolic link"),
                                        ("/dev/null", "character device")])
def test_a_target_that_is_not_a_regular_file_is_refused_and_kept(place, name, what):
    before = os.lstat(name)
    with pytest.raises(WriteError, match=what):
        write_text_atomic(name, "x")
    after = os.lstat(name)
    assert (stat.S_IFMT(after.st_mode), after.st_ino) == (stat.S_IFMT(before.st_mode), before.st_ino)
    assert Path("target.txt").read_text() == "the link's target\n"  # a link is not written through
    assert sorted(os.listdir(place)) == ["fifo", "folder", "link", "target.txt"]  # no staging left


def test_the_command_line_refuses_a_device_as_out_in_one_line(place):
    """`plan --out /dev/full` turned the device into a 114-byte regular file (as root)."""
    result = CliRunner().invoke(main, ["plan", "0-29", "--layers", "30", "--to", "mergekit", "--out", "fifo"])
    assert result.exit_code == 2 and "it exists and is a FIFO" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert stat.S_ISFIFO(os.lstat("fifo").st_mode)


@pytest.mark.parametrize("args", [["plan", "0-29", "--layers", "30", "--out", "/proc/nope/x"],
                                  ["bench", "--out", "/proc/nope/x"], ["scan", "--out", "/proc/nope"],
                                  ["eval", "--tasks", "x", "--out", "/proc/nope/x"]])
def test_an_output_that_cannot_be_written_is_refused_before_any_work(args):
    """bench wrote its result only after the whole bench had run, and then failed."""
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert "cannot write /proc/nope" in result.stderr and "nothing can be created in /proc" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "loading" not in result.stderr


@pytest.mark.parametrize("command", ["scan", "search", "explore", "tune", "frontier"])
def test_a_folder_output_named_like_a_file_is_refused_before_any_work(command, tmp_path):
    """`scan --out scan.json` made a folder scan.json holding scan.json and scan.png."""
    result = CliRunner().invoke(main, [command, "--out", str(tmp_path / "scan.json")])
    assert result.exit_code == 2 and "'scan.json' names a file; give a folder" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "loading" not in result.stderr
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "runs.json").mkdir()  # a folder that exists is one, whatever its name
    assert check_output(tmp_path / "runs.json", "folder") == tmp_path / "runs.json"
    with pytest.raises(WriteError, match="'m.safetensors' names a file"):  # export's checkpoint folder
        check_output(tmp_path / "m.safetensors", "checkpoint")


def test_check_output_creates_nothing(tmp_path):
    check_output(tmp_path / "a" / "b" / "c.json")
    check_output(tmp_path / "runs", "folder")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "file").write_text("")
    with pytest.raises(WriteError, match="is a file, not a folder"):
        check_output(tmp_path / "file" / "x.json")


def test_files_and_checkpoints_get_the_users_umask(tmp_path):
    old = os.umask(0o027)
    try:
        path = write_bytes_atomic(tmp_path / "x.bin", b"1")
        with replace_folder(tmp_path / "ckpt") as staged:
            (staged / "config.json").write_text("{}")
            (staged / "model.safetensors").write_bytes(b"w")
            os.chmod(staged / "model.safetensors", 0o600)  # as safetensors writes it
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert stat.S_IMODE((tmp_path / "ckpt").stat().st_mode) == 0o750
    assert {stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "ckpt").iterdir()} == {0o640}


def test_a_checkpoint_replaces_only_a_checkpoint(tmp_path):
    with replace_folder(tmp_path / "ckpt") as staged:
        (staged / "config.json").write_text("{}")
    with replace_folder(tmp_path / "ckpt") as staged:  # an earlier checkpoint: replaced
        (staged / "config.json").write_text('{"again": 1}')
    assert (tmp_path / "ckpt" / "config.json").read_text() == '{"again": 1}'
    project = tmp_path / "project"
    project.mkdir()
    (project / "config.json").write_text("{}")
    (project / "train.py").write_text("mine")
    with pytest.raises(WriteError, match=r"not a checkpoint \(train.py\)"):
        with replace_folder(project):
            pass
    assert (project / "train.py").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "project"]


def _age(path: Path, seconds: float = 3600) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_staging_debris_of_a_killed_run_is_cleaned_by_the_next_of_its_kind(tmp_path):
    """kill -9 during export left ex/.merged.zdogo719 (307 MB) forever."""
    dead_folder = tmp_path / ".merged.zdogo719"
    (dead_folder / "inner").mkdir(parents=True)
    dead_file = tmp_path / ".best.json.a1b2c3d4.tmp"
    dead_file.write_text("half")
    young = tmp_path / ".merged.youngxyz"  # made after this process started: maybe a live writer's
    young.mkdir()
    others = [tmp_path / ".merged", tmp_path / ".mergedx.abcdefgh", tmp_path / "merged.abcdefgh"]
    for path in others:
        path.mkdir()
    for path in [dead_folder, dead_file, *others]:
        _age(path)
    with staging(tmp_path / "merged", folder=True) as live:  # a new staging cleans the old first
        assert not dead_folder.exists()
        _age(live)
        assert clean_debris(tmp_path, "merged") == []  # held by this process: not debris
        assert live.exists()
    write_text_atomic(tmp_path / "best.json", "{}")
    assert not dead_file.exists()
    assert young.exists() and all(path.exists() for path in others)


def test_export_cleans_its_debris_and_refuses_a_folder_it_does_not_own(tmp_path, monkeypatch):
    from tiny_text import save_tiny_with_tokenizer

    monkeypatch.chdir(tmp_path)
    save_tiny_with_tokenizer("tiny")
    debris = Path(".merged.k1ll3d00")
    debris.mkdir()
    (debris / "model.safetensors").write_bytes(b"half")
    _age(debris)
    result = CliRunner().invoke(main, ["export", "0,1,1,2", "--model", "tiny", "--out", "merged"])
    assert result.exit_code == 0, result.output
    assert not debris.exists() and (Path("merged") / "config.json").exists()
    Path("mine").mkdir()
    (Path("mine") / "notes.txt").write_text("keep")
    Path("mine/sub").mkdir()
    result = CliRunner().invoke(main, ["export", "full", "--model", "tiny", "--out", "mine"])
    assert result.exit_code == 1 and "is not a checkpoint" in result.stderr and "loading" not in result.stderr
    assert (Path("mine") / "notes.txt").read_text() == "keep"


def test_gguf_conversion_debris_in_the_cache_is_cleaned(tmp_path, monkeypatch):
    """A killed first conversion left .SmolLM2-…hkxj8cdv (45 MB) in the cache forever."""
    from layerplan.models import loading

    monkeypatch.setenv("LAYERPLAN_CACHE", str(tmp_path))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    target = loading._converted_dir(gguf)
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    debris = target.parent / f".{target.name}.hkxj8cdv"
    debris.mkdir()
    _age(debris)
    assert loading.convert_gguf(gguf) == target
    assert not debris.exists()


def test_a_conversion_whose_gguf_is_gone_or_changed_is_removed_by_the_next(tmp_path, monkeypatch):
    """Each conversion is the model's dense floats, kept by the file's path, size and time: one whose
    file was deleted, moved or rewritten can never be asked for again, and a venv made afresh per
    clone left one such copy of the packaged model per clone (13 GB seen). The next conversion
    removes them; one with no source record (an older layerplan's) stays."""
    import transformers

    from layerplan.models import loading
    from tiny import tiny_hf

    class Tokenizer:
        def save_pretrained(self, folder):
            (Path(folder) / "tokenizer.json").write_text("{}")

    monkeypatch.setenv("LAYERPLAN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: tiny_hf("llama", 1))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: Tokenizer())
    files = {name: tmp_path / f"{name}.gguf" for name in ("gone", "rewritten", "kept", "new")}
    for path in files.values():
        path.write_bytes(b"GGUF")
    made = {name: loading.convert_gguf(path) for name, path in files.items() if name != "new"}
    assert json.loads((made["kept"] / SOURCE_RECORD).read_text())["path"] == str(files["kept"].resolve())
    older = made["kept"].parent / "older-0123456789ab"
    older.mkdir()
    (older / "config.json").write_text("{}")
    files["gone"].unlink()
    files["rewritten"].write_bytes(b"GGUF, again")
    new = loading.convert_gguf(files["new"])
    assert sorted(p.name for p in new.parent.iterdir()) == sorted([made["kept"].name, new.name, older.name])


def test_the_suite_runs_in_a_cache_of_its_own_and_its_subprocesses_too():
    """conftest.py points LAYERPLAN_CACHE at build/test-cache (where no one else named a cache), so
    the files the tests index, pack and convert stay out of the user's cache; the kernels' library
    is the user's, linked."""
    import subprocess
    import sys

    from conftest import SHARED_WITH_USER_CACHE, TEST_CACHE

    from layerplan.files import cache_dir

    if cache_dir() != TEST_CACHE:
        pytest.skip(f"LAYERPLAN_CACHE was named before the run: {cache_dir()}")
    child = subprocess.run([sys.executable, "-c", "from layerplan.files import cache_dir; print(cache_dir())"],
                           capture_output=True, text=True, check=True)
    assert child.stdout.strip() == str(TEST_CACHE)
    for part in SHARED_WITH_USER_CACHE:
        assert (TEST_CACHE / part).is_symlink()
