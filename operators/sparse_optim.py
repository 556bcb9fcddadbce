"""Fused sparse optimizers: applied to the unique rows inside the embedding backward.

Optimizer state lives beside the rows it belongs to, in the packed layout: a (rows, k) tensor
indexed like the weight, so a cache moves a row together with its state. Widths per row (D = dim):
sgd 0, adagrad D (sum of squares), rowwise_adagrad 1 (sum of mean squares, as FBGEMM/TorchRec),
adam 2D + 1 (exp_avg, exp_avg_sq, per-row step count: lazy Adam, only touched rows step).

Two executors of the same formulas: on CPU tables, `casted_step` (gather-reduce of the casted
gradient and the update in one multi-threaded pass) and `step` run the numba kernels of
`operators.fused_sparse_cpu`; on other devices both run the torch ops of `update_rows`.

Example:
    >>> opt = make_optimizer(("rowwise_adagrad", 0.1, (("eps", 1e-8),)))
    >>> w, s = torch.ones(4, 2), opt.initial_state(4, 2, torch.float32)
    >>> opt.step(w, s, torch.tensor([1, 3]), torch.ones(2, 2))
    >>> round(float(w[1, 0]), 4), float(w[0, 0])
    (0.9, 1.0)
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Mapping

import numpy as np
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from operators import fused_sparse_cpu
from operators.casting import Casting, casted_row_grads

OptimizerTuple = tuple[str, float, tuple[tuple[str, float], ...]]


class SparseOptimizer(ABC):
    """A row-wise optimizer updating only the rows that received gradient.

    Args:
        lr: learning rate.
        params: hyper-parameters (eps, beta1, beta2, weight_decay, initial_accumulator_value).
    """

    name: str = ""
    defaults: Mapping[str, float] = {}

    def __init__(self, lr: float, params: Mapping[str, float] | None = None):
        unknown = set(params or {}) - set(self.defaults)
        if unknown:
            raise ValueError(f"{self.name}: unknown parameters {sorted(unknown)}; "
                             f"known: {sorted(self.defaults)}")
        self.lr = float(lr)
        self.params = {**self.defaults, **(params or {})}

    @abstractmethod
    def state_width(self, dim: int) -> int:
        """State elements per row."""

    def initial_state(self, rows: int, dim: int, dtype: torch.dtype,
                      device: torch.device | str | None = None) -> torch.Tensor:
        """Fresh state for `rows` rows.  # (rows, state_width(dim))"""
        return torch.zeros(rows, self.state_width(dim), dtype=dtype, device=device)

    def casted_step(self, weight: torch.Tensor, state: torch.Tensor, grad_out: torch.Tensor,
                    casting: Casting) -> None:
        """Apply the casted gradient of `grad_out` to the rows `casting.unique_ids` in place.

        Args:
            weight: the packed table.  # (R, D)
            state: its optimizer state.  # (R, k)
            grad_out: output gradient, one row per bag.  # (NB, D)
            casting: the batch's casting, on the table's device.
        """
        extra = () if casting.sorted_scale is None else (casting.sorted_scale,)
        if weight.device.type != "cpu" or not _plain(weight, state, grad_out, casting.unique_ids,
                                                     casting.sorted_bags, casting.unique_offsets, *extra):
            self.step(weight, state, casting.unique_ids, casted_row_grads(grad_out, casting))
        elif casting.unique_ids.numel():
            with _CpuRows(self, weight, state, casting.unique_ids) as (w, s, rows, hp, dtype):
                scale = casting.sorted_scale
                scale = _numpy(scale.to(dtype)) if scale is not None else np.empty(0, w.dtype)
                fused_sparse_cpu.fused_casted_update(
                    self.kernel_id, w, s, _numpy(grad_out.reshape(casting.num_bags, -1).to(dtype)),
                    _numpy(casting.sorted_bags), _numpy(casting.unique_offsets), rows, scale, hp,
                    self.betas64)

    def step(self, weight: torch.Tensor, state: torch.Tensor, rows: torch.Tensor,
             grads: torch.Tensor) -> None:
        """Update `weight[rows]` and `state[rows]` in place.

        Args:
            weight: the packed table.  # (R, D)
            state: its optimizer state.  # (R, k)
            rows: unique rows that received gradient.  # (U,) int64
            grads: their coalesced gradients.  # (U, D)
        """
        if weight.device.type != "cpu" or not _plain(weight, state, rows, grads):
            self.torch_step(weight, state, rows, grads)
        elif rows.numel():
            with _CpuRows(self, weight, state, rows) as (w, s, cpu_rows, hp, dtype):
                fused_sparse_cpu.fused_row_update(self.kernel_id, w, s, cpu_rows,
                                                  _numpy(grads.to(dtype)), hp, self.betas64)

    def hyper_parameters(self, dim: int, dtype: torch.dtype) -> np.ndarray:
        """The kernels' hyper-parameters (`fused_sparse_cpu.HP_FIELDS`) in `dtype`.  # (10,)"""
        p = self.params
        b1, b2 = p.get("beta1", 0.0), p.get("beta2", 0.0)
        values = (self.lr, p.get("eps", 0.0), p.get("weight_decay", 0.0), b1, b2, 1 - b1, 1 - b2,
                  0.0, 1.0, float(dim))
        return np.array(values, dtype=torch.empty(0, dtype=dtype).numpy().dtype)

    @property
    def kernel_id(self) -> int:
        """This optimizer's code in the CPU kernels."""
        return fused_sparse_cpu.KERNEL_IDS[self.name]

    @property
    def betas64(self) -> np.ndarray:
        """(beta1, beta2) in float64 for the kernels' bias corrections.  # (2,)"""
        return np.array([self.params.get("beta1", 0.0), self.params.get("beta2", 0.0)])

    def torch_step(self, weight: torch.Tensor, state: torch.Tensor, rows: torch.Tensor,
                   grads: torch.Tensor) -> None:
        """`step` with torch ops (any device): gather, `update_rows`, scatter."""
        w = weight.index_select(0, rows)  # (U, D)
        compute = torch.float32 if w.dtype in (torch.float16, torch.bfloat16) else w.dtype
        w32, g = w.to(compute), grads.to(compute)
        decay = self.params.get("weight_decay", 0.0)
        if decay:
            g = g + decay * w32
        s = state.index_select(0, rows) if state.shape[1] else state[:0]
        self.update_rows(w32, s, g)
        weight.index_copy_(0, rows, w32.to(weight.dtype))
        if state.shape[1]:
            state.index_copy_(0, rows, s)

    @abstractmethod
    def update_rows(self, w: torch.Tensor, s: torch.Tensor, g: torch.Tensor) -> None:
        """Update gathered rows `w` (U, D) and their state `s` (U, k) in place from grads `g`."""


