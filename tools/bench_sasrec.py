"""SASRec benchmark on MovieLens 100K: flowrec's spec beside a plain-PyTorch SASRec of the same
shape, leave-last-out, full-catalogue HR@10 / NDCG@10 over seeds.

Data: specs/sasrec_movielens.yaml's binding (data options ``sequence: {max_len: L}``,
``split: leave_last_out``), converted once: per user, ratings by time; every rating after the
first is a (history = up to L previous movies, target = the movie) example; each user's last
example is the test row (943), the rest train. Both models read the same encoded train/ and test/
Parquet (movie ids are the table's rows 1 .. 1,682).

- flowrec: `flowrec.api.train` of the spec (self_attention causal, learned positions, output
  last, over the history; item tower = the target's row of the same table; dot product; in-batch
  softmax with logQ correction and accidental hits removed; Adam).
- plain: the same model written in plain PyTorch: one (1,683, D) embedding table (row 0 padding,
  DLRM-style uniform init as flowrec's tables), learned (L, D) positions (N(0, 0.02)),
  `torch.nn.TransformerEncoder` (post-norm, ReLU, ffn 4 D, dropout on the attention output and
  the feed-forward block, not on attention probabilities, as flowrec's), a causal mask plus a key
  padding mask, the state at the last non-empty position; the same loss written out (logits q.v_j
  - log p_j, p from training target counts with the same 0.5 floor, accidental hits -inf), dense
  `torch.optim.Adam` at the same lr, the same batch size and epochs, shuffled per epoch.

Both are scored by the same metric code (`ranking_metrics`): each test row ranks all 1,682 movies
(ties against the positive, nothing excluded); every user has one test row, so hr@10 = recall@10
and ndcg@10 is the per-user NDCG. The differences that remain are the init of the encoder's
linear layers, the lazy (touched-rows) sparse Adam of flowrec's table vs dense Adam, and the
shuffle order.

Usage:
    flock /tmp/bench.lock python tools/bench_sasrec.py [--seeds 0,1,2] [--epochs N] [--max-len L]
                                  [--batch B] [--json bench/results/sasrec_movielens_cpu.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F
import yaml
from torch import nn

from flowrec import api
from flowrec.data.convert import convert
from flowrec.runtime.evaluation.retrieval import ranking_metrics
from flowrec.spec import spec_from_dict

REPO = Path(__file__).resolve().parents[1]
SPEC = "sasrec_movielens"
TOP_K = (10,)
REPORTED = ("hr@10", "ndcg@10", "mrr")


def spec_doc(epochs: int | None, max_len: int | None, batch: int | None) -> dict[str, Any]:
    path = REPO / "specs" / f"{SPEC}.yaml"
    doc = yaml.safe_load(path.read_text())
    doc["data"]["path"] = str((path.parent / doc["data"]["path"]).resolve())
    if max_len is not None:
        next(f for f in doc["features"] if f["name"] == "history")["max_len"] = max_len
        doc["data"]["options"]["sequence"]["max_len"] = max_len
    if epochs is not None:
        doc["training"]["epochs"] = epochs
    if batch is not None:
        doc["training"]["batch_size"] = batch
    return doc


def shape(doc: dict[str, Any]) -> dict[str, Any]:
    enc = next(m for m in doc["modules"] if m["kind"] == "self_attention")
    table = doc["tables"][0]
    head = doc["heads"][0]
    return {"vocab": table["vocab"], "dim": table["dim"],
            "max_len": next(f for f in doc["features"] if f["name"] == "history")["max_len"],
            "heads": enc["num_heads"], "layers": enc["num_layers"], "dropout": enc["dropout"],
            "logq": bool(head.get("logq_correction")), "lr": doc["optimizer"]["dense"]["lr"],
            "batch": doc["training"]["batch_size"], "epochs": doc["training"]["epochs"]}


def read_split(folder: Path, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(history ids (N, L) right-padded with 0, target ids (N,)) of an encoded part."""
    t = pq.read_table(folder, columns=["history", "item_id"])
    hist = t.column("history").to_pylist()
    ids = np.zeros((len(hist), max_len), np.int64)
    for i, h in enumerate(hist):
        ids[i, :len(h)] = h[:max_len]
    return torch.from_numpy(ids), torch.from_numpy(t.column("item_id").to_numpy().astype(np.int64))


