"""Device profile documents: the cost model's constants measured on a machine (`flowrec calibrate`).

A profile document is JSON: the datasheet profile it starts from (`base`), the constants measured
here with how each was measured (`measured`: {field: {"value", "how"}}), the machine and the time.
A value is a number, or for the per-optimizer costs (`TABLES`) {optimizer: [numbers]}, or for the
measured dense ops (`OP_TABLES`) {op signature: [numbers]}, or for a per-length vector (`VECTORS`:
`epoch_lean_us`, by an epoch's batches) [numbers]. Fields not measured keep the base's
datasheet value and are listed under `datasheet`; older documents load with datasheet values for
what they lack (version 1: the per-op constants; version 2: the measured dense ops, the per-step
framework cost and the staging rate; a version 3 document without `compute_scale`: 1, without
`epoch_start_us` or `epoch_single_us`: 0, an epoch's start not priced; without `epoch_lean_us`:
none, every step priced as a mid-epoch one). The planner
loads a document given as `--target FILE` (`flowrec.planner.cost.device_profile`); the plan then
names the profile and says it is calibrated. The default place is the user's cache folder
(`$XDG_CACHE_HOME/flowrec/`, else `~/.cache/flowrec/`), one file per device kind.

Example:
    >>> doc = profile_document("cpu", {"hbm_gbps": (12.1, "copy 64 MiB")}, "x86_64", "2026-01-01T00:00:00Z")
    >>> profile_fields(doc, "p.json")["hbm_gbps"]
    12.1
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Mapping

from flowrec.graph.kinds import OPTIMIZERS
from flowrec.spec.json_doc import NotJsonError, read_json_document, version_problem

PROFILE_FORMAT = "flowrec-device-profile"
PROFILE_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
SCALARS = ("memory_bytes", "hbm_gbps", "pcie_gbps", "fp32_tflops", "bf16_tflops", "gemm_efficiency",
           "gather_rows_per_s", "host_gather_rows_per_s", "launch_us", "op_us", "elementwise_us",
           "elementwise_gbps", "gemm_us", "gemm_gbps", "gemm_bwd_us", "gemm_bwd_tflops", "gemm_bwd_gbps", "sparse_fwd_us", "sparse_fwd_ns_per_id",
           "sparse_fwd_ns_per_elem", "map_ns_per_id", "map_small_ns_per_id", "alloc_threshold_bytes",
           "alloc_ns_per_byte", "step_us", "staging_values_per_s", "collective_gbps", "collective_us",
           "collective_world_size", "compute_scale", "rank_compute_scale", "rank_staging_values_per_s", "rank_collective_us",
           "rank_skew_us", "rank_step_call_us", "rank_step_fixed_us", "rank_step_per_call_us", "managed_ns_per_id",
           "epoch_start_us", "epoch_single_us", "exchange_ns_per_slot", "upload_gbps", "upload_us")
INTEGERS = frozenset({"memory_bytes", "collective_world_size"})
COLLECTIVE = frozenset({"collective_gbps", "collective_us", "collective_world_size",
                        "rank_compute_scale", "rank_staging_values_per_s", "rank_collective_us",
                        "rank_skew_us", "rank_step_call_us", "rank_step_fixed_us",
                        "rank_step_per_call_us"})  # with --nproc only
LINK = frozenset({"upload_gbps", "upload_us"})  # the transfer stage's copies: None where the host is the device
SPEC_KIND = frozenset({"managed_ns_per_id"})  # measured only on a spec that has the kind (managed tables)
TABLES = {"dense_update": 2, "sparse_update": 5}  # per-optimizer cost vectors: field -> length
OP_TABLES = {"dense_ops": 3}  # per measured dense op (`op_work.op_signature`): (batch, fwd us, bwd us) points
VECTORS = {"epoch_lean_us": 8}  # one non-negative number per length 1 .. n (of an epoch, in batches)
MEASURABLE = SCALARS + tuple(TABLES) + tuple(OP_TABLES) + tuple(VECTORS)
ZERO_OK = frozenset({"sparse_fwd_us", "sparse_fwd_ns_per_id", "sparse_fwd_ns_per_elem", "gemm_us",
                     "gemm_bwd_us", "elementwise_us", "op_us", "map_ns_per_id", "map_small_ns_per_id",
                     "alloc_threshold_bytes", "alloc_ns_per_byte", "step_us",
                     "collective_us", "managed_ns_per_id", "rank_skew_us", "rank_step_fixed_us", "epoch_start_us",
                     "epoch_single_us", "exchange_ns_per_slot", "upload_us"})  # fitted parts a machine may show as nil
US_MAX = 1e8  # us: 100 s, longer than any one kernel, call or step a profile prices
NS_MAX = 1e9  # ns: 1 s per id, row or byte
GBPS = (1e-3, 1e6, "GB/s")  # a link or memory of 1 MB/s .. 1 PB/s
# plausible (low, high, unit) of each scalar constant: a value outside is a damaged or edited profile
# (`hbm_gbps: 1e-300` priced a step at nan ms, `memory_bytes: 1` a budget of -4 GiB)
PLAUSIBLE: dict[str, tuple[float, float, str]] = {
    "memory_bytes": (2.0 ** 26, 2.0 ** 50, "bytes (64 MiB .. 1 PiB)"),
    "alloc_threshold_bytes": (0, 2.0 ** 50, "bytes"),
    "fp32_tflops": (1e-4, 1e5, "TFLOP/s"), "bf16_tflops": (1e-4, 1e5, "TFLOP/s"), "gemm_bwd_tflops": (1e-4, 1e5, "TFLOP/s"),
    "gemm_efficiency": (1e-4, 10.0, "(a factor)"),
    "gather_rows_per_s": (1e2, 1e13, "rows/s"), "host_gather_rows_per_s": (1e2, 1e13, "rows/s"),
    "staging_values_per_s": (1.0, 1e13, "values/s"), "rank_staging_values_per_s": (1.0, 1e13, "values/s"),
    "compute_scale": (1e-3, 1e3, "(a factor)"), "rank_compute_scale": (1e-3, 1e3, "(a factor)"),
    "collective_world_size": (1, 1e6, "ranks"),
}


def plausible_range(key: str) -> tuple[float, float, str]:
    """(low, high, unit) a measured scalar `key` may take: its own, else by its unit's suffix."""
    if key in PLAUSIBLE:
        return PLAUSIBLE[key]
    if key.endswith("_gbps"):
        return GBPS
    if key.endswith("_us"):
        return (0, US_MAX, "us")
    if "_ns" in key:
        return (0, NS_MAX, "ns")
    raise KeyError(key)  # every scalar has a range (a test asks each)


