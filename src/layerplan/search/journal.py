"""What a long measurement has finished, kept as it goes, so that the same measurement started again
after an interruption runs only the rest (the scan's candidates, explore's grid of plans).

A journal is JSON lines beside the command's outputs: its first line names the work (the model,
what was measured and on which ids: a digest of them, and a figure that another arithmetic or text
would change), then one line a finished row, appended and flushed as the row finishes. Opened for
the same work, it gives the rows found there (a line an interruption cut short is ignored); for
any other, it starts afresh. It is rewritten atomically when opened, and removed once the work's
outputs are written. No torch."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

from layerplan.files import write_text_atomic


def ids_digest(ids: Sequence[int]) -> str:
    """A short digest of the token ids a measurement ran on (its journal's header holds it)."""
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]


class RowJournal:
    """A measurement's finished rows (plain JSON objects) in `path`: see the module's docstring."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._file = None

    def open(self, header: dict) -> list[dict]:
        """Start the journal for the work `header` names; the rows an earlier run of the same
        work finished (none where the journal is absent or names other work)."""
        try:
            lines = self.path.read_text().splitlines()
        except OSError:
            lines = []
        rows = []
        if lines and _json_line(lines[0]) == header:
            rows = [row for row in map(_json_line, lines[1:]) if isinstance(row, dict)]
        # (written whole and atomically: an interruption now leaves the earlier journal as it was)
        write_text_atomic(self.path, "".join(json.dumps(line) + "\n" for line in (header, *rows)))
        self._file = open(self.path, "a", encoding="utf-8")
        return rows

    def record(self, row: dict) -> None:
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def remove(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self.path.unlink(missing_ok=True)


def _json_line(line: str):
    try:
        return json.loads(line)
    except ValueError:
        return None
