"""What the distributed tests share: running `flowrec` as a subprocess outside any launch,
comparing two runs' checkpoints, and per-rank models loaded from a (lazy) checkpoint state.

Example:
    >>> done = run_flowrec("plan", "spec.yaml", cwd=work, root=REPO, timeout_s=300)  # doctest: +SKIP
    >>> assert_same_model(work / "r1", work / "r2", tol=0.0)  # bitwise  # doctest: +SKIP
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import torch

from flowrec.testing.processes import run_bounded

LAUNCH_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# a custom module (file text) whose third training call raises KeyError on rank 1 (one process: RANK
# unset, as rank 1): a rank that fails of its own in the middle of training. FLAKY_ENV changes when:
# "never", or a file's path: in a launch's first attempt only, the file written as it fails (a rank
# that fails once, then trains on after the launcher's restart)
FLAKY_ENV = "FLOWREC_TEST_FLAKY"
FLAKY_MODULE = textwrap.dedent('''
    import os
    from pathlib import Path
    from torch import nn


    class Flaky(nn.Module):
        """Raises KeyError at its third training call on rank 1 (one process: RANK unset, as rank 1)."""
        def __init__(self, in_features):
            super().__init__()
            self.proj = nn.Linear(in_features, 3)
            self.calls = 0

        def forward(self, x):
            if self.training:
                self.calls += 1
                if self.calls == 3 and os.environ.get("RANK", "1") == "1" and fails():
                    raise KeyError("no such user")
            return self.proj(x)


    def fails():
        how = os.environ.get("FLOWREC_TEST_FLAKY")
        if how is None:
            return True
        if how == "never" or os.environ.get("TORCHELASTIC_RESTART_COUNT") != "0":
            return False
        Path(how).write_text("failed")
        return True
''')


def subprocess_env(root: Path) -> dict[str, str]:
    """This environment without a launch's variables, with `root` importable and one thread per process."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    return env


def run_flowrec(*args: str, cwd: Path, root: Path, timeout_s: float) -> subprocess.CompletedProcess:
    """`python -m flowrec ARGS` in `cwd` (`subprocess_env`), output captured, within `timeout_s`:
    past it the command is killed with its ranks and the test fails with what it printed
    (`processes.run_bounded`)."""
    return run_bounded([sys.executable, "-m", "flowrec", *args], cwd=cwd, env=subprocess_env(root), text=True,
                       capture_output=True, timeout_s=timeout_s)


def assert_same_model(a: Path, b: Path, tol: float = 1e-5) -> None:
    """Two runs' checkpoints hold the same position and parameters (`tol` 0: bitwise)."""
    from flowrec.runtime.checkpoint.store import load_checkpoint

    sa, sb = load_checkpoint(a), load_checkpoint(b)
    assert sa["position"] == sb["position"]
    assert sorted(sa["model"]) == sorted(sb["model"])
    for key, value in sa["model"].items():
        other = sb["model"][key]
        assert value.shape == other.shape, key
        same = torch.equal(value, other) if tol == 0 else torch.allclose(value, other, rtol=tol, atol=tol)
        assert same, (key, float((value - other).abs().max()))


def load_on_ranks(model_state: dict[str, Any], group: Any, world: int, seed: int = 9) -> list[torch.nn.Module]:
    """One model per rank of `world` (a `ShardedPackedEmbedding` `embeddings.g` of `group` and a
    zero buffer `ops.w`), each loaded from `model_state` by `load_whole_state`."""
    from flowrec.runtime.checkpoint.layout import load_whole_state
    from flowrec.runtime.distributed.sharded import ShardedPackedEmbedding

    models = []
    for rank in range(world):
        model = torch.nn.Module()
        model.embeddings = torch.nn.ModuleDict({"g": ShardedPackedEmbedding(group, world, rank, seed=seed)})
        model.ops = torch.nn.Module()
        model.ops.register_buffer("w", torch.zeros(2))
        load_whole_state(model, model_state)
        models.append(model)
    return models


def tiny_ranks_folder(root: Path, name: str, repo: Path, timeout_s: float) -> Path:
    """`root` holding the tiny spec (`flowrec.testing.specs.TINY`, named `name`, batch 50, 4 epochs,
    seed 7, its second head on label2) as spec.yaml and 600 synthetic rows of it in d/ (seed 3)."""
    import yaml

    from flowrec.testing.specs import TINY

    doc = copy.deepcopy(TINY)
    doc["name"] = name
    doc["training"] = {"batch_size": 50, "epochs": 4, "seed": 7}
    doc["heads"][1]["label"] = "label2"
    (root / "spec.yaml").write_text(yaml.safe_dump(doc))
    made = run_flowrec("data", "synth", "spec.yaml", "--rows", "600", "--out", "d", "--seed", "3", "-q", cwd=root,
                       root=repo, timeout_s=timeout_s)
    assert made.returncode == 0, made.stderr
    return root


def flaky_spec(folder: Path, seed: int) -> Path:
    """folder/s.yaml: a spec whose custom module is `FLAKY_MODULE` (written to folder/flaky.py) over
    two dense features and a 300-bucket categorical one, an MLP and one binary head, batch 32."""
    import yaml

    (folder / "flaky.py").write_text(FLAKY_MODULE)
    doc = {"name": "flaky",
           "features": [{"name": "x0", "type": "dense"}, {"name": "x1", "type": "dense"},
                        {"name": "user", "type": "categorical", "hash_buckets": 300, "dim": 8}],
           "modules": [{"name": "mine", "kind": "custom", "class": f"{folder / 'flaky.py'}:Flaky",
                        "inputs": ["@dense", "@sparse"], "params": {"in_features": 10}},
                       {"name": "top", "kind": "mlp", "inputs": ["mine"], "layers": [4]}],
           "heads": [{"name": "ctr", "input": "top"}],
           "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "adagrad", "lr": 0.05}},
           "training": {"batch_size": 32, "seed": seed}}
    (folder / "s.yaml").write_text(yaml.safe_dump(doc))
    return folder / "s.yaml"
