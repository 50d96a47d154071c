#!/usr/bin/env python3
"""fuyou's CPU AdamW kernel against torch 2's CPU AdamW implementations
(foreach=True and fused=True, the fastest) and against an Adam-shaped
memory-bandwidth probe, on the same element count, in one run.

    .venv/bin/python benchmarks/adamw_vs_torch.py BUILD/benchmarks/adamw_bench \
        [--n 67108864] [--tensors 16] [--threads 1,2] [--reps 5] [--rounds 4] [--json out.json]

torch (fp32 params split into --tensors tensors, torch.set_num_threads(t)) and
adamw_bench (same n and thread counts) run interleaved: --rounds rounds, each
timing --reps steps of torch and --reps rounds of adamw_bench, the order
alternating (torch first, then ours first, ...), so neither side gets the
machine's quiet or noisy minutes to itself. Every torch implementation of
--impls runs in each torch turn. The table gives the best of all rounds;
ours/torch and "paired" (the median over rounds of each round's ratio, the
figure least exposed to drift) are against the fastest torch implementation.
Run it with the project's venv (deploy/install-deps.sh), which has torch 2.
"""
import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

import torch


def make_torch(n, tensors, flags):
    torch.manual_seed(0)
    per = n // tensors
    sizes = [per] * tensors
    sizes[-1] += n - per * tensors
    params = [torch.nn.Parameter(torch.rand(s) * 2 - 1) for s in sizes]
    for p in params:
        p.grad = (torch.rand_like(p) * 2 - 1) * 0.01
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=1e-2, **flags)
    opt.step()  # warm-up: allocates the states
    return opt


def time_torch(opt, threads, reps):
    torch.set_num_threads(threads)
    opt.step()  # warm-up at this thread count
    secs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        opt.step()
        secs.append(time.perf_counter() - t0)
    return secs


