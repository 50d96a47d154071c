"""Test helpers: a tiny GPT, deterministic batches, and comparisons."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 64
D_MODEL = 32
N_HEAD = 4
SEQ = 16
N_LAYER = 2


class Block(nn.Module):
    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        # No qkv bias: the key bias has a mathematically zero gradient (softmax is
        # shift-invariant), i.e. rounding noise, which Adam would blow up to +-lr.
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)
        self.n_head = n_head

    def forward(self, x, c):
        b, t, d = x.shape
        h = F.layer_norm(x, (d,), c(self.ln1.weight), c(self.ln1.bias))
        q, k, v = F.linear(h, c(self.qkv.weight)).split(d, dim=2)
        q = q.view(b, t, self.n_head, d // self.n_head).transpose(1, 2)
        k = k.view(b, t, self.n_head, d // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, d // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.n_head)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + F.linear(y, c(self.proj.weight), c(self.proj.bias))
        h = F.layer_norm(x, (d,), c(self.ln2.weight), c(self.ln2.bias))
        h = F.gelu(F.linear(h, c(self.fc.weight), c(self.fc.bias)))
        return x + F.linear(h, c(self.out.weight), c(self.out.bias))


class TinyGPT(nn.Module):
    """Decoder-only transformer: token + position embedding, N blocks, final
    LayerNorm, output head tied to the token embedding. `compute_dtype` (e.g.
    float32 for fp16 weights, which CPU kernels lack) casts each weight on use;
    gradients still arrive in the parameters' dtype."""

    def __init__(self, vocab=VOCAB, d=D_MODEL, n_head=N_HEAD, n_layer=N_LAYER, seq=SEQ,
                 compute_dtype=None):
        super().__init__()
        self.compute_dtype = compute_dtype
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList([Block(d, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, idx, targets=None):
        b, t = idx.shape
        cd = self.compute_dtype

        def c(w):
            return w if cd is None else w.to(cd)

        x = F.embedding(idx, c(self.tok.weight)) + F.embedding(
            torch.arange(t, device=idx.device), c(self.pos.weight))
        for blk in self.blocks:
            x = blk(x, c)
        x = F.layer_norm(x, (x.size(-1),), c(self.ln_f.weight), c(self.ln_f.bias))
        logits = F.linear(x, c(self.head.weight))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> TinyGPT:
    """The same initial weights for every dtype (initialized in fp32, then cast)."""
    torch.manual_seed(seed)
    compute = torch.float32 if dtype == torch.float16 else None
    return TinyGPT(compute_dtype=compute).to(dtype)


def batch(step: int, batch_size: int = 4, seed: int = 1234):
    """Deterministic (inputs, targets) for a step: a function of the step only."""
    g = torch.Generator().manual_seed(seed * 100003 + step)
    data = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def clone_model(model: nn.Module) -> nn.Module:
    import copy
    return copy.deepcopy(model)


def max_rel_diff(a: nn.Module, b: nn.Module) -> float:
    """Largest over tensors of ||a - b|| / ||b||."""
    worst = 0.0
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb
        num = (pa.detach().double() - pb.detach().double()).norm().item()
        den = pb.detach().double().norm().item()
        worst = max(worst, num / den if den > 0 else num)
    return worst


def assert_models_close(a: nn.Module, b: nn.Module, rtol: float, atol: float, what: str = ""):
    for (na, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(pa.detach().float(), pb.detach().float(), rtol=rtol,
                                   atol=atol, msg=lambda m: f"{what} {na}: {m}")


def global_rel_diff(a: nn.Module, b: nn.Module) -> float:
    """||a - b|| / ||b|| over all parameters of the models at once."""
    va = torch.cat([p.detach().double().reshape(-1) for p in a.parameters()])
    vb = torch.cat([p.detach().double().reshape(-1) for p in b.parameters()])
    return ((va - vb).norm() / vb.norm()).item()
