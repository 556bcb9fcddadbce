"""Bad specs -> exact issues (path and message), every issue at once; the valid base passes."""
from __future__ import annotations

import copy
from typing import Any, Callable

import pytest

from flowrec.spec.validate import validate_document

BASE: dict[str, Any] = {
    "name": "mini",
    "features": [
        {"name": "d1", "type": "dense"},
        {"name": "d2", "type": "dense", "transform": "log1p"},
        {"name": "user", "type": "categorical", "hash_buckets": 100, "dim": 8},
        {"name": "item", "type": "categorical", "table": "items"},
        {"name": "hist", "type": "sequence", "table": "items", "max_len": 5, "pooling": "none"},
        {"name": "w", "type": "categorical", "vocab": 10, "dim": 1, "tags": ["wide"]},
    ],
    "tables": [{"name": "items", "vocab": 50, "dim": 8}],
    "modules": [
        {"name": "bottom", "kind": "mlp", "inputs": ["@dense"], "layers": [16, 8]},
        {"name": "att", "kind": "target_attention", "inputs": ["item", "hist"]},
        {"name": "inter", "kind": "dot", "inputs": ["bottom", "user", "item", "att"]},
        {"name": "wide", "kind": "linear", "inputs": ["@wide"], "out": 1},
        {"name": "top", "kind": "mlp", "inputs": ["inter", "bottom", "wide"], "layers": [8]},
    ],
    "heads": [{"name": "ctr", "input": "top"}],
    "optimizer": {"dense": {"name": "adam", "lr": 0.001}, "sparse": {"name": "adagrad", "lr": 0.01}},
}
UNUSED = ("is not used by any module (add it to a module's inputs, directly or through '@sparse', "
          "'@dense' or a tag, or remove it)")
TABLE_SIZE = "needs exactly one of 'vocab' or 'hash_buckets' (or 'table: <name>' to read a shared table)"