class SGD(SparseOptimizer):
    """Plain SGD: w -= lr * g (torch.optim.SGD without momentum)."""

    name = "sgd"
    defaults = {"weight_decay": 0.0}

    def state_width(self, dim: int) -> int:
        return 0

    def update_rows(self, w, s, g):
        w.add_(g, alpha=-self.lr)


class Adagrad(SparseOptimizer):
    """Element-wise Adagrad as torch.optim.Adagrad (lr_decay 0): s += g^2; w -= lr g / (sqrt(s) + eps)."""

    name = "adagrad"
    defaults = {"eps": 1e-10, "weight_decay": 0.0, "initial_accumulator_value": 0.0}

    def state_width(self, dim: int) -> int:
        return dim

    def initial_state(self, rows, dim, dtype, device=None):
        init = self.params["initial_accumulator_value"]
        return torch.full((rows, dim), init, dtype=dtype, device=device)

    def update_rows(self, w, s, g):
        s.addcmul_(g, g)
        w.addcdiv_(g, s.sqrt().add_(self.params["eps"]), value=-self.lr)


class RowwiseAdagrad(SparseOptimizer):
    """Row-wise Adagrad (FBGEMM/TorchRec): s += mean(g^2) over the row; w -= lr g / (sqrt(s) + eps)."""

    name = "rowwise_adagrad"
    defaults = {"eps": 1e-8, "weight_decay": 0.0, "initial_accumulator_value": 0.0}

    def state_width(self, dim: int) -> int:
        return 1

    def initial_state(self, rows, dim, dtype, device=None):
        init = self.params["initial_accumulator_value"]
        return torch.full((rows, 1), init, dtype=dtype, device=device)

    def update_rows(self, w, s, g):
        s.add_(g.square().mean(dim=1, keepdim=True))  # (U, 1)
        w.addcdiv_(g, s.sqrt().add_(self.params["eps"]), value=-self.lr)


