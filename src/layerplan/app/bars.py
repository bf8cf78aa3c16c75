"""Progress bars on stderr (tqdm; none where stderr is not a terminal): the callbacks the commands
hand to the work they run, on either front end."""

from __future__ import annotations

import sys

from tqdm import tqdm


class Progress:
    """on_progress(done, total) callback drawing a tqdm bar on stderr."""

    def __init__(self, description: str, unit: str = "it") -> None:
        # disable=None: no bar when stderr is not a terminal (a log file would get every redraw)
        self.bar = tqdm(desc=description, unit=unit, unit_scale=unit == "B", file=sys.stderr, dynamic_ncols=True,
                        leave=False, disable=None)

    def __call__(self, done: int, total: int) -> None:
        self.bar.total = total
        self.bar.n = done
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Stages:
    """One progress bar per stage: start(text) closes the current bar and opens a fresh one (its
    count and clock start at zero); calling it reports progress to the current bar."""

    def __init__(self) -> None:
        self.current: Progress | None = None
        self.stage = ""

    def start(self, text: str) -> None:
        self.close()
        self.current = Progress(text)

    def __call__(self, done: int, total: int) -> None:
        if self.current is not None:
            self.current(done, total)

    def report(self, stage: str, done: int, total: int) -> None:
        """on_progress(stage, done, total): a new bar when the stage changes."""
        if self.current is None or self.stage != stage:
            self.start(stage)
            self.stage = stage
        self(done, total)

    def close(self) -> None:
        if self.current is not None:
            self.current.close()
            self.current = None

    def __enter__(self) -> Stages:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
