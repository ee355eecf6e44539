"""``python -m asyncsync.bench JOB.json``: run one benchmark child (see asyncsync.bench.worker).

Operators run the benchmark with ``asyncsync bench``; this entry point is for its children.
"""

import sys

from asyncsync.bench.worker import main

sys.exit(main())