Mutation = Callable[[dict], None]
CASES: list[tuple[str, Mutation, list[tuple[str, str]]]] = [
    # --- schema ---
    ("dim_zero", lambda d: d["features"][2].update(dim=0), [("features[2].dim", "must be >= 1")]),
    ("dim_typo", lambda d: d["features"][2].update(dimm=d["features"][2].pop("dim")),
     [("features[2]", "unknown key 'dimm' (did you mean 'dim'?)"), ("features[2]", "missing required key 'dim'")]),
    ("pooling_enum", lambda d: d["features"][2].update(pooling="avg"),
     [("features[2].pooling", "must be one of sum, mean, none (got 'avg')")]),
    ("heads_missing", lambda d: d.pop("heads"), [("", "missing required key 'heads'")]),
    ("batch_size_type", lambda d: d.update(training={"batch_size": "big"}),
     [("training.batch_size", "must be an integer (got 'big')")]),
    ("lr_exponent_text", lambda d: d["optimizer"]["dense"].update(lr="1e-3"),
     [("optimizer.dense.lr", "must be a number (got '1e-3'); YAML reads exponents without a dot as text: "
                             "write e.g. 1.0e-3")]),
    ("vocab_and_hash", lambda d: d["features"][2].update(vocab=10), [("features[2]", TABLE_SIZE)]),
    ("no_table_size", lambda d: d["features"].__setitem__(2, {"name": "user", "type": "categorical"}),
     [("features[2]", "missing required key 'dim'"), ("features[2]", TABLE_SIZE)]),
    ("device_budget", lambda d: d.update(plan={"device_budget": "4 gigs"}),
     [("plan.device_budget", "must be a byte size such as 4GiB, 512MB or 1073741824 (at most 1 PiB)")]),
    ("micro_batches", lambda d: d.update(plan={"micro_batches": 0}),
     [("plan.micro_batches", "must be 'auto' or an integer in 1..4096")]),
    ("top_level_typo", lambda d: d.update(trainig={}), [("", "unknown key 'trainig' (did you mean 'training'?)")]),
    ("kind_param_on_wrong_kind", lambda d: d["modules"][2].update(layers=[4]), [("modules[2]", "unknown key 'layers' (known keys: inputs, kind, name)")]),
    ("attention_three_inputs", lambda d: d["modules"][1]["inputs"].append("user"),
     [("modules[1].inputs", "target_attention needs exactly two inputs: [query, sequence]")]),
    ("sequence_without_max_len", lambda d: d["features"][4].pop("max_len"),
     [("features[4]", "missing required key 'max_len'")]),
    ("min_freq_with_hash", lambda d: d["features"][2].update(min_freq=3),
     [("features[2]", "'min_freq' applies to vocabulary tables only, not with 'hash_buckets'")]),
    ("vocab_spare_with_hash", lambda d: d["features"][2].update(vocab_spare=3),
     [("features[2]", "'vocab_spare' applies to vocabulary tables only, not with 'hash_buckets'")]),
    ("vocab_spare_negative", lambda d: d["tables"][0].update(vocab_spare=-1),
     [("tables[0].vocab_spare", "must be >= 0")]),
    ("vocab_spare_on_shared_reader", lambda d: d["features"][3].update(vocab_spare=5),
     [("features[3].vocab_spare", "'vocab_spare' belongs on the shared table 'items', not on a feature reading it")]),
    ("dense_rowwise", lambda d: d["optimizer"]["dense"].update(name="rowwise_adagrad"),
     [("optimizer.dense.name", "must be one of sgd, adagrad, adam (got 'rowwise_adagrad') (did you mean 'adagrad'?)")]),
    ("adam_param_typo", lambda d: d["optimizer"]["dense"].update(betas=0.9),
     [("optimizer.dense", "unknown key 'betas' (did you mean 'beta2'?)")]),
    ("mlp_without_layers", lambda d: d["modules"][0].pop("layers"), [("modules[0]", "missing required key 'layers'")]),
    # --- semantic ---
    ("unknown_module", lambda d: d["modules"][4]["inputs"].__setitem__(1, "botom"),
     [("modules[4].inputs[1]", "unknown module 'botom' (did you mean 'bottom'?)")]),
    ("cycle", lambda d: d["modules"][0]["inputs"].append("top"),
     [("modules[0].inputs", "cycle bottom -> top -> inter -> bottom"),
      ("modules[0].inputs", "cycle bottom -> top -> bottom")]),
    ("duplicate_feature", lambda d: d["features"].append({"name": "user", "type": "dense"}),
     [("features[6].name", "duplicate feature name 'user' (first at features[2])")]),
    ("module_named_like_feature", lambda d: (d["modules"][3].update(name="w"), d["modules"][4]["inputs"].__setitem__(2, "w")),
     [("modules[3].name", "module name 'w' is also a feature (features[5]); inputs naming it would be ambiguous")]),
    ("empty_selector", lambda d: d["modules"][3].update(inputs=["@wdie"]),
     [("modules[3].inputs[0]", "selector '@wdie' matches nothing (no feature has the tag 'wdie') (did you mean '@wide'?)")]),
    # not also features[5] 'w' unused: the typo was meant to read it
    ("empty_dense_selector", lambda d: (d["features"].__delitem__(slice(0, 2)),
                                        d["modules"][0].update(inputs=["@dense", "user"])),
     [("modules[0].inputs[0]", "selector '@dense' matches nothing (there are no dense features)")]),
    ("dot_dims", lambda d: d["features"][2].update(dim=4),
     [("modules[2].inputs", "dot needs fields of equal dim, got dim 8: bottom, item, att; dim 4: user")]),
    ("attention_dims", lambda d: d["modules"][1]["inputs"].__setitem__(0, "w"),
     [("modules[1].inputs", "target_attention query 'w' has dim 1 but sequence 'hist' has dim 8")]),
    ("attention_query_dense", lambda d: d["modules"][1]["inputs"].__setitem__(0, "d1"),
     [("modules[1].inputs[0]", "the query of target_attention must be one pooled sparse feature or a module")]),
    ("table_dim_conflict", lambda d: d["features"][3].update(dim=16),
     [("features[3].dim", "feature 'item' says dim 16 but table 'items' has dim 8")]),
    ("table_and_vocab", lambda d: d["features"][3].update(vocab=50),
     [("features[3].vocab", "feature 'item' has both 'table' and an inline 'vocab'; use one of them")]),
    ("table_setting_on_feature", lambda d: d["features"][3].update(dtype="fp16"),
     [("features[3].dtype", "'dtype' belongs on the shared table 'items', not on a feature reading it")]),
    ("unknown_table", lambda d: d["features"][3].update(table="itemz"),
     [("features[3].table", "unknown table 'itemz' (did you mean 'items'?)")]),
    ("unused_table", lambda d: d["tables"].append({"name": "spare", "hash_buckets": 10, "dim": 8}),
     [("tables[1]", "table 'spare' is not used by any feature")]),
    ("inline_table_clash", lambda d: (d["features"][2].update(name="items"), d["modules"][2]["inputs"].__setitem__(1, "items")),
     [("features[2].name", "the inline table of feature 'items' clashes with tables[0]; write 'table: items' to "
                           "share it, or rename one")]),
    ("pooling_none_categorical", lambda d: d["features"][2].update(pooling="none"),
     [("features[2].pooling", "pooling 'none' is only for sequence features (type: sequence)"),
      ("modules[2].inputs[1]", "sequence feature 'user' has pooling none: only a target_attention module (as its "
                               "second input) or a self_attention module can read it")]),
    ("sequence_through_tag", lambda d: d["features"][4].update(tags=["wide"]),
     [("modules[3].inputs[0]", "sequence feature 'hist' (through '@wide') has pooling none: only a "
                               "target_attention module (as its second input) or a self_attention module can read it")]),
    ("head_unknown_module", lambda d: d["heads"][0].update(input="tpo"),
     [("heads[0].input", "unknown module 'tpo' (did you mean 'top'?)")]),
    # not also "sequence feature 'hist' has pooling none: only a target_attention module ... can read it"
    ("unknown_kind_reading_a_sequence", lambda d: d["modules"][1].update(kind="transformer"),
     [("modules[1].kind", "must be one of mlp, dot, fm, cross, target_attention, self_attention, similarity, "
                          "linear, concat, moe, ple, custom (got 'transformer')")]),
    ("head_reads_selector", lambda d: d["heads"][0].update(input="@sparse"),  # not also 'unknown module '@sparse''
     [("heads[0].input", "must be a name of ASCII letters, digits, '_', '.', ':' or '-' (not starting with '@' or "
                         "'-') (got '@sparse': '@' is not allowed)")]),
    ("head_reads_feature", lambda d: d["heads"][0].update(input="user"),
     [("heads[0].input", "'user' is a feature; a head reads a module's output")]),
    ("regression_bce", lambda d: d["heads"][0].update(task="regression", loss="bce"),
     [("heads[0].loss", "loss 'bce' needs task binary (use mse for regression)")]),
    ("unused_feature", lambda d: d["features"].append({"name": "extra", "type": "categorical", "hash_buckets": 9, "dim": 8}),
     [("features[6]", f"feature 'extra' {UNUSED}")]),
    ("module_not_reaching_head", lambda d: d["modules"].append({"name": "lonely", "kind": "mlp", "inputs": ["bottom"], "layers": [4]}),
     [("modules[5]", "module 'lonely' does not feed any head (its output would be unused)")]),
    ("data_columns_unknown", lambda d: d.update(data={"format": "csv", "path": "x.csv", "columns": {"usr": "user_id"}}),
     [("data.columns.usr", "unknown feature 'usr' (did you mean 'user'?)")]),
    ("data_path_without_format", lambda d: d.update(data={"path": "x.csv", "label": "clicked"}),
     [("data", "missing required key 'format' (needed with 'path')")]),
    ("heads_same_label", lambda d: d["heads"].append({"name": "cvr", "input": "top"}),
     [("heads[1].label", "heads 'ctr' and 'cvr' both train on label 'label'; give each head its own 'label'")]),
    # an encoded dataset holds features and label / weight columns by name: data conversion was a traceback
    ("feature_named_as_label", lambda d: d["features"][0].update(name="label"),
     [("features[0].name", "feature 'label' has the name of the label column of head 'ctr'; rename the feature "
                           "(data.columns can still map it to the column 'label')")]),
    ("feature_named_as_sample_weight", lambda d: d["heads"][0].update(sample_weight="d2"),
     [("features[1].name", "feature 'd2' has the name of the sample-weight column of head 'ctr'; rename the "
                           "feature (data.columns can still map it to the column 'd2')")]),
    ("repeated_input", lambda d: d["modules"][4]["inputs"].append("wide"),
     [("modules[4].inputs[3]", "input 'wide' is listed twice")]),
    # sparse SGD is plain SGD (`operators.sparse_optim.SGD`): training refused the momentum validate took
    ("sparse_sgd_momentum", lambda d: d["optimizer"].update(sparse={"name": "sgd", "lr": 0.1, "momentum": 0.9}),
     [("optimizer.sparse", "unknown key 'momentum' (known keys: lr, name, weight_decay)")]),
    ("table_sgd_momentum", lambda d: d["tables"][0].update(optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.5}),
     [("tables[0].optimizer", "unknown key 'momentum' (known keys: lr, name, weight_decay)")]),
    # a 300-character name validated, then train without --out failed: 'File name too long' (runs/<name>)
    ("name_too_long", lambda d: d.update(name="n" * 129),
     [("name", "must be at most 128 characters: it names the default run folder runs/<name>")]),
    ("name_at_the_limit", lambda d: d.update(name="n" * 128), []),
]


