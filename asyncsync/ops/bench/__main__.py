"""``python -m asyncsync.ops.bench JOB.json``: run one benchmark child (see its ``worker``).

Operators run the benchmark with ``asyncsync bench``; this entry point is for its children.
"""

import sys

from asyncsync.ops.bench.worker import main

sys.exit(main())
