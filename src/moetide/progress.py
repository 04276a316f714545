"""Progress output: bars on a terminal only; a log file or a pipe gets plain lines.

`on_terminal()` is the one test every command uses. `bar(...)` is a tqdm bar that draws only there;
`quiet_libraries()` turns off the bars of the libraries moetide calls (transformers' "Loading
weights", huggingface_hub's downloads) when stderr is not a terminal.
"""

from __future__ import annotations

import sys


def on_terminal(stream=None) -> bool:
    """Whether `stream` (default: the current stderr) is an interactive terminal."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed file
        return False


def bar(iterable=None, *, total: int | None = None, desc: str = "", unit: str = "it", enabled: bool = True,
        **kwargs):  # fmt: skip
    """A tqdm bar on stderr, drawn only when `enabled` and stderr is a terminal (disabled, it still
    iterates and counts)."""
    from tqdm.auto import tqdm

    return tqdm(
        iterable,
        total=total,
        desc=desc,
        unit=unit,
        disable=not (enabled and on_terminal()),
        file=sys.stderr,
        **kwargs,
    )


def quiet_libraries() -> None:
    """Off a terminal, no progress bars from transformers or huggingface_hub (imported only if
    already loaded or needed: `--help` imports neither)."""
    if on_terminal():
        return
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    disable_progress_bars()
