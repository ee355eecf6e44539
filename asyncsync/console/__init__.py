"""What the command-line tools and sessions show and take: progress bars, log output, argument
types. Ground floor: imports nothing of the project but the error tree, so that both sides
(``receiver.cli``) and the training loop (:class:`~asyncsync.training.session.SyncSession`)
stand on it.
"""

from asyncsync.console.args import int_at_least, non_negative_int, positive_float, positive_int
from asyncsync.console.logsetup import (
    LOG_FORMATS,
    LOG_LEVELS,
    JsonFormatter,
    add_logging_arguments,
    setup_logging,
)
from asyncsync.console.progress import Progress, ProgressWatcher

__all__ = [
    "LOG_FORMATS",
    "LOG_LEVELS",
    "JsonFormatter",
    "Progress",
    "ProgressWatcher",
    "add_logging_arguments",
    "int_at_least",
    "non_negative_int",
    "positive_float",
    "positive_int",
    "setup_logging",
]