class PlainSASRec(nn.Module):
    def __init__(self, vocab: int, dim: int, max_len: int, heads: int, layers: int, dropout: float):
        super().__init__()
        self.items = nn.Embedding(vocab + 1, dim)
        bound = (1.0 / (vocab + 1)) ** 0.5
        nn.init.uniform_(self.items.weight, -bound, bound)
        self.positions = nn.Parameter(torch.randn(max_len, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        for enc_layer in self.encoder.layers:
            enc_layer.self_attn.dropout = 0.0  # flowrec drops no attention probabilities
        self.register_buffer("causal", torch.ones(max_len, max_len, dtype=torch.bool).triu(1), persistent=False)

    def query(self, hist: torch.Tensor) -> torch.Tensor:
        valid = hist > 0
        x = self.items(hist) + self.positions
        x = self.encoder(x, mask=self.causal, src_key_padding_mask=~valid, is_causal=True)
        last = valid.sum(1).clamp_min(1) - 1
        return x[torch.arange(len(hist)), last]


def in_batch_loss(q: torch.Tensor, v: torch.Tensor, items: torch.Tensor, log_p: torch.Tensor | None) -> torch.Tensor:
    logits = q @ v.T  # (B, B)
    if log_p is not None:
        logits = logits - log_p[items][None, :]
    hit = (items[:, None] == items[None, :]) & ~torch.eye(len(items), dtype=torch.bool)
    logits = logits.masked_fill(hit, float("-inf"))
    return F.cross_entropy(logits, torch.arange(len(items)))


def full_ranks(q: torch.Tensor, table: torch.Tensor, items: torch.Tensor, vocab: int) -> np.ndarray:
    scores = q @ table[1:vocab + 1].T  # (N, V): items 1 .. V
    pos = scores.gather(1, (items - 1).clamp(0, vocab - 1)[:, None])
    ranks = (scores >= pos).sum(1) - 1
    return ranks.numpy()


def train_plain(cfg: dict[str, Any], data: Path, seed: int) -> dict[str, Any]:
    started = time.perf_counter()
    torch.manual_seed(seed)
    hist, items = read_split(data / "train", cfg["max_len"])
    test_hist, test_items = read_split(data / "test", cfg["max_len"])
    model = PlainSASRec(cfg["vocab"], cfg["dim"], cfg["max_len"], cfg["heads"], cfg["layers"], cfg["dropout"])
    counts = np.bincount(items.numpy(), minlength=cfg["vocab"] + 1)[:cfg["vocab"] + 1].astype(np.float64)
    counts[0] = 0.0
    counts[1:] = np.maximum(counts[1:], 0.5)
    log_p = torch.log(torch.tensor(counts / counts.sum(), dtype=torch.float32).clamp_min(1e-30)) \
        if cfg["logq"] else None
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    gen = torch.Generator().manual_seed(seed)
    for _ in range(cfg["epochs"]):
        model.train()
        order = torch.randperm(len(items), generator=gen)
        for start in range(0, len(order), cfg["batch"]):
            idx = order[start:start + cfg["batch"]]
            q = model.query(hist[idx])
            loss = in_batch_loss(q, model.items(items[idx]), items[idx], log_p)
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        ranks = full_ranks(model.query(test_hist), model.items.weight, test_items, cfg["vocab"])
    m = ranking_metrics(ranks, np.arange(len(ranks)), cfg["vocab"], TOP_K)
    return {"seed": seed, "seconds": time.perf_counter() - started, "metrics": {k: m[k] for k in REPORTED},
            "samples": len(ranks)}


def train_flowrec(doc: dict[str, Any], data: Path, seed: int, out: Path) -> dict[str, Any]:
    started = time.perf_counter()
    run = api.train(spec_from_dict(doc), seed=seed, device="cpu", out=out, data=data)
    m = run.result.eval["next_item"]
    return {"seed": seed, "seconds": time.perf_counter() - started, "metrics": {k: m[k] for k in REPORTED},
            "samples": m["samples"]}


def summary(values: list[float]) -> dict[str, Any]:
    return {"mean": statistics.mean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "values": values}


def write(path: str, cfg: dict[str, Any], load_before: Any, seeds: list[int],
          runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Write the JSON report of the runs so far; returns the summaries."""
    summaries = {name: {k: summary([r["metrics"][k] for r in rs]) for k in REPORTED}
                 for name, rs in runs.items() if rs}
    out = {"spec": f"specs/{SPEC}.yaml", "protocol": "MovieLens 100K, per user by time, next-item examples with "
           f"up to {cfg['max_len']} previous movies, leave-last-out (943 test rows), every test row ranks all "
           "1,682 movies, nothing excluded", "shape": cfg,
           "machine": platform.machine(), "torch": torch.__version__, "threads": torch.get_num_threads(),
           "load_before": load_before, "load_after": os.getloadavg(), "seeds": seeds,
           "models": {name: {"summary": summaries[name], "runs": runs[name]} for name in summaries}}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=1) + "\n")
    return summaries


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--epochs", type=int, default=None, help="override the spec's epochs")
    parser.add_argument("--max-len", type=int, default=None, help="override the history length L")
    parser.add_argument("--batch", type=int, default=None, help="override the batch size")
    parser.add_argument("--models", default="flowrec,plain")
    parser.add_argument("--json", default=str(REPO / "bench" / "results" / "sasrec_movielens_cpu.json"))
    args = parser.parse_args()
    doc = spec_doc(args.epochs, args.max_len, args.batch)
    if not (Path(doc["data"]["path"]) / "u.data").is_file():
        print(f"MovieLens 100K not found at {doc['data']['path']}; nothing to measure")
        return 0
    seeds = [int(s) for s in args.seeds.split(",")]
    cfg = shape(doc)
    models = args.models.split(",")
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in models}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench_sasrec_") as tmp:
        data = Path(tmp) / "data"
        spec = spec_from_dict(doc)
        report = convert(spec, "movielens", [Path(doc["data"]["path"])], data)
        print(f"data: train {report.split['train']:,} rows, test {report.split['test']:,} rows", flush=True)
        for seed in seeds:
            for name in models:
                r = train_flowrec(doc, data, seed, Path(tmp) / f"run{seed}") if name == "flowrec" \
                    else train_plain(cfg, data, seed)
                runs[name].append(r)
                print(f"{name} seed {seed}: " + ", ".join(f"{k} {r['metrics'][k]:.4f}" for k in REPORTED)
                      + f" ({r['seconds']:.1f} s)", flush=True)
                write(args.json, cfg, load_before, seeds, runs)  # every finished run is kept
    summaries = write(args.json, cfg, load_before, seeds, runs)
    print(f"{'model':<10} " + " ".join(f"{k:>17}" for k in REPORTED))
    for name, s in summaries.items():
        print(f"{name:<10} " + " ".join(f"{s[k]['mean']:.4f} +- {s[k]['std']:.4f}" for k in REPORTED))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    from flowrec.testing.benchargs import run_stoppable

    raise SystemExit(run_stoppable(main))
