"""`save_program` writes the same model.pt2, byte for byte, as `torch.export.save` (weights written
from their storages instead of `bytes` copies), and the program it wrote loads and runs."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowrec.serving.pt2_save import save_program, zero_copy_supported
from flowrec.testing.processes import run_bounded


class _Tables(torch.nn.Module):
    """Weights of several dtypes and sizes, two views of one storage, a buffer."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        packed = torch.randn(300, 8, generator=gen)
        self.a = torch.nn.Parameter(packed[:200], requires_grad=False)
        self.b = torch.nn.Parameter(packed[200:], requires_grad=False)
        self.c = torch.nn.Parameter(torch.randn(50, 4, generator=gen).half(), requires_grad=False)
        self.register_buffer("scale", torch.arange(1.0, 9.0))
        self.proj = torch.nn.Linear(8, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.a[ids] + self.b[ids % 100] * self.scale  # (B, 8)
        return self.proj(rows) + self.c[ids % 50].float().sum(1, keepdim=True)  # (B, 2)


@pytest.mark.filterwarnings("ignore:No complete tensor found")  # torch says so of the two views
@pytest.mark.skipif(not zero_copy_supported(), reason="this torch lacks the pieces save_program patches")
def test_the_archive_equals_torch_export_save_byte_for_byte(tmp_path: Path):
    program = torch.export.export(_Tables().eval(), (torch.tensor([1, 5, 7]),))
    (tmp_path / "plain").mkdir()
    (tmp_path / "direct").mkdir()
    torch.export.save(program, tmp_path / "plain" / "model.pt2")
    assert save_program(program, tmp_path / "direct" / "model.pt2") is True
    plain = (tmp_path / "plain" / "model.pt2").read_bytes()
    assert (tmp_path / "direct" / "model.pt2").read_bytes() == plain and len(plain) > 300 * 8 * 4
    ids = torch.tensor([0, 199, 42])  # the batch size it was exported with
    loaded = torch.export.load(tmp_path / "direct" / "model.pt2").module()
    assert torch.equal(loaded(ids), program.module()(ids))


def test_the_private_save_is_restored_after_the_call(tmp_path: Path):
    from torch.export.pt2_archive import _package

    before = _package._save_raw_tensors
    program = torch.export.export(_Tables().eval(), (torch.tensor([1]),))
    save_program(program, tmp_path / "model.pt2")
    assert _package._save_raw_tensors is before


FAILED_WRITE = """
import resource, sys, torch
sys.path.insert(0, {test_dir!r})
from test_pt2_save import _Tables
from flowrec.serving.pt2_save import save_program
program = torch.export.export(_Tables().eval(), (torch.tensor([1]),))
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # a disk that fills after 4 KiB
try:
    save_program(program, {out!r})
except Exception as exc:
    print("failed:", type(exc).__name__, flush=True)
    sys.exit(2)
print("written", flush=True)
"""


def test_a_write_that_fails_is_an_exception_not_an_abort_at_exit(tmp_path: Path):
    """A full disk while model.pt2 was written printed export's one-line error, then the process
    aborted (exit 134, 'terminate called after throwing an instance of c10::Error'): torch left the
    archive open and its C++ destructor failed again at teardown."""
    import sys

    code = FAILED_WRITE.format(test_dir=str(Path(__file__).parent), out=str(tmp_path / "model.pt2"))
    done = run_bounded([sys.executable, "-c", code], capture_output=True, text=True, timeout_s=120)
    assert "failed:" in done.stdout and done.returncode == 2, (done.returncode, done.stdout, done.stderr[-2000:])
    assert "terminate called" not in done.stderr