class ProfileError(ValueError):
    """A device profile document that cannot be used; one line naming the file."""


def default_profile_path(kind: str) -> Path:
    """Where `flowrec calibrate` saves the profile of a device kind (cpu, cuda) by default."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "flowrec" / f"device-{kind}.json"


def profile_document(base: str, measured: Mapping[str, tuple[Any, str]], machine: str,
                     created: str, details: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The JSON document of a calibrated profile.

    Args:
        base: the datasheet profile whose unmeasured constants it keeps (cpu, a100, h100).
        measured: field -> (value, how it was measured); value None: not measurable here; a
            per-optimizer table (`TABLES`) as {optimizer: [numbers]}, a dense-op table
            (`OP_TABLES`) as {op signature: [numbers]}, a vector (`VECTORS`) as [numbers].
        machine: a description of the machine.
        created: ISO time of the measurement.
        details: raw measurements (per shape / per dim), kept for the reader.
    """
    unknown = sorted(set(measured) - set(MEASURABLE))
    if unknown:
        raise ValueError(f"not profile constants: {', '.join(unknown)}")
    return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "base": base, "machine": machine,
            "created": created, "measured": {k: {"value": v, "how": how} for k, (v, how) in measured.items()},
            "datasheet": sorted(set(MEASURABLE) - set(measured)), "details": dict(details or {})}


def read_profile(path: Path) -> dict[str, Any]:
    """Load a profile document. Raises ProfileError (one line naming the file)."""
    path = Path(path)
    try:
        doc = read_json_document(path)
    except NotJsonError:
        raise ProfileError(f"{path} is not a device profile (not JSON)") from None
    except ValueError as exc:  # names the file already
        raise ProfileError(f"{exc} (a device profile: make one with `flowrec calibrate`)") from None
    if not isinstance(doc, dict) or doc.get("format") != PROFILE_FORMAT:
        raise ProfileError(f"{path} is not a flowrec device profile (make one with `flowrec calibrate`)")
    if problem := version_problem(doc.get("version"), READABLE_VERSIONS):
        raise ProfileError(f"{path}: device profile {problem}")
    return doc


