"""Under torch.inference_mode() (and no_grad), offload still runs every product on the device:
attention, recurrent layers, einsum and MultiheadAttention report no host MACs and differ
from their fp32 results."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hbfp.host as H
import hbfp.torch as HT

torch.manual_seed(0)
Q = torch.randn(2, 4, 16, 32)
LSTM, GRU = nn.LSTM(32, 32, batch_first=True), nn.GRU(32, 32, batch_first=True)
MHA = nn.MultiheadAttention(32, 4, batch_first=True)
CASES = {
    "sdpa": lambda: F.scaled_dot_product_attention(Q, Q, Q, is_causal=True),
    "lstm": lambda: LSTM(Q[0])[0],
    "gru": lambda: GRU(Q[0])[0],
    "einsum": lambda: torch.einsum("bhik,bhjk->bhij", Q, Q),
    "mha": lambda: MHA(Q[0], Q[0], Q[0])[0],
}


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
@pytest.mark.parametrize("name", list(CASES))
def test_every_product_runs_on_the_device(name, mode):
    fn = CASES[name]
    with getattr(torch, mode)():
        want = fn()
        HT.reset_report()
        with HT.offload(H.open("emu")):
            got = fn()
    r = HT.report()
    assert sum(v.device_macs for v in r.values()) > 0
    assert sum(v.host_macs for v in r.values()) == 0, {k: v.host_macs for k, v in r.items() if v.host_macs}
    assert got.shape == want.shape and not torch.equal(got, want)
