"""No optimizer step reads a tensor value on the host: such a read waits for the device queue
(the reference Adafactor2D did it twice per parameter per step). Every host read of a tensor goes
through __bool__/__float__/__int__/item/tolist, so the test makes those raise during step()."""

import pytest
import torch

from optim.adafactor import Adafactor2D
from optim.lion import Lion
from optim.muon import Muon
from optim.olion import OLion

HOST_READS = ["__bool__", "__float__", "__int__", "__index__", "item", "tolist"]


@pytest.mark.parametrize("make", [Muon, Lion, OLion, Adafactor2D,
                                  lambda ps: Muon(ps, ns_dtype="bfloat16", weight_decay=0.1),
                                  lambda ps: Adafactor2D(ps, beta2=0.0, clip=4.0)])
def test_step_never_reads_a_tensor_on_the_host(make, monkeypatch):
    params = [torch.nn.Parameter(torch.randn(8, 12)), torch.nn.Parameter(torch.randn(8, 12))]
    opt = make(params)
    for p in params:
        p.grad = torch.randn_like(p)

    def host_read(*args, **kwargs):
        raise AssertionError("host read of a tensor during step()")

    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, host_read)
    opt.step()
    opt.step()
