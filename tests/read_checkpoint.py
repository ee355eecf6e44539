"""Read every tensor of a checkpoint directory as an inference server would (its index, then
each data file with safetensors); print how many. Run as another uid by tests.as_user."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch  # noqa: F401  (safetensors' "pt" framework: loaded before the uid drops)
from safetensors import safe_open


def main(argv: Sequence[str]) -> int:
    d = Path(argv[0])
    index = json.loads((d / "model.safetensors.index.json").read_text())
    n = 0
    for f in sorted(set(index["weight_map"].values())):
        with safe_open(str(d / f), "pt") as st:
            for k in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                st.get_tensor(k)
                n += 1
    print(n)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
