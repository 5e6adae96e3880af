"""Progress of the batch jobs' long phases: a log line at the start and at the end of each
(with its duration), and on a terminal a live line naming the phase and its elapsed time,
redrawn every second (tqdm, as ``ingest`` and ``simulate`` show theirs; off when stderr is
not a terminal, so logs and CI stay as they are). A phase with steps of its own (boosting
rounds) writes them into the line with ``set_postfix_str``."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

# The live line: the phase, its elapsed time, and what the phase adds (rounds).
BAR_FORMAT = "{desc}: {elapsed}{postfix}"
REDRAW_S = 1.0


@contextmanager
def phase(what: str, log: logging.Logger) -> Iterator[tqdm]:
    """Log ``what ...`` and, after the block, ``what: done in N s``; on a terminal, show
    ``what: MM:SS`` meanwhile, redrawn every second by a daemon thread (a phase with no
    steps of its own still shows it is running). Yields the bar (disabled off a terminal:
    its methods do nothing)."""
    log.info("%s ...", what)
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        bar = stack.enter_context(tqdm(desc=what, bar_format=BAR_FORMAT, disable=None, leave=False))
        if not bar.disable:
            # Log lines written meanwhile go above the live line, not through it.
            stack.enter_context(logging_redirect_tqdm())
            stop = threading.Event()
            ticker = threading.Thread(target=_redraw, args=(bar, stop), daemon=True)
            ticker.start()
            stack.callback(ticker.join)
            stack.callback(stop.set)
        yield bar
    log.info("%s: done in %.1fs", what, time.perf_counter() - t0)


def _redraw(bar: tqdm, stop: threading.Event) -> None:
    while not stop.wait(REDRAW_S):
        bar.refresh()
