"""The optimizer: fused AdamW where available, the same updates as the default implementation."""

from __future__ import annotations

import torch

from rloo.training.optim import make_adamw


def test_fused_adamw_on_cpu_takes_the_default_steps() -> None:
    torch.manual_seed(0)
    ref = torch.nn.Linear(16, 8)
    fused_model = torch.nn.Linear(16, 8)
    fused_model.load_state_dict(ref.state_dict())
    kw = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    plain = torch.optim.AdamW(ref.parameters(), **kw)
    fused = make_adamw(fused_model.parameters(), **kw)
    assert fused.defaults["fused"] is True  # this PyTorch has the CPU kernel
    for step in range(5):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
        for model, opt in ((ref, plain), (fused_model, fused)):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
    for a, b in zip(ref.parameters(), fused_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    # the state is the usual one: checkpoints written with either load into the other
    assert set(fused.state_dict()["state"][0]) == set(plain.state_dict()["state"][0])
