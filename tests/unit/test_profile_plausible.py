"""Device profiles with implausible constants and targets that are no target are refused at read
time, in one line naming the file, the key and the plausible range (plan15)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from flowrec.planner.calibration import SCALARS, ProfileError, plausible_range, profile_document
from flowrec.planner.cost import DEVICES, device_profile


def _profile(tmp_path: Path, name: str, **measured) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(profile_document("cpu", {k: (v, "edited") for k, v in measured.items()}, "test",
                                                "2026-01-01T00:00:00Z")))
    return str(path)


@pytest.mark.parametrize("key, value", [("hbm_gbps", 1e-300), ("memory_bytes", 1), ("step_us", 1e300),
                                        ("pcie_gbps", 1e12), ("fp32_tflops", 1e-9), ("gather_rows_per_s", 0.5),
                                        ("sparse_fwd_ns_per_id", 1e15), ("collective_world_size", 10**9)])
def test_an_implausible_constant_is_refused_naming_file_key_and_range(tmp_path, key, value):
    """`hbm_gbps: 1e-300` printed "nan ms overlapped", `memory_bytes: 1` "device budget -4.0 GiB",
    `step_us: 1e300` a 300-digit step time: taken as is."""
    path = _profile(tmp_path, "p.json", **{key: value})
    low, high, unit = plausible_range(key)
    with pytest.raises(ProfileError) as info:
        device_profile(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: measured {key} is {value!r}, outside its plausible range "
                              f"{low:g} .. {high:g} {unit}")


def test_every_constant_has_a_range_that_holds_the_datasheet_values(tmp_path):
    """Each scalar has a plausible range, and every datasheet profile's value lies in it: a profile
    measured anywhere a datasheet describes is taken."""
    for key in SCALARS:
        low, high, _ = plausible_range(key)
        assert 0 <= low < high
        for device in DEVICES.values():
            value = getattr(device, key, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value != 0:  # 0: not priced
                assert low <= value <= high, (device.name, key, value)
    measured = {k: getattr(DEVICES["h100"], k) for k in SCALARS
                if isinstance(getattr(DEVICES["h100"], k, None), (int, float)) and getattr(DEVICES["h100"], k) > 0}
    assert len(measured) > 10
    assert device_profile(_profile(tmp_path, "h.json", **measured)).hbm_gbps == DEVICES["h100"].hbm_gbps


def test_a_target_file_that_is_not_a_profile_says_what_a_target_is(tmp_path, monkeypatch):
    """`--target t2.yaml`, a file that exists, said "unknown target 't2.yaml'"."""
    monkeypatch.chdir(tmp_path)
    Path("t2.yaml").write_text("hbm_gbps: 3000\n")
    with pytest.raises(ProfileError) as info:
        device_profile("t2.yaml")
    message = str(info.value)
    assert message == ("t2.yaml is not a device profile (not JSON); a target is a datasheet name (cpu, a100, h100) "
                       "or a device profile, the JSON file `flowrec calibrate` writes")
    Path("t3").write_text(Path(_profile(tmp_path, "p.json", hbm_gbps=12.5)).read_text())
    assert device_profile("t3").hbm_gbps == 12.5  # a profile under another name is a profile
    with pytest.raises(ValueError, match="unknown target 'gpu9'"):
        device_profile("gpu9")  # no file of that name: a datasheet name that is none


def test_a_sample_rate_that_draws_no_row_is_refused():
    """`flowrec data profile --sample-rate 1e-300` sampled 0 rows and wrote a profile of nothing."""
    from flowrec.data.dataset import MemorySource, split_table
    from flowrec.data.profile import profile_access
    from flowrec.data.synth import SynthConfig, synth_table
    from flowrec.spec import spec_from_dict

    spec = spec_from_dict({
        "name": "hot", "features": [{"name": "c", "type": "categorical", "hash_buckets": 50, "dim": 4}],
        "modules": [{"name": "top", "kind": "mlp", "inputs": ["@sparse"], "layers": [4]}],
        "heads": [{"name": "ctr", "input": "top"}]})
    source = MemorySource(split_table(synth_table(spec, 500, SynthConfig(seed=1)), 2))
    with pytest.raises(ValueError) as info:
        profile_access(spec, source, sample_rate=1e-300)
    assert str(info.value).startswith("a sample rate of 1e-300 drew none of the data's 500 rows")
    assert profile_access(spec, source, sample_rate=0.5)["samples"] > 0


def test_a_profile_of_no_sampled_row_is_refused_by_plan(tmp_path):
    from flowrec.planner.manager import load_profile

    path = tmp_path / "empty.json"
    path.write_text(json.dumps({"format": "flowrec-access-profile", "version": 1, "spec": "hot", "sample_rate": 1e-300,
                                "samples": 0, "dataset_rows": 500, "tables": {},
                                "global": {"accesses": 0, "distinct": 0, "hot_cdf": [], "skew": 0}}))
    with pytest.raises(ValueError) as info:
        load_profile(path)
    assert str(info.value).startswith(f"{path}: the access profile sampled no rows (sample rate 1e-300)")
