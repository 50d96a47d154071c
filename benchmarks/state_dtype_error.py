#!/usr/bin/env python3
"""How far 8-bit (and bf16) Adam moments move training from fp32 moments (issue 36).

    .venv/bin/python benchmarks/state_dtype_error.py --fuyoud BUILD/daemon/fuyoud \\
        [--steps 300] [--model tiny] [--batch 8] [--seq 64] [--lr 1e-3] \\
        [--png benchmarks/state_dtype_error.png] [--json out.json]

Two measures, one run:

1. Training. The same GPT (python_client/examples/gpt.py), the same init and
   batches (a learnable pattern: each row counts up by a stride of its own),
   trained --steps steps by torch.optim.AdamW (fp32, the reference) and by
   fuyou.AdamW with state_dtype fp32, bf16 and 8bit on one real fuyoud. Every
   10 steps: the distance of each run's weights from the reference's, as a
   fraction of how far the reference moved (||w - w_ref|| / ||w_ref - w_0||),
   and the held-out loss (4 batches no step trained on).

2. The update error of each code, alone. The reference run's gradients are
   replayed into shadow moments kept in a code (m and v quantized after every
   step, blocks of 256, decoded for the next), in torch, beside fp32 moments fed
   the same gradients; each step's AdamW update direction m_hat / (sqrt(v_hat) +
   eps) is compared with fp32's: ||u_code - u_fp32|| / ||u_fp32||. Codes:
     ours       m: sign + 4-bit exponent + 3-bit mantissa, to nearest; v: 4-bit
                exponent + 4-bit mantissa, stochastic (what fuyoud stores);
     ours-nearest-v  the same with v to nearest (v cannot decay: why it is not);
     m-e3m4     m with a 4th mantissa bit and 8 binades (what a block shared by
                a LayerNorm and a matrix cannot afford: the LayerNorm's m is 0);
     wider-3bit v with a 5-bit exponent and 3-bit mantissa;
     dynamic    bitsandbytes' dynamic tree code (Dettmers et al. 2021): a
                decimal exponent and a linear fraction, signed for m, unsigned
                for v, to nearest, blocks of 256 (torchao's 8-bit AdamW's);
     linear-sqrt-v  ours for m, v as sqrt(v) on 255 linear steps of the block
                's largest (small v round to zero: the failure a dynamic code
                avoids);
     bf16       m to nearest, v stochastic (state_dtype="bf16").
Writes a PNG of both (matplotlib) and prints the tables.
"""
import argparse
import json
import os
import pathlib
import sys
import tempfile

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python_client"))
sys.path.insert(0, str(ROOT / "python_client" / "examples"))
import fuyou  # noqa: E402
from gpt import GPT, PRESETS  # noqa: E402

BLOCK = 256
HELD_OUT = range(10_000, 10_004)


def batch(step, bsz, seq, vocab=256):
    g = torch.Generator().manual_seed(7 * 100003 + step)
    start = torch.randint(0, vocab, (bsz, 1), generator=g)
    stride = torch.randint(1, 3, (bsz, 1), generator=g)
    data = (start + stride * torch.arange(seq + 1)) % vocab
    return data[:, :-1], data[:, 1:]


def loss_of(model, step, args):
    _, loss = model(*batch(step, args.batch, args.seq))
    return loss


def held_out(model, args):
    with torch.no_grad():
        return sum(float(loss_of(model, s, args)) for s in HELD_OUT) / len(HELD_OUT)


def flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


# ---- codes (torch, on flat fp32 tensors; blocks of 256) ------------------------

def _blocks(x):
    n = x.numel()
    pad = (-n) % BLOCK
    return torch.nn.functional.pad(x, (0, pad)).view(-1, BLOCK), n


