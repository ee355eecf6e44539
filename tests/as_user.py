"""Run a module's ``main`` as another uid: ``python -m tests.as_user UID GID MODULE [ARGS...]``.

The interpreter of this venv may live where another uid cannot read (``/root/.pyenv``), so
the process starts as root, imports ``MODULE`` (and what it needs), then drops to ``UID:GID``
(no supplementary groups) before ``MODULE.main(ARGS)`` opens a single file of the test's.
A module without ``main`` is run as a script (``runpy``) after the drop.
"""

from __future__ import annotations

import importlib
import os
import runpy
import sys


def main() -> int:
    uid, gid, module = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    args = sys.argv[4:]
    mod = importlib.import_module(module)
    import asyncio.base_events
    import asyncio.unix_events  # noqa: F401
    import encodings.idna  # noqa: F401  (a host name's lookup encodes it: imported lazily)

    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    if hasattr(mod, "main"):
        return int(mod.main(args) or 0)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
