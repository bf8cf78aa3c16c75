"""BENCHMARKS.md's table of current figures is generated from benchmarks/figures/*.json
(benchmarks/figures.py, `make figures`): the table in the file is what the records give, and the
generator refuses a record it cannot use and writes the table whole."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import figures  # noqa: E402 - benchmarks/figures.py

RECORD = {"figure": "decode tok/s, a | b", "value": "265.3", "peer": "127.4", "ratio": "2.08x",
          "command": "python benchmarks/stored_vs_llamacpp.py smollm2", "cpu": "Intel Xeon, 2 cores",
          "date": "2026-11-25", "issue": 28}


def test_the_table_in_benchmarks_md_is_the_records_table(capsys):
    assert figures.main(["--check"]) == 0, capsys.readouterr().err
    text = figures.TARGET.read_text(encoding="utf-8")
    assert text.startswith("# Benchmarks\n\n" + figures.BEGIN + "\n| figure |")  # it begins the file
    rows = text.split(figures.BEGIN, 1)[1].split(figures.END, 1)[0].strip().splitlines()
    assert len(rows) == 2 + len(list(figures.RECORDS.glob("*.json")))


def _write(folder: Path, name: str, record) -> None:
    folder.mkdir(exist_ok=True)
    (folder / name).write_text(json.dumps(record), encoding="utf-8")


def test_the_table_is_rewritten_between_the_markers_and_checked(tmp_path, capsys):
    records = tmp_path / "figures"
    _write(records, "020-b.json", {**RECORD, "figure": "second", "command": ["make demo", "layerplan bench"]})
    _write(records, "010-a.json", RECORD)
    target = tmp_path / "BENCHMARKS.md"
    target.write_text(f"# Benchmarks\n\n{figures.BEGIN}\nold table\n{figures.END}\n\nprose kept\n", encoding="utf-8")
    args = ["--records", str(records), "--target", str(target)]
    assert figures.main([*args, "--check"]) == 1
    assert "make figures" in capsys.readouterr().err
    assert figures.main(args) == 0
    text = target.read_text(encoding="utf-8")
    assert "old table" not in text and text.endswith(f"{figures.END}\n\nprose kept\n")
    rows = text.split(figures.BEGIN)[1].split(figures.END)[0].strip().splitlines()
    assert rows[0] == "| figure | layerplan | peer | ratio | command | CPU | date | issue |"
    assert rows[2] == ("| decode tok/s, a \\| b | 265.3 | 127.4 | 2.08x | `python benchmarks/stored_vs_llamacpp.py "
                       "smollm2` | Intel Xeon, 2 cores | 2026-11-25 | #28 |")  # file-name order, | escaped
    assert rows[3].startswith("| second |") and "`make demo`; `layerplan bench`" in rows[3]
    assert figures.main([*args, "--check"]) == 0
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging file left


@pytest.mark.parametrize("change, message", [
    ({"date": "25 Nov 2026"}, "date must be YYYY-MM-DD"),
    ({"issue": "28"}, "issue must be a positive issue number"),
    ({"value": 265.3}, "value must be a string"),
    ({"command": []}, "command must be a command line or a list of them"),
    ({"extra": "x"}, "unknown extra"),
    ({"cpu": None}, "cpu must be a string"),
])
def test_a_record_it_cannot_use_is_named_in_one_line(tmp_path, capsys, change, message):
    records = tmp_path / "figures"
    _write(records, "010-a.json", {**RECORD, **change})
    target = tmp_path / "BENCHMARKS.md"
    target.write_text(f"{figures.BEGIN}\n{figures.END}\n", encoding="utf-8")
    assert figures.main(["--records", str(records), "--target", str(target)]) == 1
    err = capsys.readouterr().err
    assert message in err and "010-a.json" in err and err.count("\n") == 1
    assert target.read_text(encoding="utf-8") == f"{figures.BEGIN}\n{figures.END}\n"


def test_a_missing_field_and_missing_markers_are_refused(tmp_path, capsys):
    records = tmp_path / "figures"
    _write(records, "010-a.json", {k: v for k, v in RECORD.items() if k != "cpu"})
    target = tmp_path / "BENCHMARKS.md"
    target.write_text("no markers here\n", encoding="utf-8")
    assert figures.main(["--records", str(records), "--target", str(target)]) == 1
    assert "missing cpu" in capsys.readouterr().err
    _write(records, "010-a.json", RECORD)
    assert figures.main(["--records", str(records), "--target", str(target)]) == 1
    assert "marker lines" in capsys.readouterr().err
    assert target.read_text(encoding="utf-8") == "no markers here\n"