def _issues(doc: Any) -> list[tuple[str, str]]:
    return [(i.path, i.message) for i in validate_document(doc)]


def test_base_is_valid():
    assert _issues(copy.deepcopy(BASE)) == []


@pytest.mark.parametrize("name,mutate,expected", CASES, ids=[c[0] for c in CASES])
def test_bad_spec_reports_exactly(name, mutate, expected):
    doc = copy.deepcopy(BASE)
    mutate(doc)
    assert _issues(doc) == expected


def test_every_error_at_once():
    doc = copy.deepcopy(BASE)
    expected = []
    by_name = {c[0]: c for c in CASES}
    names = ("dim_zero", "batch_size_type", "unknown_module", "unknown_table", "module_not_reaching_head")
    for _, mutate, issues in (by_name[n] for n in names):
        mutate(doc)
        expected += issues
    assert sorted(_issues(doc)) == sorted(expected)


def test_a_feature_may_read_a_label_or_weight_column_under_another_name():
    doc = copy.deepcopy(BASE)
    doc["heads"][0].update(sample_weight="weight", label="clicked")
    doc["data"] = {"columns": {"d1": "weight", "d2": "clicked"}}
    assert _issues(doc) == []


@pytest.mark.parametrize("doc, first", [
    ({"name": "x"}, ("", "missing required key 'features'")),
    ({**BASE, "features": [{"name": "d1"}]}, ("features[0]", "missing required key 'type'")),
    ([BASE], ("", "the spec must be a mapping (got [")),
])
def test_spec_from_dict_of_an_invalid_document_raises_every_issue(doc, first):
    """flowrec.spec.spec_from_dict raised the KeyError or TypeError of the first missing value."""
    from flowrec.spec import SpecError, spec_from_dict

    with pytest.raises(SpecError) as caught:
        spec_from_dict(copy.deepcopy(doc))
    issue = caught.value.issues[0]
    assert issue.path == first[0] and issue.message.startswith(first[1]), issue


