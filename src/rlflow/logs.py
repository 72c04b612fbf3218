"""One copy of each message in multi-process runs.

Every process of a ``torchrun`` launch runs the same code on similar data, so each warning,
progress bar and library log line would appear once per process. :func:`quiet_other_ranks`
silences them on every rank but 0 (rank 0 still shows each one once); errors still surface on
every rank.
"""

from __future__ import annotations

import logging
import os
import warnings

__all__ = ["quiet_other_ranks", "is_other_rank"]

# loggers whose INFO lines each process repeats ("Initializing distributed: GLOBAL_RANK: 1, ...")
CHATTY_LOGGERS = ("lightning_fabric", "torch.distributed")


def is_other_rank() -> bool:
    """True in a ``torchrun`` worker whose global rank is not 0."""
    return os.environ.get("RANK", "0") != "0"


def quiet_other_ranks(rank: int | None = None) -> None:
    """On a rank other than 0 (``rank``, or the ``RANK`` variable torchrun sets): no warnings, no
    progress bars from transformers or datasets, library loggers at ERROR. A no-op on rank 0."""
    if (rank if rank is not None else int(os.environ.get("RANK", "0"))) == 0:
        return
    warnings.filterwarnings("ignore")
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] = "1"
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    try:
        import transformers

        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
    except ImportError:
        pass
