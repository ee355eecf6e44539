"""The scale sweep's summary, targets, markdown table and plots (see ``bench/scale.py``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from asyncsync.ops.bench.scale import summarise_size

__all__ = ["SCALE_TARGETS", "scale_markdown", "scale_plot", "scale_summary"]

_GB = 1 << 30

#: name -> (row key, comparison, bound, model size the target is checked at)
SCALE_TARGETS: dict[str, tuple[str, str, float, int]] = {
    "e2e_vs_floor": ("e2e_vs_floor", "<=", 1.5, _GB),
    "publish_vs_trainer_floor": ("publish_vs_trainer_floor", "<=", 1.5, _GB),
    "apply_vs_receiver_floor": ("apply_vs_receiver_floor", "<=", 1.5, _GB),
    "full_sync_vs_e2e": ("full_sync_vs_e2e", ">=", 10.0, _GB),
    "e2e_vs_trainer_floor": ("e2e_vs_trainer_floor", "<=", 2.5, _GB),  # issue 26
    "overlap": ("overlap", "<=", 1.3, _GB),
    "publish_cpu_s_per_gib": ("publish_cpu_s_per_gib", "<=", 0.6, _GB),
    "apply_cpu_s_per_gib": ("apply_cpu_s_per_gib", "<=", 0.4, _GB),
    "publisher_peak_rss_vs_model": ("publisher_peak_rss_vs_model", "<=", 2.2, 4 * _GB),
    "receiver_peak_rss_vs_model": ("receiver_peak_rss_vs_model", "<=", 1.2, 4 * _GB),
}
_LINEAR = 1.25  # seconds per GB at the largest size within this factor of the smallest


def scale_summary(raw_rows: list[dict[str, Any]], config: dict[str, Any]) -> dict[str, Any]:
    """``scale`` (one row per size) and ``scale_targets`` of the JSON summary."""
    rows = [
        summarise_size(r["size"], r["cost"], r["publisher"], r["receiver"], config)
        for r in raw_rows
    ]
    targets: dict[str, Any] = {}
    by_size = {r["model_bytes"]: r for r in rows}
    for name, (key, op, bound, at) in SCALE_TARGETS.items():
        row = _nearest(by_size, at)
        if row is None:
            continue
        value = row.get(key)
        if value is None:  # not measured (results of an older child)
            continue
        targets[name] = {
            "value": value,
            "op": op,
            "target": bound,
            "at_model_bytes": row["model_bytes"],
            "pass": value <= bound if op == "<=" else value >= bound,
        }
    if len(rows) >= 2:
        small, large = min(rows, key=_size), max(rows, key=_size)
        for what in ("publish", "apply"):
            ratio = large[f"{what}_s_per_gb"] / small[f"{what}_s_per_gb"]
            targets[f"{what}_linear"] = {
                "value": ratio,
                "op": "<=",
                "target": _LINEAR,
                "at_model_bytes": large["model_bytes"],
                "pass": ratio <= _LINEAR,
            }
    return {"scale": rows, "scale_targets": targets}


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _split(side: str, row: dict[str, Any]) -> str:
    """``receiver 1.08 (VmHWM, steady): sampled 1.07 = 0.02 + 1.05 + 0.00``."""
    sp = row.get(f"{side}_peak_rss_split")
    if not sp:
        return f"{side} not sampled"
    return (
        f"{side} {sp['vmhwm']:.2f} (VmHWM, {sp['phase']}): sampled {sp['rss']:.2f} = "
        f"{sp['anon']:.2f} + {sp['file']:.2f} + {sp['shmem']:.2f} ({sp['samples']} samples, "
        f"{1000 * sp['cpu_s']:.0f} ms CPU)"
    )


def _size(row: dict[str, Any]) -> int:
    return int(row["model_bytes"])


def _nearest(by_size: dict[int, dict[str, Any]], at: int) -> dict[str, Any] | None:
    """The row whose model is closest to ``at`` bytes (within 2x), or None."""
    if not by_size:
        return None
    size = min(by_size, key=lambda s: abs(math.log(s / at)))
    return by_size[size] if 0.5 <= size / at <= 2 else None


def scale_markdown(s: dict[str, Any]) -> str:
    rows = s.get("scale") or []
    if not rows:
        return ""

    def ms(x: float) -> str:
        return f"{1000 * x:,.0f}"

    head = [
        "model", "density", "wire", "trainer floor", "receiver floor", "transfer floor",
        "floor (shared / prod.)", "publish", "apply", "end to end", "full sync",
        "publish / trainer", "apply / receiver", "e2e / floor (shared / prod.)",
        "full / e2e", "e2e / trainer", "overlap", "CPU s/GiB pub / apply", "RSS pub / rec",
    ]  # fmt: skip
    lines = [
        "### Scale sweep (ms; ratios are medians of the timed versions of one run)",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in rows:
        cells = [
            f"{r['model_bytes'] / 1e9:.2f} GB",
            f"{100 * r['density']:.2f} %",
            f"{r['wire_bytes'] / 1e6:.1f} MB",
            ms(r["trainer_floor_s"]),
            ms(r["receiver_floor_s"]),
            ms(r["transfer_floor_s"]),
            f"{ms(r['floor_s'])} / {ms(r['floor_production_s'])}",
            ms(r["publish_s"]),
            ms(r["apply_s"]),
            ms(r["e2e_s"]),
            ms(r["full_sync_s"]),
            f"{r['publish_vs_trainer_floor']:.2f}",
            f"{r['apply_vs_receiver_floor']:.2f}",
            f"{r['e2e_vs_floor']:.2f} / {r['e2e_vs_production_floor']:.2f}",
            f"{r['full_sync_vs_e2e']:.1f}",
            _num(r.get("e2e_vs_trainer_floor")),
            _num(r.get("overlap")),
            f"{_num(r.get('publish_cpu_s_per_gib'))} / {_num(r.get('apply_cpu_s_per_gib'))}",
            f"{r['publisher_peak_rss_vs_model']:.2f} / {r['receiver_peak_rss_vs_model']:.2f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        f"\nreceiver {r['model_bytes'] / 1e9:.2f} GB (redo log {r.get('redo_log') or 'off'}): "
        f"apply CPU {_num(r.get('apply_cpu_s_per_gib'))} s/GiB per version (median), "
        f"{_num(r.get('apply_cpu_cycle_s_per_gib'))} s/GiB mean over the run with "
        f"{len(r.get('compactions') or [])} compactions; disk writes per version "
        f"{_num(r.get('disk_writes_per_version_vs_model'))}x the model"
        for r in rows
        if "apply_cpu_cycle_s_per_gib" in r
    ]
    lines += [
        f"\npeak RSS above the baseline / model at {r['model_bytes'] / 1e9:.2f} GB, split at the "
        f"sampled peak (anon + file + shmem): {_split('publisher', r)}; {_split('receiver', r)}"
        for r in rows
        if r.get("publisher_peak_rss_split") or r.get("receiver_peak_rss_split")
    ]
    targets = s.get("scale_targets") or {}
    if targets:
        lines += ["", "| scale target | at | value | target | |", "|---|---|---|---|---|"]
        for name, t in targets.items():
            mark = "pass" if t["pass"] else "**miss**"
            lines.append(
                f"| `{name}` | {t['at_model_bytes'] / 1e9:.2f} GB | {t['value']:.3g} | "
                f"{t['op']} {t['target']:g} | {mark} |"
            )
    return "\n".join(lines) + "\n"


def scale_plot(s: dict[str, Any], directory: str | Path) -> list[Path]:
    """Seconds per GB against model size, and the ratios to the floors against model size."""
    rows = sorted(s.get("scale") or [], key=_size)
    if not rows:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    gb = [r["model_bytes"] / 1e9 for r in rows]
    paths = []
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for key, label in (
        ("publish_s", "publish"),
        ("apply_s", "apply (to the ack)"),
        ("e2e_s", "end to end"),
        ("floor_s", "floor (shared cores)"),
        ("trainer_floor_s", "trainer floor (ne pass)"),
        ("receiver_floor_s", "receiver floor (dirty pages)"),
    ):
        ax.plot(gb, [r[key] / g for r, g in zip(rows, gb, strict=True)], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("model size (GB, bf16, ~3 % changed)")
    ax.set_ylabel("seconds per GB")
    ax.set_title("Cost per GB against model size")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / "scale_seconds_per_gb.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for key, label in (
        ("e2e_vs_floor", "end to end / floor"),
        ("publish_vs_trainer_floor", "publish / trainer floor"),
        ("apply_vs_receiver_floor", "apply / receiver floor"),
    ):
        ax.plot(gb, [r[key] for r in rows], marker="o", label=label)
    ax.axhline(1.5, color="grey", linestyle="--", linewidth=0.8, label="target 1.5")
    ax.set_xscale("log")
    ax.set_xlabel("model size (GB)")
    ax.set_ylabel("ratio")
    ax.set_title("Ratios to the physical floors")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / "scale_ratios.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