def test_str_of_issue_has_path():
    doc = copy.deepcopy(BASE)
    doc["features"][3]["dim"] = 0
    assert [str(i) for i in validate_document(doc)] == ["features[3].dim: must be >= 1"]


@pytest.mark.parametrize("doc", [None, [], "text", 3, {"features": "x"}, {"name": 1, "modules": [None]}])
def test_not_a_spec_gives_issues(doc):
    issues = validate_document(doc)
    assert issues and all(isinstance(i.message, str) for i in issues)


def test_optimizers_and_data_path_may_be_left_out():
    """A spec without `optimizer` (or with only one side) and a data binding without a path is
    valid; it loads the documented default optimizers, which spec.json (to_dict) then spells out,
    and a binding that names no data trains on --data (not `bound`)."""
    from flowrec.spec.load import spec_from_dict, to_dict

    doc = copy.deepcopy(BASE)
    del doc["optimizer"]
    doc["data"] = {"label": "clicked", "columns": {"user": "user_id"}}
    assert _issues(doc) == []
    spec = spec_from_dict(doc)
    assert (spec.dense_optimizer.name, spec.dense_optimizer.lr) == ("adam", 0.001)
    assert (spec.sparse_optimizer.name, spec.sparse_optimizer.lr) == ("rowwise_adagrad", 0.05)
    assert spec.data is not None and not spec.data.bound and spec.data.label == "clicked"
    written = to_dict(spec)
    assert written["optimizer"] == {"dense": {"name": "adam", "lr": 0.001},
                                    "sparse": {"name": "rowwise_adagrad", "lr": 0.05}}
    assert "path" not in written["data"] and "format" not in written["data"]
    assert _issues(written) == [] and spec_from_dict(written) == spec
    doc["optimizer"] = {"sparse": {"name": "adagrad", "lr": 0.1}}
    one_side = spec_from_dict(doc)
    assert (one_side.dense_optimizer.name, one_side.sparse_optimizer.name) == ("adam", "adagrad")
    assert one_side.sparse_optimizer.lr == 0.1


