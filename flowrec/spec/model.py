"""Typed, frozen model of a flowrec spec.

The loader (`flowrec.spec.load`) turns a validated YAML/JSON document into a `ModelSpec`;
`to_dict` turns it back into a plain document, so load -> dump -> load is the identity.
Everything here is plain Python: no torch, no dask, no cupy.

Example:
    >>> from flowrec.spec import load_spec
    >>> spec = load_spec("specs/dlrm_criteo.yaml")
    >>> [t.name for t in spec.tables][:2]
    ['C1', 'C2']
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Mapping

DenseTransform = Literal["none", "log1p", "standardize"]
Pooling = Literal["sum", "mean", "none"]
Truncate = Literal["first", "last"]  # which ids a list longer than max_len keeps
ModuleKind = Literal["mlp", "dot", "fm", "cross", "target_attention", "self_attention", "similarity", "linear", "concat",
                     "moe", "ple", "custom"]
OptimizerName = Literal["sgd", "adagrad", "rowwise_adagrad", "adam"]
TaskKind = Literal["binary", "regression", "multiclass", "retrieval"]
LossName = Literal["bce", "mse", "softmax_ce", "sampled_softmax"]
CachePolicy = Literal["auto", "none", "static_hot", "lookahead"]
EvictPolicy = Literal["lfu", "lru", "decayed_lfu"]
Precision = Literal["fp32", "bf16"]

# Module kinds with named outputs, and the parameter listing the names: a module input or a head
# reads one as "<module>.<name>" (e.g. "experts.click").
NAMED_OUTPUT_KINDS = {"moe": "heads", "ple": "heads"}


def split_output(token: str, kinds: Mapping[str, str]) -> tuple[str, str | None] | None:
    """The module (and named output) an input token names, given module name -> kind.

    Returns:
        (token, None) for a module; (module, output) for "<module>.<output>" of a module whose kind
        has named outputs (the output need not exist: callers check it); None otherwise.

    Example:
        >>> split_output("experts.click", {"experts": "moe"}), split_output("top", {"top": "mlp"})
        (('experts', 'click'), ('top', None))
    """
    if token in kinds:
        return token, None
    module, dot, output = token.rpartition(".")
    if dot and kinds.get(module) in NAMED_OUTPUT_KINDS:
        return module, output
    return None


# Module kinds whose output width is learned by importing their class and running it on the meta
# device when planning (`flowrec.runtime.custom`), stored as their `out_width` parameter.
DRY_RUN_KINDS = ("custom",)


def unresolved_modules(spec: "ModelSpec") -> list[str]:
    """Modules whose output width is still to be learned by a dry run (no `out_width` yet)."""
    return [m.name for m in spec.modules if m.kind in DRY_RUN_KINDS and m.param("out_width") is None]


# What the dry run measures of a module besides its width: its memory, which the planner counts.
# Measurements of the class, not the model: a run of a flowrec that measured none is the same model.
MEASURED_PARAMS = ("param_bytes", "buffer_bytes")


def identity_doc(doc: Any) -> Any:
    """A spec document (`to_dict`'s) without the MEASURED_PARAMS of its dry-run modules: what a
    plan's fingerprint, `--resume` and `--init-from` compare.

    >>> identity_doc({"modules": [{"name": "m", "kind": "custom", "out_width": 3, "param_bytes": 40}]})
    {'modules': [{'name': 'm', 'kind': 'custom', 'out_width': 3}]}
    """
    modules = doc.get("modules") if isinstance(doc, dict) else None
    if not isinstance(modules, list):
        return doc
    kept = [{k: v for k, v in m.items() if k not in MEASURED_PARAMS}
            if isinstance(m, dict) and m.get("kind") in DRY_RUN_KINDS else m for m in modules]
    return {**doc, "modules": kept}


# Built-in input selectors a module may name in `inputs` (besides features and modules).
SELECTOR_DENSE = "@dense"  # all dense features concatenated: (B, n_dense)
SELECTOR_SPARSE = "@sparse"  # all pooled categorical/multi-hot embeddings: (B, F, D) fields
SELECTOR_PREFIX = "@"  # "@<tag>": every feature carrying that tag
HISTORY_COLUMN = "history"  # the column of previous items that next-item data (option sequence) writes


class FrozenMapping(tuple):
    """A mapping inside module params or data options, frozen as sorted (key, value) pairs.

    A distinct type so that a frozen list of pairs and a frozen mapping stay apart when thawed.
    """


def thaw(value: Any) -> Any:
    """A frozen value as the document wrote it: FrozenMapping -> dict, tuple -> list (deeply)."""
    if isinstance(value, FrozenMapping):
        return {k: thaw(x) for k, x in value}
    if isinstance(value, tuple):
        return [thaw(x) for x in value]
    return value


@dataclass(frozen=True)
class DenseFeature:
    """A real-valued input column.

    Args:
        name: column / feature name.
        transform: applied at staging time (`log1p` clamps negatives to 0 first).
        fill: value used for missing entries before the transform.
        tags: free labels a module can select with `@tag`.
    """

    name: str
    transform: DenseTransform = "none"
    fill: float = 0.0
    tags: tuple[str, ...] = ()
    kind: Literal["dense"] = "dense"


@dataclass(frozen=True)
class SparseFeature:
    """A categorical (one-hot) or multi-hot / sequence input looked up in an embedding table.

    Args:
        name: column / feature name.
        table: name of the embedding table it reads (defaults to the feature's own table).
        max_len: 1 for one-hot; >1 for multi-hot / sequence features (ids per sample, padded/truncated).
        pooling: how a bag of ids reduces to one vector; `none` keeps the sequence (B, L, D)
            for target attention.
        tags: free labels a module can select with `@tag`.
        kind: categorical or sequence (the spec's `type`).
        truncate: which ids a raw list longer than max_len keeps: `first` (default) or `last`
            (the most recent items of a behaviour history).
    """

    name: str
    table: str
    max_len: int = 1
    pooling: Pooling = "sum"
    tags: tuple[str, ...] = ()
    kind: Literal["categorical", "sequence"] = "categorical"
    truncate: Truncate = "first"


Feature = DenseFeature | SparseFeature


@dataclass(frozen=True)
class ManagedSpec:
    """The id-to-row map of a managed (collisionless) table (`flowrec.data.managed`).

    Args:
        rows: capacity: raw ids holding a row at once (the table's rows).
        admit_min_count: occurrences before an id gets a row; until then it reads the default
            (an empty contribution) and trains nothing.
        evict: lfu, lru or decayed_lfu: the score by which ids keep their rows at an eviction pass.
        decay: decayed_lfu only: factor a count keeps per `every_steps` steps without the id.
        every_steps: map steps (batches) between eviction passes.
        ttl_steps: ids unseen for more than this many map steps lose their row (None: never).
        shards: virtual shards of the map (`flowrec.data.managed.ShardedMap`): shard s manages the
            rows r % shards == s with its own contest; under several ranks, the unit of ownership.
    """

    rows: int
    admit_min_count: int = 1
    evict: EvictPolicy = "lfu"
    decay: float = 0.5
    every_steps: int = 1000
    ttl_steps: int | None = None
    shards: int = 1


@dataclass(frozen=True)
class TableSpec:
    """An embedding table; several features may share one.

    Args:
        name: table name.
        rows: number of rows (vocabulary size or hash buckets, the missing-value row included).
        dim: embedding dimension (1 for wide / linear parts).
        hashed: True if raw values are hashed into `rows` buckets, False if mapped via a vocabulary.
        optimizer: sparse optimizer override for this table (None: the spec's sparse optimizer).
        dtype: storage dtype of the rows.
        min_freq: minimum count for a value to get its own vocabulary row (vocabulary tables).
        vocab_spare: rows reserved beyond the vocabulary (vocabulary tables; included in `rows`):
            data encoded later with a run's encoder gives unseen values the free rows after the
            vocabulary's last value (`flowrec.data.vocab_growth`).
        l2: L2 coefficient on the rows a step touches: each touched row's gradient gains l2 * row
            in the fused sparse update (added to its optimizer's weight_decay).
        managed: the id-to-row map of a managed table (None: a hashed or vocabulary table). A
            managed table has `managed.rows` rows and `hashed` False; its data holds raw-id hashes.
    """

    name: str
    rows: int
    dim: int
    hashed: bool = True
    optimizer: OptimizerSpec | None = None
    dtype: Literal["fp32", "fp16", "bf16"] = "fp32"
    min_freq: int = 1
    vocab_spare: int = 0
    l2: float = 0.0
    managed: ManagedSpec | None = None

    @property
    def vocab_size(self) -> int:
        """Values a fitted vocabulary keeps (rows 1..vocab_size); 0 for hashed and managed tables."""
        return 0 if self.hashed or self.managed else self.rows - 1 - self.vocab_spare

    @property
    def has_vocab(self) -> bool:
        """True for a vocabulary table (neither hashed nor managed)."""
        return not self.hashed and self.managed is None


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer and its hyper-parameters (lr, eps, betas, weight_decay...)."""

    name: OptimizerName
    lr: float
    params: tuple[tuple[str, float], ...] = ()

    def param(self, key: str, default: float) -> float:
        return dict(self.params).get(key, default)


@dataclass(frozen=True)
class ModuleSpec:
    """An interaction submodule; modules form a DAG through `inputs`.

    Args:
        name: unique module name.
        kind: one of `ModuleKind`.
        inputs: feature names, module names or selectors (`@dense`, `@sparse`, `@<tag>`).
        params: kind-specific settings, e.g. `layers` for mlp, `num_layers` for cross,
            `query`/`sequence` roles for target attention.
    """

    name: str
    kind: ModuleKind
    inputs: tuple[str, ...]
    params: tuple[tuple[str, Any], ...] = ()

    def param(self, key: str, default: Any = None) -> Any:
        return dict(self.params).get(key, default)

    def with_param(self, key: str, value: Any) -> "ModuleSpec":
        """This module with `key` set to `value` among its params (kept sorted, as the spec reads them)."""
        return replace(self, params=tuple(sorted({**dict(self.params), key: value}.items())))


@dataclass(frozen=True)
class TrainedWhere:
    """A head's task space: it trains (and is evaluated) only on rows whose `label` column equals
    `equals` (ESMM: the conversion head on clicked rows)."""

    label: str
    equals: float


@dataclass(frozen=True)
class Negatives:
    """The negatives of a retrieval head's softmax.

    Args:
        kind: ``in_batch`` (the batch's other items; the same item twice is not a negative) or
            ``sampled`` (`num` items drawn per step from the item table).
        num: items drawn per step (sampled only).
        distribution: ``uniform`` over the catalogue or ``unigram`` (by the item's frequency in
            the training data) (sampled only).
    """

    kind: Literal["in_batch", "sampled"] = "in_batch"
    num: int = 0
    distribution: Literal["uniform", "unigram"] = "uniform"


@dataclass(frozen=True)
class RetrievalSpec:
    """What a retrieval head adds: its negatives, logQ correction and the metrics' cut-offs.

    Args:
        negatives: in-batch or sampled.
        logq_correction: subtract log(expected count) of each candidate from its logit.
        top_k: cut-offs K of hr@K, recall@K and ndcg@K.
        exclude_seen: evaluation leaves out of each user's ranking the items the user has in the
            training data (users: `training.eval_group_by`).
    """

    negatives: Negatives = Negatives()
    logq_correction: bool = False
    top_k: tuple[int, ...] = (10, 100)
    exclude_seen: bool = False


@dataclass(frozen=True)
class HeadSpec:
    """A task head: a final projection of one module's output to its logits (one, or one per class
    of a multiclass head), plus its loss.

    Args:
        name: unique head name.
        input: the module it reads.
        task: binary, regression or multiclass.
        loss: bce, mse or softmax_ce (the task's).
        weight: weight of its loss in the total.
        label: label column (default: the data binding's label).
        sample_weight: a data column weighting each row's loss (None: 1 each).
        trained_where: its task space (None: every row).
        num_classes: classes of a multiclass head (its label holds 0 .. num_classes - 1).
        retrieval: negatives, logQ and cut-offs of a retrieval head (None for other tasks).
    """

    name: str
    input: str
    task: TaskKind = "binary"
    loss: LossName = "bce"
    weight: float = 1.0
    label: str | None = None  # label column; defaults to the data binding's label
    sample_weight: str | None = None
    trained_where: TrainedWhere | None = None
    num_classes: int | None = None
    retrieval: RetrievalSpec | None = None

    @property
    def width(self) -> int:
        """Logits per row: num_classes for a multiclass head, else 1 (a retrieval head's width is
        its two towers' widths, known from the graph: `flowrec.graph.build`)."""
        return self.num_classes or 1


@dataclass(frozen=True)
class ScheduleSpec:
    """A learning-rate factor per step: linear warmup from 0, then a decay.

    Args:
        warmup_steps: steps of linear warmup (factor (step + 1) / warmup_steps).
        decay: none, linear or cosine (to `min_lr_ratio` over `decay_steps`), or step.
        decay_steps: steps of linear/cosine decay after warmup (None: the rest of the run).
        min_lr_ratio: the factor at the end of linear/cosine decay.
        step_size: steps between decays of the step schedule.
        gamma: factor per `step_size` steps of the step schedule.
        apply_to: which learning rates follow it: both, dense or sparse.
    """

    warmup_steps: int = 0
    decay: Literal["none", "linear", "cosine", "step"] = "none"
    decay_steps: int | None = None
    min_lr_ratio: float = 0.0
    step_size: int = 1000
    gamma: float = 0.1
    apply_to: Literal["both", "dense", "sparse"] = "both"


@dataclass(frozen=True)
class EarlyStoppingSpec:
    """Stop when a head's evaluation metric stops improving.

    Args:
        metric: auc, gauc, pr_auc, logloss, ne, calibration, mse or mae.
        head: the head watched (None: the first head).
        mode: max or min (None: max for auc, gauc, pr_auc; min otherwise; calibration is
            compared as its distance from 1).
        patience: evaluations without improvement before stopping.
        min_delta: an improvement must exceed this.
    """

    metric: str
    head: str | None = None
    mode: Literal["max", "min"] | None = None
    patience: int = 3
    min_delta: float = 0.0


@dataclass(frozen=True)
class TrainingSpec:
    batch_size: int = 4096
    epochs: int = 1
    seed: int = 0
    precision: Precision = "fp32"
    eval_every: int = 0  # steps; 0 = only at the end
    deterministic: bool = False
    eval_group_by: str | None = None  # one-id categorical feature for gAUC
    clip_grad_norm: float | None = None  # max global L2 norm of the dense gradients
    schedule: ScheduleSpec | None = None
    early_stopping: EarlyStoppingSpec | None = None


FORMAT_ALIASES = {"criteo": "criteo_tsv", "avazu": "avazu_csv", "libfm": "libsvm"}  # short names, as the CLI takes them


@dataclass(frozen=True)
class DataSpec:
    """Optional binding of the spec to a dataset."""

    format: Literal["parquet", "criteo_tsv", "avazu_csv", "libsvm", "csv", "movielens"] | None
    path: str | None  # None: no data bound (label, columns and options only); train reads --data

    @property
    def bound(self) -> bool:
        """Whether the spec names data to train on (a path and its format)."""
        return self.path is not None
    label: str = "label"
    columns: tuple[tuple[str, str], ...] = ()  # feature name -> source column
    options: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class PlanHints:
    device: Literal["auto", "cpu", "cuda"] = "auto"
    target: str | None = None  # cost-model device profile: cpu, a100, h100 (None: from device)
    device_budget_bytes: int | None = None
    packing: bool = True
    cache: CachePolicy = "auto"
    window: int = 8  # lookahead window, batches
    micro_batches: int | Literal["auto"] = "auto"
    prefetch: int = 2  # batches staged ahead


@dataclass(frozen=True)
class ModelSpec:
    """The whole model: features, tables, modules, heads, optimizers, training, data, plan hints."""

    name: str
    features: tuple[Feature, ...]
    tables: tuple[TableSpec, ...]
    modules: tuple[ModuleSpec, ...]
    heads: tuple[HeadSpec, ...]
    dense_optimizer: OptimizerSpec
    sparse_optimizer: OptimizerSpec
    training: TrainingSpec = field(default_factory=TrainingSpec)
    data: DataSpec | None = None
    plan: PlanHints = field(default_factory=PlanHints)
    description: str = ""

    @property
    def dense_features(self) -> tuple[DenseFeature, ...]:
        return tuple(f for f in self.features if isinstance(f, DenseFeature))

    @property
    def sparse_features(self) -> tuple[SparseFeature, ...]:
        return tuple(f for f in self.features if isinstance(f, SparseFeature))

    def table(self, name: str) -> TableSpec:
        return self.table_map[name]

    @functools.cached_property
    def table_map(self) -> Mapping[str, TableSpec]:
        """Table name -> table, made once (`table` is asked per feature: a 1,000-table spec made 1,000 entries
        at each ask); not to be changed, as the spec is frozen (a plain dict: a spec pickles)."""
        return {t.name: t for t in self.tables}

    def table_optimizer(self, table: TableSpec) -> OptimizerSpec:
        """The table's sparse optimizer (its own or the spec's), its `l2` added to weight_decay."""
        opt = table.optimizer or self.sparse_optimizer
        if not table.l2:
            return opt
        params = dict(opt.params)
        params["weight_decay"] = params.get("weight_decay", 0.0) + table.l2
        return OptimizerSpec(opt.name, opt.lr, tuple(sorted(params.items())))
