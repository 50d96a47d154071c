#!/usr/bin/env python3
# Per EndStep in a FUYOU_TRACE file: last ssd_write end before the EndStep's answer -> its answer,
# and the background commit's span after it.
import json, sys, statistics
ev = [json.loads(l) for l in open(sys.argv[1]) if l.strip().startswith("{")]
def g(e, *names):
    for n in names:
        if n in e: return e[n]
ends = sorted([e for e in ev if g(e, "event", "name") == "end_step"], key=lambda e: g(e, "start_us", "start"))
writes = [e for e in ev if g(e, "event", "name") == "ssd_write"]
commits = [e for e in ev if g(e, "event", "name") == "commit"]
tails, commit_ms, overlap = [], [], []
prev_end = 0
for e in ends:
    s, t = g(e, "start_us", "start"), g(e, "end_us", "end")
    ws = [g(w, "end_us", "end") for w in writes if prev_end <= g(w, "end_us", "end") <= t]
    if ws: tails.append((t - max(ws)) / 1000)
    cs = [c for c in commits if g(c, "start_us", "start") >= s - 1000]
    if cs:
        c = min(cs, key=lambda c: g(c, "start_us", "start"))
        commit_ms.append((g(c, "end_us", "end") - g(c, "start_us", "start")) / 1000)
        overlap.append((g(c, "end_us", "end") - t) / 1000)
    prev_end = t
print(f"EndSteps {len(ends)}; last write-back -> EndStep answered, ms: median {statistics.median(tails):.1f} max {max(tails):.1f}" if tails else "no tails")
if commit_ms: print(f"background commit span ms: median {statistics.median(commit_ms):.1f} max {max(commit_ms):.1f}; ends after the answer by median {statistics.median(overlap):.1f} ms")