def median(values):
    values = sorted(values)
    k = len(values)
    return values[k // 2] if k % 2 else 0.5 * (values[k // 2 - 1] + values[k // 2])


def run_bench(bench, n, threads, reps, tmp, round_index):
    bench_json = os.path.join(tmp, f"adamw_bench.{round_index}.json")
    cmd = [bench, f"--n={n}", f"--threads={threads}", f"--reps={reps}", f"--json={bench_json}"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(bench_json) as f:
        return json.load(f)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bench", help="path to the adamw_bench binary")
    ap.add_argument("--n", type=int, default=64 << 20, help="elements (default 64Mi)")
    ap.add_argument("--tensors", type=int, default=16, help="torch tensors the n elements form")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--reps", type=int, default=5, help="timed steps / rounds per round")
    ap.add_argument("--rounds", type=int, default=4, help="interleaved rounds of torch and ours")
    ap.add_argument("--impls", default="foreach,fused",
                    help="torch.optim.AdamW implementations: foreach, fused, for_loop")
    ap.add_argument("--json", help="write the combined results here")
    args = ap.parse_args()
    impl_flags = {"foreach": dict(foreach=True), "fused": dict(fused=True),
                  "for_loop": dict(foreach=False)}
    impls = args.impls.split(",")
    thread_counts = [int(t) for t in args.threads.split(",")]
    if not os.access(args.bench, os.X_OK):
        sys.exit(f"adamw_vs_torch: {args.bench} is not an executable adamw_bench")

    print(f"torch {torch.__version__}: AdamW({', '.join(impls)}), n={args.n} in {args.tensors}"
          f" tensors; {args.rounds} interleaved rounds of {args.reps}", flush=True)
    opts = {impl: make_torch(args.n, args.tensors, impl_flags[impl]) for impl in impls}
    torch_secs = {(i, t): [] for i in impls for t in thread_counts}   # every torch step
    torch_round = {(i, t): [] for i in impls for t in thread_counts}  # each round's median
    ours_rounds = []                                 # each round's adamw_bench JSON
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = ["torch", "ours"] if r % 2 == 0 else ["ours", "torch"]
            for who in order:
                if who == "torch":
                    for impl, opt in opts.items():
                        for t in thread_counts:
                            secs = time_torch(opt, t, args.reps)
                            torch_secs[impl, t] += secs
                            torch_round[impl, t].append(median(secs))
                else:
                    ours_rounds.append(run_bench(args.bench, args.n, args.threads, args.reps, tmp, r))
            print(f"  round {r + 1}/{args.rounds} ({' then '.join(order)}): torch "
                  + ", ".join(f"{i} t={t} {torch_round[i, t][-1] * 1e3:.1f} ms"
                              for i in impls for t in thread_counts), flush=True)
    del opts
    gc.collect()
    all_rows = {key: {"best_seconds": min(secs), "median_seconds": median(secs)}
                for key, secs in torch_secs.items()}
    # Per thread count, the fastest torch implementation (by median) is the peer.
    fastest = {t: min(impls, key=lambda i: all_rows[i, t]["median_seconds"])
               for t in thread_counts}
    torch_rows = {t: all_rows[fastest[t], t] for t in thread_counts}
    # Ours: best of the rounds' bests, median of the rounds' medians; per-round ratios.
    bench = {"isa": ours_rounds[0]["isa"], "probe_isa": ours_rounds[0]["probe_isa"], "rows": []}
    paired = {}
    for row in ours_rounds[0]["rows"]:
        key = (row["threads"], row["variant"])
        same = [next(x for x in b["rows"] if (x["threads"], x["variant"]) == key) for b in ours_rounds]
        merged = dict(row)
        merged["best_seconds"] = min(x["best_seconds"] for x in same)
        merged["median_seconds"] = median([x["median_seconds"] for x in same])
        merged["gb_per_s"] = max(x["gb_per_s"] for x in same)
        merged["ratio_vs_probe_median"] = median([x["ratio_vs_probe_median"] for x in same])
        bench["rows"].append(merged)
        t = row["threads"]
        if t in fastest:
            peer = torch_round[fastest[t], t]
            paired[key] = median([peer[i] / same[i]["median_seconds"] for i in range(len(same))])

    rows = []
    header = (f"{'threads':>7} {'impl':<14} {'best ms':>9} {'Gelem/s':>8} {'GB/s':>7} "
              f"{'ours/torch':>10} {'paired':>7} {'ours/probe':>10}")
    print("\nbest of each (median in the JSON); GB/s counts 28 B/elem (32 for fp32+out;"
          " torch: 28); ours/torch and paired against the fastest torch (*)")
    print(header)
    print("-" * len(header))
    for t in thread_counts:
        tr = torch_rows[t]
        torch_eps = args.n / tr["best_seconds"]
        torch_eps_med = args.n / tr["median_seconds"]
        by_variant = {r["variant"]: r for r in bench["rows"] if r["threads"] == t}
        probe = by_variant["probe"]
        probe_eps = args.n / probe["best_seconds"]
        for impl in impls:
            row = all_rows[impl, t]
            eps = args.n / row["best_seconds"]
            mark = "*" if impl == fastest[t] else ""
            print(f"{t:>7} {'torch ' + impl + mark:<14} {row['best_seconds'] * 1e3:>9.1f} "
                  f"{eps / 1e9:>8.3f} {eps * 28 / 1e9:>7.2f} {'':>10} {'':>7} "
                  f"{eps / probe_eps:>10.3f}")
            rows.append({"threads": t, "impl": f"torch_{impl}", **row, "elems_per_s": eps,
                         "fastest_torch": impl == fastest[t],
                         "ratio_vs_probe": eps / probe_eps,
                         "ratio_vs_probe_median": (args.n / row["median_seconds"])
                         * probe["median_seconds"] / args.n})
        for name in ["probe", "fp32", "fp32+out", "bf16", "fp16"]:
            r = by_variant[name]
            eps = args.n / r["best_seconds"]
            eps_med = args.n / r["median_seconds"]
            vs_torch = "" if name == "probe" else f"{eps / torch_eps:>10.2f}"
            pair = "" if name == "probe" else f"{paired[(t, name)]:>7.2f}"
            print(f"{t:>7} {('ours ' + name) if name != 'probe' else 'probe':<14} "
                  f"{r['best_seconds'] * 1e3:>9.1f} {eps / 1e9:>8.3f} {r['gb_per_s']:>7.2f} "
                  f"{vs_torch:>10} {pair:>7} {eps / probe_eps:>10.3f}")
            rows.append({"threads": t, "impl": "probe" if name == "probe" else f"ours_{name}",
                         "best_seconds": r["best_seconds"],
                         "median_seconds": r["median_seconds"], "elems_per_s": eps,
                         "gb_per_s": r["gb_per_s"],
                         "ratio_vs_torch": None if name == "probe" else eps / torch_eps,
                         "ratio_vs_torch_median": None if name == "probe"
                         else eps_med / torch_eps_med,
                         "ratio_vs_torch_paired": None if name == "probe" else paired[(t, name)],
                         "ratio_vs_probe": eps / probe_eps,
                         "ratio_vs_probe_median": r["ratio_vs_probe_median"]})
        print()

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"n": args.n, "tensors": args.tensors, "torch": torch.__version__,
                       "isa": bench["isa"], "probe_isa": bench["probe_isa"],
                       "reps": args.reps, "rounds": args.rounds, "rows": rows}, f, indent=2)
        print("wrote", args.json)


if __name__ == "__main__":
    main()
