"""`python -m layerplan.app.cli`: the command line as the console entry runs it (app/launch.py
starts the torch front end so)."""

from layerplan.app.cli import run_as_process

run_as_process()
