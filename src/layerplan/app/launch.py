"""The `layerplan` command's entry: a GGUF's plain generation runs on the light front end
(layerplan/lite/: numpy and the native kernels, a start of a tenth of a second), every other
command line on the torch front end (app/cli/), which reads it as it always has.

Which one runs changes no output: the light front end takes only command lines whose meaning it
carries out as the torch one does (lite/request.py request_of), and only models whose index it can
read (kept, or made now from the file). Where it finds, once started, that the model needs the
torch front end, the command starts again as `python -m layerplan.app.cli` with
LAYERPLAN_FRONT_END=torch: the kernels' library, loaded by then, links an OpenMP runtime that must
not meet torch's in one process.

The command line is read, and a kept index's tokenizer process started (lite/tokenizer_process.py),
before numpy or anything else that starts threads is imported: a fork copies only the thread
that calls it.
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] == ["generate"]:
        from layerplan.lite.request import FRONT_END_VARIABLE, request_of
        from layerplan.lite.tokenizer_process import TokenizerProcess

        request = request_of(argv)
        if request is not None:
            # the tokenizer's parse, most of a later start, begins now in a process of its own
            # (before numpy's threads, which a fork would not copy)
            tokenizer = TokenizerProcess.for_model(request.model)
            from layerplan.lite.cli import run, runnable

            taken = runnable(request)
            status = run(request, tokenizer) if taken else None
            if tokenizer is not None:
                tokenizer.close()
            if status is not None:
                # Nothing is left to clean up (what it wrote, it wrote whole and flushed), and
                # the interpreter's teardown (every module, the tokenizer's tables, the kernels'
                # threads) would add a tenth of the start to the command's time: leave now.
                for stream in (sys.stdout, sys.stderr):
                    try:
                        stream.flush()
                    except OSError:  # a reader gone (`| head`): nothing more to say
                        status = status or 1
                os._exit(status)
            if taken:  # the model turned out to need the torch front end, after the kernels' library loaded
                os.environ[FRONT_END_VARIABLE] = "torch"
                os.execv(sys.executable, [sys.executable, "-m", "layerplan.app.cli", *argv])
    from layerplan.app.cli import run_as_process

    run_as_process()


if __name__ == "__main__":
    main()
