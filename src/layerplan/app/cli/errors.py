"""Bad input as one line, not a traceback, without torch: the commands read without it
(chatting.py, planning.py) and common.py's user_errors, which adds the torch front end's own."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import click

from layerplan.files import WriteError
from layerplan.models.errors import ModelError
from layerplan.plan.plan import PlanError


@contextmanager
def plain_user_errors(*more: type[BaseException]) -> Iterator[None]:
    """Bad input (and the `more` kinds of error) becomes a one-line message and exit status 1."""
    try:
        yield
    except (PlanError, ModelError, FileNotFoundError, WriteError, ValueError, *more) as error:
        raise click.ClickException(str(error)) from None
    except ConnectionError as error:  # lm-eval task data (or anything else) neither on disk nor reachable
        raise click.ClickException(f"{error}: not on disk and not downloadable from here") from None
    except OSError as error:  # a file that cannot be read or written, named
        where = f"{error.filename}: " if error.filename else ""
        raise click.ClickException(f"{where}{error.strerror or error}") from None
