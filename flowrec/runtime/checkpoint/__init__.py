"""Checkpoint persistence: the file format (`format`), full checkpoints (`store`), deltas (`delta`),
the shards and manifests of a distributed run (`shards`, `ranks`), when and how a run checkpoints
(`checkpointer`) and dirty-row snapshots written in the background (`incremental`). Nothing here
imports the trainer; distributed code never imports this package."""