def float_code(x, exp_bits, mant_bits, signed, stochastic, gen):
    """Our codes: a small float (exp_bits, mant_bits) with a code for zero,
    scaled so that the block's largest is the largest code; to nearest (ties
    to even) or stochastically; unsigned ones never round a nonzero to zero."""
    b, n = _blocks(x)
    top = 2 - 2.0 ** -mant_bits
    amax = b.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / top, torch.ones_like(amax))
    y = (b / scale).abs().float().contiguous()
    bits = y.view(torch.int32).to(torch.int64)
    shift = 23 - mant_bits
    bias = 127 - (2 ** exp_bits - 1)
    if stochastic:
        noise = torch.randint(0, 1 << shift, bits.shape, generator=gen)
    else:
        noise = (1 << (shift - 1)) - 1 + ((bits >> shift) & 1)
    c = ((bits + noise) >> shift) - (bias << mant_bits)
    c = c.clamp(0 if signed else 1, 2 ** (exp_bits + mant_bits) - 1)
    c = torch.where(bits == 0, torch.zeros_like(c), c)
    val = ((c << shift) + (bias << 23)).to(torch.int32).view(torch.float32)
    val = torch.where(c == 0, torch.zeros_like(val), val)
    out = (torch.sign(b) if signed else 1.0) * val * scale
    return out.flatten()[:n]


def dynamic_map(signed):
    """The dynamic tree code's values (Dettmers et al. 2021), built from its
    description: for exponent i (10^-(6-i)), linear fractions in (0.1, 1)."""
    values = [0.0, 1.0]
    for i in range(7):
        items = 2 ** i + 1 if signed else 2 ** (i + 1) + 1
        edges = torch.linspace(0.1, 1, items)
        means = ((edges[:-1] + edges[1:]) / 2) * 10 ** (-6 + i)
        values += means.tolist()
        if signed:
            values += (-means).tolist()
    v = torch.tensor(sorted(set(values)))
    return v[:256]


DYN = {True: dynamic_map(True), False: dynamic_map(False)}


def dynamic_code(x, signed):
    b, n = _blocks(x)
    amax = b.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax, torch.ones_like(amax))
    table = DYN[signed]
    y = (b / scale).clamp(-1, 1)
    mid = (table[1:] + table[:-1]) / 2
    idx = torch.bucketize(y.contiguous(), mid)
    return (table[idx] * scale).flatten()[:n]


def linear_sqrt(v):
    b, n = _blocks(v.sqrt())
    amax = b.amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / 255, torch.ones_like(amax))
    return ((b / scale).round() * scale).square().flatten()[:n]


def bf16(x, stochastic, gen):
    if not stochastic:
        return x.to(torch.bfloat16).float()
    bits = x.contiguous().view(torch.int32).to(torch.int64)
    noise = torch.randint(0, 1 << 16, bits.shape, generator=gen)
    return (((bits + noise) >> 16) << 16).to(torch.int32).view(torch.float32)


def codes(gen):
    ours_m = lambda m: float_code(m, 4, 3, True, False, gen)  # noqa: E731
    ours_v = lambda v: float_code(v, 4, 4, False, True, gen)  # noqa: E731
    return {
        "ours": (ours_m, ours_v),
        "ours-nearest-v": (ours_m, lambda v: float_code(v, 4, 4, False, False, gen)),
        "m-e3m4": (lambda m: float_code(m, 3, 4, True, False, gen), ours_v),
        "wider-3bit": (ours_m, lambda v: float_code(v, 5, 3, False, True, gen)),
        "dynamic": (lambda m: dynamic_code(m, True), lambda v: dynamic_code(v, False)),
        "linear-sqrt-v": (ours_m, linear_sqrt),
        "bf16": (lambda m: bf16(m, False, gen), lambda v: bf16(v, True, gen)),
    }


def update_errors(grads, betas, eps, every):
    """Per code, the relative error of each step's update direction against
    fp32 moments fed the same gradients."""
    gen = torch.Generator().manual_seed(0)
    b1, b2 = betas
    n = grads[0].numel()
    out = {}
    for name, (qm, qv) in codes(gen).items():
        m32 = torch.zeros(n)
        v32 = torch.zeros(n)
        mq = torch.zeros(n)
        vq = torch.zeros(n)
        errs = []
        for t, g in enumerate(grads, start=1):
            m32 = b1 * m32 + (1 - b1) * g
            v32 = b2 * v32 + (1 - b2) * g * g
            mq = b1 * mq + (1 - b1) * g
            vq = b2 * vq + (1 - b2) * g * g
            c1, c2 = 1 - b1 ** t, 1 - b2 ** t
            u32 = (m32 / c1) / ((v32 / c2).sqrt() + eps)
            uq = (mq / c1) / ((vq / c2).sqrt() + eps)
            if t % every == 0:
                errs.append(float((uq - u32).norm() / u32.norm()))
            mq, vq = qm(mq), qv(vq)
        out[name] = errs
    return out


