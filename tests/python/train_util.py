"""Side-by-side training of fuyou.AdamW and torch.optim.AdamW."""

from __future__ import annotations

from helpers import batch

CHUNK_BYTES = 8 << 10  # many small chunks (about 14 for the tiny GPT in fp32)


def split_groups(model, lr=1e-3, wd=0.1, lr_no_decay=2e-3):
    """Two groups like GPT recipes: matrices with weight decay, the rest without."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "lr": lr, "weight_decay": wd},
            {"params": no_decay, "lr": lr_no_decay, "weight_decay": 0.0}]


def step_loss(model, step, scale=None, micro=None, batch_size=4):
    x, y = batch(step, batch_size=batch_size)
    if micro is not None:
        k, i = micro
        per = batch_size // k
        x, y = x[i * per:(i + 1) * per], y[i * per:(i + 1) * per]
    return model(x, y)
