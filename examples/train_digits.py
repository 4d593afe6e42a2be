"""An ordinary PyTorch training loop whose matrix products run in HBFP8.

The model and the loop are plain PyTorch; one context, ``hbfp.torch.offload(device)``, sends
every ``linear``/``mm``/``addmm``/``bmm``/``matmul`` of the forward pass and both products of
the backward pass to the device (``emu``: the bit-exact golden model in-process; ``sim``:
the generated Verilog under Verilator; ``tcp:HOST:PORT``/``serial:PORT``: a board).
``wide_weight_storage`` keeps the master weights as HBFP16 (rounded after every optimizer
step); the products read them as HBFP8.

    python examples/train_digits.py            # emu
    python examples/train_digits.py sim        # the RTL (builds the simulator on first use)
"""

import sys

import torch

import hbfp.host
import hbfp.torch
from hbfp.train import load_digits_split

device = hbfp.host.open(sys.argv[1] if len(sys.argv) > 1 else "emu")
x_train, y_train, x_test, y_test = load_digits_split(seed=0)

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
hbfp.torch.wide_weight_storage(model, opt)

with hbfp.torch.offload(device):
    for epoch in range(5):
        for i in range(0, len(x_train), 64):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x_train[i : i + 64]), y_train[i : i + 64])
            loss.backward()
            opt.step()
        with torch.no_grad():
            accuracy = (model(x_test).argmax(1) == y_test).float().mean()
        print(f"epoch {epoch + 1}: loss {loss.item():.4f}, test accuracy {100 * accuracy:.2f}%")
print("device link:", device.stats)