def test_a_gpu_asked_for_as_gpu_is_pointed_to_cuda_not_to_the_cpu_it_looks_like():
    # `plan: {device: gpu}` and `--device gpu` said "(did you mean 'cpu'?)": difflib's closest name, the
    # opposite of what a user asking for a GPU means
    from flowrec.runtime.session import device_problem
    from flowrec.spec.schema_errors import did_you_mean

    for word in ("gpu", "GPU", "Gpu"):
        assert did_you_mean(word, ["auto", "cpu", "cuda"]) == " (did you mean 'cuda'?)"
        assert device_problem(word).endswith("(did you mean 'cuda'?)")
    assert did_you_mean("cpy", ["auto", "cpu", "cuda"]) == " (did you mean 'cpu'?)"  # a look-alike as before
    assert did_you_mean("gpu", ["cpu", "a100", "h100"]) == ""  # `--target gpu`: no choice means it, the cpu least
    spec = {"name": "x", "features": [{"name": "a", "type": "categorical", "vocab": 5, "dim": 4}],
            "modules": [{"name": "m", "kind": "mlp", "inputs": ["@sparse"], "layers": [4]}],
            "heads": [{"name": "h", "input": "m", "task": "binary"}], "plan": {"device": "gpu"}}
    (message,) = [message for _, message in _issues(spec)]
    assert message.endswith("(got 'gpu') (did you mean 'cuda'?)"), message


def test_an_unknown_key_names_the_known_one_it_contains_or_lists_the_known_keys():
    from flowrec.spec.schema_errors import did_you_mean

    assert did_you_mean("batch_norm", ["inputs", "layers", "norm", "dropout"]) == " (did you mean 'norm'?)"
    assert did_you_mean("dropout-rate", ["inputs", "layers", "norm", "dropout"]) == " (did you mean 'dropout'?)"
    assert did_you_mean("hidden_units", ["inputs", "layers", "norm"]) == ""
    spec = {"name": "x", "features": [{"name": "a", "type": "categorical", "vocab": 5, "dim": 4}],
            "modules": [{"name": "m", "kind": "mlp", "inputs": ["@sparse"], "layers": [4], "hidden_units": [3],
                         "batch_norm": True}],
            "heads": [{"name": "h", "input": "m", "task": "binary"}]}
    got = dict((message.split(" (")[0], message) for _, message in _issues(spec))
    assert got["unknown key 'batch_norm'"].endswith("(did you mean 'norm'?)")
    listed = got["unknown key 'hidden_units'"].split("(known keys: ")[1].rstrip(")").split(", ")
    assert {"inputs", "layers", "norm", "dropout"} <= set(listed) and listed == sorted(listed)


def _named(doc: dict, name: str) -> dict:
    """`doc` with one more module, `name`, between the head's input and the head."""
    doc = copy.deepcopy(doc)
    doc["modules"].append({"name": name, "kind": "concat", "inputs": [doc["heads"][0]["input"]]})
    doc["heads"][0]["input"] = name
    return doc


@pytest.mark.parametrize("name,what", [
    ("loss", "the loss"), ("input_dense", "the dense input"), ("input_labels", "the labels"),
    ("ids_user", "the ids node of feature 'user'"), ("lookup_item", "the lookup node of feature 'item'"),
    ("pool_w", "the pool node of feature 'w'"), ("head_ctr", "the node of head 'ctr'"),
    ("emb_g0_d8", "a packed embedding group's node"), ("ids_g12_d1_items", "a packed embedding group's node"),
    ("packed_bottom_x2", "the kernel that packs module 'bottom' with MLPs of its shape"),
])
def test_a_module_named_like_a_node_of_the_graph_is_refused(name, what):
    """Such a module was another node of that name: validate said ok, then plan failed with a
    cycle or 'clashes with a built-in node', or (emb_<group>) training raised a traceback."""
    assert _issues(_named(BASE, name)) == [(f"modules[{len(BASE['modules'])}].name",
                                            f"module name {name!r} is the name of {what} in the operator graph; "
                                            "rename the module")]