class LazyAdam(SparseOptimizer):
    """Lazy Adam: only touched rows step, each with its own step count (torch.optim.Adam's formula).

    State columns: exp_avg [0, D), exp_avg_sq [D, 2D), step [2D].
    """

    name = "adam"
    defaults = {"eps": 1e-8, "beta1": 0.9, "beta2": 0.999, "weight_decay": 0.0}

    def state_width(self, dim: int) -> int:
        return 2 * dim + 1

    def update_rows(self, w, s, g):
        dim = w.shape[1]
        b1, b2, eps = self.params["beta1"], self.params["beta2"], self.params["eps"]
        m, v, t = s[:, :dim], s[:, dim:2 * dim], s[:, 2 * dim:]
        t.add_(1)
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        bc1 = 1 - torch.pow(b1, t)  # (U, 1)
        bc2_sqrt = (1 - torch.pow(b2, t)).sqrt_()  # (U, 1)
        denom = v.sqrt().div_(bc2_sqrt).add_(eps)
        w.addcdiv_(m, denom.mul_(bc1), value=-self.lr)


def _plain(*tensors: torch.Tensor) -> bool:
    """Whether the CPU kernel can run: every tensor holds real data and no torch function or
    dispatch mode is tracing (fake tensors, a tracing wrapper); otherwise the same update runs as
    torch ops, so that it is traced."""
    if torch._C._is_torch_function_mode_enabled() or _get_current_dispatch_mode() is not None:
        return False
    return all(type(t) is torch.Tensor or type(t) is torch.nn.Parameter for t in tensors)


def _numpy(t: torch.Tensor) -> np.ndarray:
    """A C-contiguous numpy view (a copy only when `t` is not contiguous)."""
    return t.detach().contiguous().numpy()


class _CpuRows:
    """Arguments of a CPU kernel call over `rows`, and the write-back they need.

    float32/float64 tables are updated in place; fp16/bf16 tables (float32 state) are computed on
    float32 copies of the touched rows, written back on exit. Runs the kernels with torch's thread
    count.
    """

    def __init__(self, opt: SparseOptimizer, weight: torch.Tensor, state: torch.Tensor,
                 rows: torch.Tensor):
        self.weight, self.state, self.rows = weight, state, rows
        self.narrow = weight.dtype not in (torch.float32, torch.float64)
        self.dtype = torch.float32 if self.narrow else weight.dtype
        self.hp = opt.hyper_parameters(weight.shape[1], self.dtype)

    def __enter__(self):
        fused_sparse_cpu.use_threads(torch.get_num_threads())
        if not self.narrow:
            return (self.weight.detach().numpy(), self.state.detach().numpy(),
                    _numpy(self.rows.long()), self.hp, self.dtype)
        self.w = self.weight.index_select(0, self.rows).to(self.dtype)  # (U, D)
        self.s = self.state.index_select(0, self.rows)  # (U, k)
        local = np.arange(self.rows.numel(), dtype=np.int64)
        return self.w.numpy(), self.s.numpy(), local, self.hp, self.dtype

    def __exit__(self, *exc) -> None:
        if self.narrow and exc[0] is None:
            self.weight.index_copy_(0, self.rows, self.w.to(self.weight.dtype))
            if self.state.shape[1]:
                self.state.index_copy_(0, self.rows, self.s)


OPTIMIZERS: dict[str, type[SparseOptimizer]] = {
    cls.name: cls for cls in (SGD, Adagrad, RowwiseAdagrad, LazyAdam)
}


def make_optimizer(optimizer: OptimizerTuple) -> SparseOptimizer:
    """Build the fused optimizer of a group's (name, lr, params) tuple; unknown names list the known."""
    name, lr, params = optimizer
    if name not in OPTIMIZERS:
        raise KeyError(f"unknown sparse optimizer {name!r}; known: {sorted(OPTIMIZERS)}")
    return OPTIMIZERS[name](lr, dict(params))
