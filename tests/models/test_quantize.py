"""QLoRA's 4-bit base (``models/quantize.py``): the estimator's NF4 bytes are what bitsandbytes stores, a layer
computes what its dequantized weights compute, and where bitsandbytes cannot run the refusal is one line."""

from __future__ import annotations

import sys

import pytest
import torch

from canntrain_core.errors import BadInput
from canntrain_core.models.quantize import bitsandbytes_or_refuse, quantize_base_4bit
from canntrain_core.sizing.setup import nf4_bytes

bnb = pytest.importorskip("bitsandbytes")


def test_nf4_bytes_are_what_bitsandbytes_stores():
    """Half a byte a weight, an 8-bit scale per 64 and an fp32 scale per 256 of those: bitsandbytes' own tensors
    (its two 16- and 256-entry code books aside, 1,088 bytes a matrix)."""
    w = torch.randn(512, 256)
    p = bnb.nn.Params4bit(w, requires_grad=False, blocksize=64, compress_statistics=True, quant_type="nf4").to("cpu")
    qs = p.quant_state
    stored = p.numel() * p.element_size() + qs.absmax.numel() + qs.state2.absmax.numel() * 4
    assert stored == nf4_bytes(w.numel())


def test_a_quantized_block_computes_its_dequantized_weights_and_keeps_its_gradients():
    """Every frozen linear of the blocks becomes an NF4 Linear4bit; the input's gradient flows through it, also after
    the model ran in eval mode (bitsandbytes' CPU inference repacking, which has no backward, stays off)."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(128, 256, bias=False), torch.nn.Linear(256, 128, bias=False)

        def forward(self, x):
            return self.down(torch.relu(self.up(x)))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block(), Block()])

        def layers(self):
            return self.blocks

    torch.manual_seed(0)
    model = Model().requires_grad_(False).to(torch.bfloat16)
    assert quantize_base_4bit(model, torch.bfloat16, torch.device("cpu")) == 4 * 128 * 256
    assert all(type(m) is bnb.nn.Linear4bit for b in model.blocks for m in (b.up, b.down))
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        model.eval()
        want = x
        for b in model.blocks:
            up = bnb.functional.dequantize_4bit(b.up.weight.data, b.up.weight.quant_state)
            down = bnb.functional.dequantize_4bit(b.down.weight.data, b.down.weight.quant_state)
            want = torch.relu(want @ up.t()) @ down.t()
        assert torch.equal(model.blocks[1](model.blocks[0](x)), want)
    model.train()
    x.requires_grad_(True)
    model.blocks[1](model.blocks[0](x)).float().square().sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_where_bitsandbytes_cannot_run_a_4bit_base_is_one_line(monkeypatch):
    with pytest.raises(BadInput, match="lora.load_in_4bit: bitsandbytes has no Ascend"):
        bitsandbytes_or_refuse("npu")
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if it were not installed
    with pytest.raises(BadInput, match=r"lora.load_in_4bit needs bitsandbytes \(pip install bitsandbytes\)"):
        bitsandbytes_or_refuse("cpu")
