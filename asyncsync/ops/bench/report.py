"""Turn one run's raw numbers into the summary (JSON), markdown tables and PNG plots.

:func:`summarise` computes every ratio from the raw measurements of one run (medians where a
figure was repeated) and checks it against the targets of the benchmark's issue; the summary's
top-level keys are the ones ``--json`` promises (``bytes_per_changed``, ``publish_vs_ne_pass``,
``e2e_vs_transfer_bound``, ``full_sync_vs_ours``, ``pipelined_vs_serialized``,
``publisher_peak_rss_vs_model``, ``receiver_peak_rss_vs_model``), all taken from the ~3 %
density main workload.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from asyncsync.fsio import Throttle
from asyncsync.ops.bench.baselines import BASELINES, LABELS
from asyncsync.ops.bench.scale import peak_split

__all__ = ["TARGETS", "markdown", "plot", "summarise"]

#: name -> (comparison, bound) from the issue; the first is ours / best baseline.
TARGETS: dict[str, tuple[str, float]] = {
    "ours_vs_best_baseline": ("<=", 0.7),
    "publish_vs_ne_pass": ("<=", 2.0),
    "e2e_vs_transfer_bound": ("<=", 1.3),
    "full_sync_vs_ours": (">=", 10.0),
    "pipelined_vs_serialized": ("<=", 0.6),
    "publisher_peak_rss_vs_model": ("<=", 2.5),
    "receiver_peak_rss_vs_model": ("<=", 1.5),
}
_MB = 1e6


def _median(xs: Iterable[float]) -> float:
    values = list(xs)
    return statistics.median(values) if values else float("nan")


def _rss(side: dict[str, Any], model: int) -> dict[str, float]:
    """Peak RSS above the child's post-import baseline, relative to the model's bytes."""
    r = side["rss"]
    base = r["base"]["now"]
    startup = (r["startup"]["peak"] - base) / model
    steady = (r["steady"]["peak"] - base) / model
    end = r["steady"]
    return {
        "peak": max(startup, steady),
        "startup": startup,
        "steady": steady,
        "end_anon": (end.get("anon", 0) - r["base"].get("anon", 0)) / model,
        "end_file": (end.get("file", 0) - r["base"].get("file", 0)) / model,
        "base_bytes": base,
        "peak_split": peak_split(side, model),  # the sampled peak: anon + file + shmem
    }


def summarise(raw: dict[str, Any]) -> dict[str, Any]:
    """The JSON summary of one run (ratios, target checks, tables' data, raw numbers)."""
    main, cost, e2e = raw["main"], raw["cost"], raw["e2e"]
    changed = main["changed"]
    bpc = {k: main[k] / changed for k in ("ours", *BASELINES)}
    best_name = min(BASELINES, key=lambda k: bpc[k])
    model = cost["model_bytes"]
    throttle = Throttle.parse(raw["config"]["throttle"])
    bandwidth = throttle.bandwidth or float("inf")

    ne = _median(cost["ne_pass"])
    publish = _median(p["total"] for p in cost["publishes"])
    runs = {mode: e2e[mode]["publisher"]["versions"] for mode in ("pipelined", "serialized")}
    e2e_s = {mode: _median(v["e2e"] for v in vs) for mode, vs in runs.items()}
    wire = _median(v["wire_bytes"] for v in runs["pipelined"])
    shards = _median(v["shards"] for v in runs["pipelined"])
    bound = wire / bandwidth
    full = _median(cost["full_sync"])
    apply_s = _median(cost["applies"])
    pub_rss = _rss(e2e["pipelined"]["publisher"], model)
    rec_rss = _rss(e2e["pipelined"]["receiver"], model)

    out: dict[str, Any] = {
        "bytes_per_changed": bpc,
        "publish_vs_ne_pass": publish / ne,
        "e2e_vs_transfer_bound": e2e_s["pipelined"] / bound,
        "full_sync_vs_ours": full / e2e_s["pipelined"],
        "pipelined_vs_serialized": e2e_s["pipelined"] / e2e_s["serialized"],
        "publisher_peak_rss_vs_model": pub_rss["peak"],
        "receiver_peak_rss_vs_model": rec_rss["peak"],
        "ours_vs_best_baseline": bpc["ours"] / bpc[best_name],
        "best_baseline": best_name,
    }
    out["targets"] = {
        name: {
            "value": out[name],
            "op": op,
            "target": bound_,
            "pass": out[name] <= bound_ if op == "<=" else out[name] >= bound_,
        }
        for name, (op, bound_) in TARGETS.items()
    }
    out["details"] = {
        "model_bytes": model,
        "elements": main["elements"],
        "changed": changed,
        "density": changed / main["elements"],
        "ours_payload_per_changed": main["ours_payload"] / changed,
        "seconds": {
            "ne_pass": ne,
            "publish": publish,
            "publish_stages": _stage_medians(p["stages"] for p in cost["publishes"]),
            "publish_components": cost["publish_components"],
            "receive_components": cost["receive_components"],
            "apply": apply_s,
            "flush_after_ack": _median(cost.get("flushes") or [0.0]),
            "e2e_pipelined": e2e_s["pipelined"],
            "e2e_serialized": e2e_s["serialized"],
            "e2e_publish_part": {
                mode: _median(v["publish"] for v in vs) for mode, vs in runs.items()
            },
            "e2e_publish_stages": _stage_medians(v["stages"] for v in runs["pipelined"]),
            "transfer_bound": bound,
            "transfer_bound_with_latency": bound + 2 * (shards + 1) * throttle.latency,
            "full_sync": full,
        },
        "wire_bytes": wire,
        "shards": shards,
        "apply_changed_per_s": changed / apply_s,
        "apply_model_bytes_per_s": model / apply_s,
        "rss": {"publisher": pub_rss, "receiver": rec_rss},
        "prefetched_shards": e2e["pipelined"]["receiver"].get("prefetched_shards"),
        "profile": cost["profile"],
        "sweep": [_sweep_row(r) for r in raw["sweep"]],
    }
    out["config"] = raw["config"]
    out["machine"] = raw["machine"]
    out["run_seconds"] = raw["seconds"]
    out["raw"] = {"cost": cost, "e2e": e2e}
    return out


def _stage_medians(stages: Iterable[dict[str, float]]) -> dict[str, float]:
    rows = list(stages)
    keys = dict.fromkeys(k for r in rows for k in r)
    return {k: _median(r[k] for r in rows if k in r) for k in keys}


def _sweep_row(r: dict[str, Any]) -> dict[str, Any]:
    changed = max(1, r["changed"])
    bpc = {k: r[k] / changed for k in ("ours", *BASELINES)}
    best = min(bpc[k] for k in BASELINES)
    return {
        "workload": r["workload"],
        "density": r["changed"] / r["elements"],
        "elements": r["elements"],
        "bytes_per_changed": bpc,
        "ours_vs_best_baseline": bpc["ours"] / best,
    }


# ------------------------------------------------------------------------------------ markdown
def _table(headers: list[str], rows: list[list[str]]) -> str:
    aligns = ["---" if i == 0 else "---:" for i in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(aligns) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _ms(s: float) -> str:
    return f"{1000 * s:.1f} ms"


def markdown(s: dict[str, Any]) -> str:
    """Markdown tables of a summary (for BENCHMARKS.md)."""
    d, sec = s["details"], s["details"]["seconds"]
    cfg, m = s["config"], s["machine"]
    parts = [
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_bytes'] / 2**30:.0f} GiB, "
        f"{m['platform']}, Python {m['python']}, torch {m['torch']}. Run `{cfg['name']}`: "
        f"{d['elements']:,} elements ({d['model_bytes'] / _MB:.1f} MB publish view), "
        f"density {100 * d['density']:.2f} %, bucket {cfg['bucket_bytes'] / 2**20:g} MiB, "
        f"throttle {cfg['throttle']}, {cfg['versions']} timed versions, "
        f"{s['run_seconds']:.0f} s in all."
    ]
    rows = []
    for name, t in s["targets"].items():
        rows.append(
            [
                f"`{name}`",
                f"{t['value']:.3g}",
                f"{t['op']} {t['target']:g}",
                "pass" if t["pass"] else "**miss**",
            ]
        )
    parts.append("### Targets\n\n" + _table(["ratio", "measured", "target", ""], rows))

    keys = ("ours", *BASELINES)
    rows = []
    for r in d["sweep"]:
        b = r["bytes_per_changed"]
        rows.append(
            [
                r["workload"],
                f"{100 * r['density']:.2f} %",
                *(f"{b[k]:.3f}" if k != "ours" else f"**{b[k]:.3f}**" for k in keys),
                f"{r['ours_vs_best_baseline']:.2f}",
            ]
        )
    parts.append(
        "### Wire bytes per changed element\n\n"
        + _table(["workload", "changed", *(LABELS[k] for k in keys), "ours / best"], rows)
    )

    rows = [
        ["one `torch.ne` pass (floor)", _ms(sec["ne_pass"]), "1.00"],
        [
            "publish (unthrottled, pipelined)",
            _ms(sec["publish"]),
            f"{sec['publish'] / sec['ne_pass']:.2f}",
        ],
    ]
    for k, v in sec["publish_components"].items():
        rows.append([f"  component: {k}", _ms(v), f"{v / sec['ne_pass']:.2f}"])
    parts.append("### Publish cost\n\n" + _table(["", "seconds", "x ne pass"], rows))

    bound = sec["transfer_bound"]
    rows = [
        ["transfer bound (wire / bandwidth)", _ms(bound), "1.00"],
        [
            "bound + per-file latency (write and read)",
            _ms(sec["transfer_bound_with_latency"]),
            f"{sec['transfer_bound_with_latency'] / bound:.2f}",
        ],
        [
            "ours, pipelined + streaming receive",
            _ms(sec["e2e_pipelined"]),
            f"{sec['e2e_pipelined'] / bound:.1f}",
        ],
        [
            "  of which publish",
            _ms(sec["e2e_publish_part"]["pipelined"]),
            f"{sec['e2e_publish_part']['pipelined'] / bound:.1f}",
        ],
        [
            "ours, serialized stages",
            _ms(sec["e2e_serialized"]),
            f"{sec['e2e_serialized'] / bound:.1f}",
        ],
        [
            "full checkpoint (safetensors save + load)",
            _ms(sec["full_sync"]),
            f"{sec['full_sync'] / bound:.1f}",
        ],
    ]
    parts.append(
        f"### End to end over {cfg['throttle']} (publish start to ack; wire "
        f"{d['wire_bytes'] / _MB:.2f} MB in {d['shards']:g} shards)\n\n"
        + _table(["", "seconds", "x bound"], rows)
    )

    rec = sec["receive_components"]
    rows = [
        ["apply one version into a LocalCheckpoint (unthrottled)", _ms(sec["apply"])],
        ["  verify shards (checksum)", _ms(rec["verify"])],
        ["  decode", _ms(rec["decode"])],
        ["  checksum of every touched tensor", _ms(rec["checksum_model"])],
        ["flush to disk after the ack (background, not in the above)", _ms(sec["flush_after_ack"])],
        ["throughput: changed elements / s", f"{d['apply_changed_per_s'] / 1e6:.1f} M"],
        ["throughput: model bytes / s", f"{d['apply_model_bytes_per_s'] / _MB:.0f} MB"],
    ]
    parts.append("### Receiver apply\n\n" + _table(["", ""], rows))

    rows = []
    for side in ("publisher", "receiver"):
        r = d["rss"][side]
        rows.append(
            [
                side,
                f"{r['base_bytes'] / _MB:.0f} MB",
                f"{r['startup']:.2f}",
                f"{r['steady']:.2f}",
                f"**{r['peak']:.2f}**",
                f"{r['end_anon']:.2f} / {r['end_file']:.2f}",
                "-" if not (sp := r.get("peak_split")) else f"{sp['anon']:.2f} / {sp['file']:.2f}",
            ]
        )
    parts.append(
        "### Peak RSS above the baseline (after imports and a warm-up), / model bytes\n\n"
        + _table(
            [
                "",
                "baseline RSS",
                "start-up (seed / first sync)",
                "steady (deltas)",
                "peak",
                "at end: anon / file-backed",
                "at the sampled peak: anon / file-backed",
            ],
            rows,
        )
    )

    for side in ("publish", "receive"):
        p = s["details"]["profile"][side]
        rows = [
            [f"`{r['function']}`", str(r["calls"]), _ms(r["tottime"]), _ms(r["cumtime"])]
            for r in p["top"][:10]
        ]
        parts.append(
            f"### cProfile of one {side} (worker jobs inline; {_ms(p['seconds'])})\n\n"
            + _table(["function", "calls", "own", "cumulative"], rows)
        )
    return "\n\n".join(parts) + "\n"


# ------------------------------------------------------------------------------------ plots
def plot(s: dict[str, Any], directory: str | Path) -> list[Path]:
    """Write the PNG plots of a summary into ``directory``; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(directory)
    out_dir.mkdir(parents=True, exist_ok=True)
    d, sec = s["details"], s["details"]["seconds"]
    paths: list[Path] = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=80)
        plt.close(fig)
        paths.append(path)

    keys = ("ours", *BASELINES)
    fig, ax = plt.subplots(figsize=(8, 3.6))
    rows = d["sweep"]
    width = 0.8 / len(keys)
    for j, k in enumerate(keys):
        xs = [i + (j - len(keys) / 2 + 0.5) * width for i in range(len(rows))]
        ax.bar(xs, [r["bytes_per_changed"][k] for r in rows], width, label=LABELS[k])
    ax.set_xticks(range(len(rows)), [r["workload"] for r in rows], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("wire bytes / changed element")
    ax.legend(fontsize=7, ncol=2)
    save(fig, "bytes_per_changed.png")

    fig, ax = plt.subplots(figsize=(7, 3))
    labels = [
        "transfer bound",
        "bound + file latency",
        "ours pipelined",
        "ours serialized",
        "full checkpoint",
    ]
    values = [
        sec["transfer_bound"],
        sec["transfer_bound_with_latency"],
        sec["e2e_pipelined"],
        sec["e2e_serialized"],
        sec["full_sync"],
    ]
    ax.barh(labels, [1000 * v for v in values], color=["grey", "grey", "C0", "C1", "C3"])
    part = sec["e2e_publish_part"]
    ax.barh(
        labels[2:4],
        [1000 * part["pipelined"], 1000 * part["serialized"]],
        color="white",
        alpha=0.35,
        hatch="//",
        label="of which publish (until the manifest)",
    )
    ax.set_xlabel(f"ms, publish start to ack ({s['config']['throttle']})")
    ax.invert_yaxis()
    ax.legend(fontsize=7)
    save(fig, "latency.png")

    fig, ax = plt.subplots(figsize=(7, 3))
    comp = dict(sec["publish_components"])
    labels = ["ne pass (floor)", *(k for k in comp if k != "ne"), "publish total", "apply total"]
    values = [
        sec["ne_pass"],
        *(v for k, v in comp.items() if k != "ne"),
        sec["publish"],
        sec["apply"],
    ]
    ax.barh(labels, [1000 * v for v in values], color="C0")
    ax.axvline(2000 * sec["ne_pass"], color="red", linestyle="--", label="target: 2x ne pass")
    ax.set_xlabel("ms (unthrottled)")
    ax.invert_yaxis()
    ax.legend(fontsize=7)
    save(fig, "publish_cost.png")

    fig, ax = plt.subplots(figsize=(6, 2.8))
    names, startup, steady = [], [], []
    for side in ("publisher", "receiver"):
        r = d["rss"][side]
        names.append(side)
        startup.append(r["startup"])
        steady.append(r["steady"])
    xs = list(range(len(names)))
    ax.bar([x - 0.2 for x in xs], startup, 0.4, label="start-up")
    ax.bar([x + 0.2 for x in xs], steady, 0.4, label="steady (deltas)")
    for x, target in zip(xs, (2.5, 1.5), strict=True):
        ax.hlines(target, x - 0.45, x + 0.45, colors="red", linestyles="--")
    ax.set_xticks(xs, names)
    ax.set_ylabel("peak RSS above baseline / model")
    ax.legend(fontsize=7)
    save(fig, "memory.png")
    return paths
