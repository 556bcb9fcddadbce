"""`flowrec train --report`: where the time and the bytes went, next to what the planner predicted.

Returns data (lines of text); only the CLI prints.

Example:
    >>> lines = run_report(result, plan, batch_size=4096)  # doctest: +SKIP
"""
from __future__ import annotations

from typing import Any

from flowrec.spec.units import counted, format_bytes

FLOAT_BYTES = 4  # dense features and labels travel as float32


def measured_h2d_per_step(result: Any, n_dense: int, n_heads: int, batch_size: int, steps: int | None = None) -> float:
    """Host->device bytes per step: cache/host traffic of every group plus what the transfer stage
    copied a step (dense features, labels, device groups' ids, offsets and castings) where it
    copies (a GPU); on the CPU, where nothing is copied, dense features and labels as the plan
    counts them. `steps`: the steps the transfer bytes were copied in (default: result.steps; a
    resumed run's are those since the resume)."""
    groups = sum(c["h2d_bytes_per_step"] + c["d2h_bytes_per_step"] for c in result.counters.values())
    if result.transfer_bytes:
        return groups + result.transfer_bytes / max(result.steps if steps is None else steps, 1)
    return groups + batch_size * (n_dense + n_heads) * FLOAT_BYTES


def run_report(result: Any, plan: Any, batch_size: int, n_dense: int, n_heads: int,
               first_step: int = 0) -> list[str]:
    """Measured step time, stage seconds, traffic and hit rates beside the plan's predictions.
    `first_step`: the step a resumed run went on from; `result.steps` counts the run's steps, its
    seconds those since the resume, so the measured times are per step since then."""
    cost = plan.cost
    trained = result.steps - first_step
    steps = max(trained, 1)
    compute_ms = result.stage_seconds.get("compute", 0.0) / steps * 1e3
    wall_ms = result.seconds / steps * 1e3
    since = f" since the resume at step {first_step:,}" if first_step else ""
    lines = [
        f"report ({counted(trained, 'step')}{since}, batch {batch_size}; predictions for target {cost.target})",
        f"  predicted from constants {cost.constants}; access profile {cost.access_profile}",
        f"  step time      measured {wall_ms:9.2f} ms wall, {compute_ms:9.2f} ms compute   "
        f"predicted {cost.step_ms_overlap:9.2f} ms overlapped, {cost.step_ms_serial:9.2f} ms serial",
        f"  samples/s      measured {result.samples_per_s:12,.0f}               predicted {cost.samples_per_s:12,.0f}",
        "  stage seconds  " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(result.stage_seconds.items())),
        "  predicted ms   " + ", ".join(f"{k} {v:.2f}" for k, v in cost.stage_ms),
    ]
    if result.counters or result.transfer_bytes:
        measured = measured_h2d_per_step(result, n_dense, n_heads, batch_size, steps)
        lines.append(f"  host->device   measured {format_bytes(measured)} per step   "
                     f"predicted {format_bytes(cost.h2d_bytes_per_step)} per step")
    if result.counters:
        expected = {g.name: g.expected_hit_rate for g in plan.meta.groups}
        for name, c in sorted(result.counters.items()):
            stalls = ", ".join(f"{k} {v:.2f} s" for k, v in sorted(c["stall_s"].items())) or "none"
            lines.append(f"  {name:<14} {c['placement']:<10} hit rate {c['hit_rate']:.3f} "
                         f"(predicted {expected.get(name, 1.0):.3f}), h2d {format_bytes(c['h2d_bytes_per_step'])}/step, "
                         f"d2h {format_bytes(c['d2h_bytes_per_step'])}/step, stalls {stalls}")
    else:
        lines.append("  every table is resident on the device: no host<->device row traffic")
    return lines
