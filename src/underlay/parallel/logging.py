"""One rank-aware logging set-up for trainers, the CLI and the demo.

It lives in ``parallel`` (not ``utils``) because it asks :func:`underlay.parallel.rank.current_rank`, the
one "which rank am I" function, and the layer contract keeps ``utils`` below ``parallel``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from underlay.interfaces import ConfigError
from underlay.parallel.rank import current_rank
from underlay.utils import env

__all__ = ["setup_logging"]

_FORMAT = "%(asctime)s [rank %(rank)s] %(levelname)s %(name)s: %(message)s"
_TAG = "_underlay_handler"


class _RankFilter(logging.Filter):
    """Adds ``record.rank`` (asked at each record, so a rank known only after ``init_process_group`` is
    right) and, with ``rank_zero_only``, drops records on every other rank (console handler only)."""

    def __init__(self, rank_zero_only: bool) -> None:
        super().__init__()
        self.rank_zero_only = rank_zero_only

    def filter(self, record: logging.LogRecord) -> bool:
        rank = current_rank()
        record.rank = rank
        return not (self.rank_zero_only and rank != 0)


def _level(level: int | str | None) -> int:
    raw: int | str = env.get("UNDERLAY_LOG_LEVEL") if level is None else level
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    text = str(raw).strip().upper()
    if text.lstrip("-").isdigit():
        return int(text)
    value = logging.getLevelName(text)
    if not isinstance(value, int):
        source = "UNDERLAY_LOG_LEVEL" if level is None else "level"
        raise ConfigError(f"{source}={raw!r}: use DEBUG, INFO, WARNING, ERROR, CRITICAL or a number")
    return value


def setup_logging(
    level: int | str | None = None, rank_zero_only: bool = False, file: str | os.PathLike[str] | None = None
) -> logging.Logger:
    """Configure the root logger: one stream handler (stderr) whose lines read
    ``<time> [rank N] LEVEL logger: message``, plus, with ``file``, a per-rank log file (``{rank}`` in the
    path is replaced by the rank; without it ``.rank{N}`` is added before the suffix, so ranks never share
    a file).

    ``level``: a name or number; ``None`` reads ``UNDERLAY_LOG_LEVEL`` (default ``INFO``).
    ``rank_zero_only``: the console shows only rank 0's records; per-rank files keep every rank's (so a
    failure on rank 5 is still on disk). Calling it again
    replaces the handlers it added before (idempotent), leaving other handlers alone. Returns the root
    logger. Raises ``ConfigError`` for an unknown level.
    """
    lvl = _level(level)
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, _TAG, False):
            root.removeHandler(h)
            h.close()
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    if file is not None:
        rank = current_rank()
        path = Path(os.fspath(file))
        if "{rank}" in str(path):
            path = Path(str(path).replace("{rank}", str(rank)))
        else:
            path = path.with_name(f"{path.stem}.rank{rank}{path.suffix}")
        path.parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(path))
    for i, h in enumerate(handlers):
        h.setFormatter(logging.Formatter(_FORMAT))
        h.addFilter(_RankFilter(rank_zero_only and i == 0))
        h.setLevel(lvl)
        setattr(h, _TAG, True)
        root.addHandler(h)
    root.setLevel(lvl)
    return root