def profile_fields(doc: Mapping[str, Any], path: str) -> dict[str, Any]:
    """The measured constants of a document, checked: {field: value} (pcie_gbps may be None; the
    upload constants, None where the host is the device, are left out; a per-optimizer or dense-op
    table is a tuple of (optimizer or signature, (numbers)) pairs, sorted; a vector a tuple of numbers)."""
    measured = doc.get("measured")
    if not isinstance(measured, dict) or not isinstance(doc.get("base"), str):
        raise ProfileError(f"{path} is damaged: no base or measured constants")
    fields: dict[str, Any] = {}
    for key, entry in measured.items():
        value = entry.get("value") if isinstance(entry, dict) else entry
        if key not in MEASURABLE:
            raise ProfileError(f"{path}: {key} is not a device profile constant")
        if key in TABLES or key in OP_TABLES:
            fields[key] = _table(value, key, path)
        elif key in VECTORS:
            fields[key] = _vector(value, key, path)
        elif value is None and key == "pcie_gbps":
            fields[key] = None
        elif value is None and key in LINK:  # the host is the device: no copies (left at "not measured")
            continue
        else:
            fields[key] = _number(value, key, path)
    return fields


def _number(value: Any, key: str, path: str) -> int | float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not (
            value > 0 or (key in ZERO_OK and value == 0)):
        raise ProfileError(f"{path}: measured {key} must be a positive number, not {value!r}")
    low, high, unit = plausible_range(key)
    if not low <= value <= high:
        raise ProfileError(f"{path}: measured {key} is {value!r}, outside its plausible range {low:g} .. {high:g} "
                           f"{unit} (a damaged or edited profile? make one with `flowrec calibrate`)")
    if key in INTEGERS:
        if value != int(value):
            raise ProfileError(f"{path}: measured {key} must be a whole number, not {value!r}")
        return int(value)
    return float(value)


def _vector(value: Any, key: str, path: str) -> tuple[float, ...]:
    """A per-length vector: [VECTORS[key] finite non-negative numbers] (the n-th: a length of n)."""
    size = VECTORS[key]
    if (not isinstance(value, list) or len(value) != size
            or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x <= US_MAX for x in value)):
        raise ProfileError(f"{path}: measured {key} must be {size} finite non-negative numbers (at most {US_MAX:g} us), "
                           f"not {value!r}")
    return tuple(float(x) for x in value)


def _table(value: Any, key: str, path: str) -> tuple[tuple[str, tuple[float, ...]], ...]:
    """A per-optimizer cost table, {optimizer: [TABLES[key] non-negative numbers]}, or a dense-op
    table, {op signature: [points of OP_TABLES[key] non-negative numbers, one or more]}."""
    per_op = key in OP_TABLES
    size = OP_TABLES[key] if per_op else TABLES[key]
    keys, wanted = ("op signatures", f"a multiple of {size}") if per_op else ("optimizers", str(size))
    if not isinstance(value, dict) or not value:
        raise ProfileError(f"{path}: measured {key} must map {keys} to {wanted} numbers each")
    rows = []
    for name, numbers in sorted(value.items()):
        if not per_op and name not in OPTIMIZERS:
            raise ProfileError(f"{path}: measured {key} names {name!r}, not an optimizer "
                               f"(known: {', '.join(OPTIMIZERS)})")
        count = len(numbers) if isinstance(numbers, list) else -1
        if (count <= 0 or (count % size if per_op else count != size)
                or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x < math.inf
                       for x in numbers)):
            raise ProfileError(f"{path}: measured {key}[{name!r}] must be {wanted} finite non-negative numbers, "
                               f"not {numbers!r}")
        rows.append((str(name), tuple(float(x) for x in numbers)))
    return tuple(rows)


def is_profile_path(target: str) -> bool:
    """A `--target` value that names a profile file rather than a datasheet profile."""
    return target.endswith(".json") or os.sep in target