# ---- the training runs -------------------------------------------------------

def train(args, daemon):
    torch.manual_seed(0)
    cfg = PRESETS[args.model]
    base = GPT(cfg)
    w0 = flat(base)
    runs = {}
    import copy
    ref = copy.deepcopy(base)
    runs["torch fp32"] = (ref, torch.optim.AdamW(ref.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8))
    for dtype in ("fp32", "bf16", "8bit"):
        model = copy.deepcopy(base)
        opt = fuyou.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8,
                          job=f"error-{dtype}", address=daemon.address, state_dtype=dtype, timeout=600)
        runs[f"fuyou {dtype}"] = (model, opt)
    every = args.every
    dist = {name: [] for name in runs if name != "torch fp32"}
    loss = {name: [] for name in runs}
    grads = []
    for step in range(args.steps):
        for name, (model, opt) in runs.items():
            loss_of(model, step, args).backward()
            if name == "torch fp32":
                grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]).clone())
            opt.step()
            opt.zero_grad(set_to_none=True)
        if (step + 1) % every == 0:
            w_ref = flat(ref)
            moved = float((w_ref - w0).norm())
            for name in dist:
                dist[name].append(float((flat(runs[name][0]) - w_ref).norm()) / moved)
            for name, (model, _) in runs.items():
                loss[name].append(held_out(model, args))
    for name, (_, opt) in runs.items():
        if name != "torch fp32":
            opt.close()
    return dist, loss, grads, sum(p.numel() for p in base.parameters())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fuyoud", default=os.environ.get("FUYOU_DAEMON"))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--model", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--png", default=str(ROOT / "benchmarks" / "state_dtype_error.png"))
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    with tempfile.TemporaryDirectory(prefix="state-dtype-error-") as tmp:
        daemon = fuyou.EmbeddedDaemon(data_dir=os.path.join(tmp, "data"),
                                      extra_args=["--log-level", "warn"], binary=args.fuyoud)
        try:
            dist, loss, grads, n_params = train(args, daemon)
        finally:
            daemon.stop()
    errors = update_errors(grads, (0.9, 0.999), 1e-8, args.every)
    steps = [args.every * (i + 1) for i in range(len(next(iter(loss.values()))))]
    print(f"{args.model}: {n_params / 1e6:.2f}M parameters, {args.steps} steps, lr {args.lr}, "
          f"batch {args.batch} x {args.seq}")
    print("\n1. weights' distance from torch fp32 / how far torch fp32 moved; held-out loss")
    print(f"{'step':>6} " + " ".join(f"{n:>12}" for n in dist) + "   " + " ".join(f"{n:>12}" for n in loss))
    for i, s in enumerate(steps):
        print(f"{s:>6} " + " ".join(f"{dist[n][i]:>12.4f}" for n in dist) + "   "
              + " ".join(f"{loss[n][i]:>12.4f}" for n in loss))
    final_ref = loss["torch fp32"][-1]
    for n in loss:
        print(f"final held-out loss {n}: {loss[n][-1]:.4f} ({(loss[n][-1] - final_ref) / final_ref:+.2%} vs torch fp32)")
    print("\n2. update error per code, ||u_code - u_fp32|| / ||u_fp32|| on the reference's gradients")
    print(f"{'code':>16} {'median':>8} {'last':>8} {'max':>8}")
    for n, e in errors.items():
        print(f"{n:>16} {sorted(e)[len(e) // 2]:>8.4f} {e[-1]:>8.4f} {max(e):>8.4f}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"steps": steps, "distance": dist, "loss": loss,
                                                       "update_error": errors}, indent=1))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG")
        return
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    for n, d in dist.items():
        ax[0].plot(steps, d, label=n)
    ax[0].set(title="weights: distance from torch fp32 / its distance moved", xlabel="step", yscale="log")
    for n, l in loss.items():
        ax[1].plot(steps, l, label=n)
    ax[1].set(title="held-out loss", xlabel="step")
    for n, e in errors.items():
        ax[2].plot(steps[:len(e)], e, label=n)
    ax[2].set(title="update error vs fp32 moments, same gradients", xlabel="step", yscale="log")
    for a in ax:
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.png, dpi=90)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
