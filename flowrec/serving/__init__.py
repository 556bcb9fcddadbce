"""Trained models outside training: the model package and scoring with it.

- `package`: the package format and its checks (manifest, digests, encoded inputs).
- `export`: write a package from a trained run (`flowrec export`).
- `predict`: score raw rows with a package (`flowrec predict`, `flowrec.load_model`); it and the
  format modules (`package`, `pt2_check`, `managed`) import nothing of `flowrec.runtime`.
- `trained`: restore a run's model for scoring and evaluation (imports the runtime).
- `lookups`: the serving model's embedding lookups, one per packed group.
- `pt2_save` / `pt2_check`: write a `torch.export` archive without copies; check an untrusted one.
- `managed`: the managed tables' maps inside a package.
"""