@pytest.mark.parametrize("name", ["head_tower", "pool_users", "ids", "lookup_", "embedding", "g0_d8", "packed_x_x2"])
def test_a_module_name_like_a_node_name_but_no_node_is_accepted(name):
    assert _issues(_named(BASE, name)) == []


@pytest.mark.parametrize("spec", ["two_task", "din_taobao", "movielens", "mmoe_movielens"])
def test_every_node_name_of_a_plan_is_refused_as_a_module_name(spec):
    """The reserved names of `flowrec.spec.semantic` follow the graph's: every node of the spec's
    plans (packed and unpacked) that is not a module is refused as the name of a new module."""
    from pathlib import Path

    from flowrec.planner.manager import make_plan
    from flowrec.spec import spec_from_dict
    from flowrec.spec.read import read_document

    doc = read_document(Path(__file__).resolve().parents[2] / "specs" / f"{spec}.yaml")
    modules = {m["name"] for m in doc["modules"]}
    nodes = set()
    for packing in (True, False):
        plan = make_plan(spec_from_dict({**doc, "plan": {**doc.get("plan", {}), "packing": packing}}), target="cpu")
        nodes |= set(plan.graph) - modules
    assert any(n.startswith("packed_") for n in nodes) or spec not in ("two_task", "mmoe_movielens")
    for node in sorted(nodes):
        issues = _issues(_named(doc, node))
        assert any(path.endswith("].name") and "operator graph" in message for path, message in issues), node


def test_schema_errors_are_listed_in_document_order():
    """`data.columns` given as lists was reported in a set's order, another on each run (jsonschema
    collects the keys `additionalProperties` refuses in a set); now in the order the spec gives them."""
    doc = copy.deepcopy(BASE)
    names = ["dense", "categorical", "zeta", "alpha", "mid", "b2", "a1", "q", "k", "z0", "c", "m9"]
    doc["data"] = {"format": "csv", "path": "d.csv", "label": "y", "columns": {n: [n] for n in names}}
    doc["features"][2]["dim"] = 0  # before data in the document: listed first
    paths = [path for path, _ in _issues(doc) if path.startswith(("data.columns.", "features"))]
    assert paths == ["features[2].dim"] + [f"data.columns.{n}" for n in names]


@pytest.mark.parametrize("key, meant", [("seperator", "sep"), ("delimiter", "sep"), ("test_fration", "test_fraction"),
                                        ("spilt_seed", "split_seed"), ("encodng", "encoding"), ("squence_sep", "sequence_sep")])
def test_an_unknown_data_option_is_refused_naming_the_closest_known_one(key, meant):
    """data.options took any key and no reader read a typo (`seperator: ';'` read as commas)."""
    doc = copy.deepcopy(BASE)
    doc["data"] = {"format": "csv", "path": "x.csv", "label": "clicked", "options": {"sep": ",", key: ";"}}
    assert [str(i) for i in validate_document(doc)] == [f"data.options: unknown key {key!r} (did you mean {meant!r}?)"]


def test_every_data_option_a_reader_takes_is_known():
    """The options of the specs in specs/ and of every reader validate; a key far from all is listed
    with the known ones."""
    doc = copy.deepcopy(BASE)
    doc["data"] = {"format": "csv", "path": "x.csv", "label": "clicked", "options": {
        "sep": ";", "header": False, "names": ["a"], "encoding": "latin-1", "sequence_sep": "^", "test_fraction": 0.2,
        "split_seed": 1, "split_by": "ts", "split": "leave_last_out", "date_column": "day",
        "sequence": {"max_len": 20}, "feature_map": "map.txt", "fields": ["a"], "has_label": False, "chunk_bytes": 1024}}
    assert validate_document(doc) == []
    doc["data"]["options"] = {"xyzzy": 1}
    (issue,) = validate_document(doc)
    assert str(issue).startswith("data.options: unknown key 'xyzzy' (known keys: ") and "sep, " in str(issue)
