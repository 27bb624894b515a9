"""Tables and JSON for estimates and for analytic-vs-measured comparisons."""

from __future__ import annotations

from typing import Any

from canntrain_core.memory.measure import Measurement
from canntrain_core.sizing.estimator import CATEGORIES, GiB, MemoryEstimate

# The tracker sees tensors, not categories of intent: at-peak comparison groups.
COMPARE_GROUPS: dict[str, tuple[str, ...]] = {
    "parameters": ("parameters",),
    "gradients": ("gradients",),
    "optimizer_states": ("optimizer_states",),
    "optimizer_step_temporaries": ("optimizer_step_temporaries",),
    # saved tensors, autocast copies, logits buffers and gathered FSDP blocks are all "activation-like"
    "activations": ("activations", "autocast_weight_copies", "logits_loss", "communication_buffers"),
}


def estimate_table(est: MemoryEstimate, capacity: float | None = None) -> str:
    """Per-category GiB at the peak, the total, and whether it fits ``capacity`` bytes."""
    lines = [f"{'category':30s} {'GiB':>10s}"]
    for c in CATEGORIES:
        lines.append(f"{c:30s} {est.categories[c] / GiB:10.2f}")
    lines.append(f"{'total (peak, ' + est.phase + ')':30s} {est.total / GiB:10.2f}")
    lines.append(f"{'model states (params+grads+opt)':30s} {est.model_states / GiB:10.2f}")
    if est.host_bytes:
        lines.append(f"{'host memory (offloaded)':30s} {est.host_bytes / GiB:10.2f}")
    if capacity:
        verdict = "fits" if est.fits(capacity) else "does NOT fit"
        lines.append(f"{verdict} in {capacity / GiB:.1f} GiB ({est.total / capacity:.0%} used)")
    lines += [f"note: {n}" for n in est.notes]
    return "\n".join(lines)


def compare_rows(est: MemoryEstimate, meas: Measurement) -> list[dict[str, Any]]:
    """Rows (name, analytic bytes, measured bytes, relative error) for a side-by-side table."""
    rows = []
    for group, cats in COMPARE_GROUPS.items():
        a = sum(est.categories[c] for c in cats)
        rows.append(_row(f"{group} (at peak)", a, meas.categories.get(group, 0)))
    rows.append(_row("model states (full step)", est.model_states, meas.model_states))
    rows.append(_row("total peak (tracked)", est.tracked_total, meas.peak))
    return rows


def _row(name: str, analytic: int, measured: int) -> dict[str, Any]:
    tiny = analytic < 2**20 and measured < 2**20  # both nothing (step counters at most)
    err = None if tiny or not measured else (analytic - measured) / measured
    return {"name": name, "analytic": int(analytic), "measured": int(measured), "rel_error": err}


def compare_table(est: MemoryEstimate, meas: Measurement) -> str:
    lines = [f"{'':32s} {'analytic GiB':>12s} {'measured GiB':>12s} {'error':>8s}"]
    for r in compare_rows(est, meas):
        err = "" if r["rel_error"] is None else f"{r['rel_error']:+.1%}"
        lines.append(f"{r['name']:32s} {r['analytic'] / GiB:12.3f} {r['measured'] / GiB:12.3f} {err:>8s}")
    lines.append(f"analytic peak in {est.phase}; fake-mode measurement took {meas.seconds:.1f} s")
    return "\n".join(lines)


def to_json(est: MemoryEstimate, meas: Measurement | None = None, capacity: float | None = None) -> dict[str, Any]:
    """One JSON-able object: bytes per category per method."""
    out: dict[str, Any] = {"analytic": est.to_dict() | {"model_states": est.model_states, "states": est.states}}
    if capacity:
        out["capacity"] = int(capacity)
        out["fits"] = est.fits(capacity)
    if meas is not None:
        out["measured"] = {
            "categories": meas.categories,
            "peak": meas.peak,
            "model_states": meas.model_states,
            "states": meas.states,
            "seconds": round(meas.seconds, 2),
            "tracker_raw": meas.raw_peak,
        }
        out["comparison"] = compare_rows(est, meas)
    return out
