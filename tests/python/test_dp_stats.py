"""A data-parallel job's ranks shown as one job (issue 24 item 6), against a
real fuyoud: the ranks' sessions train the jobs ``<job>.rank<r>-of<w>``
(``_data_parallel.py``'s per-rank jobs), and GetStats (``fuyouctl stats
--json``), ``fuyouctl stats``, ``sessions``, ``jobs``, ``top`` and /metrics
show one row for the job with the ranks' totals and a row per rank beneath."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from metrics_util import fuyouctl_binary, free_port, get_stats, open_optimizer, scrape, start_metrics_daemon, train

parser = pytest.importorskip("prometheus_client.parser",
                             reason="python3-prometheus-client is not installed (deploy/install-deps.sh)")

JOB = "dpjob"
WORLD = 2


def rank_job(rank: int, world: int = WORLD) -> str:
    return f"{JOB}.rank{rank}-of{world}"


def ctl(daemon, *args) -> str:
    return subprocess.run([fuyouctl_binary(), "--socket", daemon.socket_path, *args], check=True,
                          capture_output=True, text=True).stdout


def ctl_json(daemon, *args):
    """fuyouctl's JSON, 64-bit integers (JSON strings) made ints."""
    def numbers(node):
        if isinstance(node, dict):
            return {k: numbers(v) for k, v in node.items()}
        if isinstance(node, list):
            return [numbers(v) for v in node]
        return int(node) if isinstance(node, str) and node.isdigit() else node
    return numbers(json.loads(ctl(daemon, *args, "--json")))


def table(text: str, header_starts: str) -> list:
    """The rows of the table whose header line starts with `header_starts`, as
    dicts by column (cells cut at the header's column starts: the columns are
    padded to their widest cell, and a cell may be empty). Each row also has
    "_indent": the leading spaces of each of its cells, by column."""
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(header_starts))
    header = lines[at]
    columns = [(m.start(), m.group()) for m in re.finditer(r"\S+(?: \S+)*", header)]
    rows = []
    for line in lines[at + 1:]:
        if not line.strip():
            break
        row = {}
        for i, (start, name) in enumerate(columns):
            end = columns[i + 1][0] if i + 1 < len(columns) else None
            row[name] = line[start:end].strip()
            row.setdefault("_indent", {})[name] = len(line[start:end]) - len(line[start:end].lstrip(" "))
        rows.append(row)
    return rows


def row_of(rows: list, column: str, value: str) -> tuple:
    """(index, row) of the row whose `column` is `value`."""
    return next((i, r) for i, r in enumerate(rows) if r[column] == value)


@pytest.fixture
def ranks_training(tmp_path):
    """A daemon with metrics on; rank 0 trained 3 steps, rank 1 trained 2, both
    sessions still open; an ordinary job beside them."""
    port = free_port()
    daemon = start_metrics_daemon(tmp_path, port)
    opened = []
    try:
        for rank, steps in ((0, 3), (1, 2)):
            model, opt = open_optimizer(daemon, rank_job(rank))
            train(model, opt, steps=steps)
            opened.append(opt)
        model, opt = open_optimizer(daemon, "ordinary")
        train(model, opt, steps=1)
        opened.append(opt)
        yield daemon, port, opened
    finally:
        for opt in opened:
            opt.close()
        daemon.stop()


def test_get_stats_shows_the_ranks_as_one_job_with_per_rank_rows(ranks_training):
    daemon, _, opened = ranks_training
    stats = get_stats(daemon)
    listed = ctl_json(daemon, "sessions")
    by_job = {s["job"]: s for s in listed["sessions"]}
    assert by_job[rank_job(1)]["data_parallel_job"] == JOB
    assert by_job[rank_job(1)]["rank"] == 1 and by_job[rank_job(1)]["world_size"] == WORLD
    assert by_job["ordinary"]["world_size"] == 0 and by_job["ordinary"]["data_parallel_job"] == ""

    (job,) = stats["data_parallel_jobs"]  # the ordinary job is in no row
    assert job["job"] == JOB and job["world_size"] == WORLD and job["live_ranks"] == 2
    assert job["uid"] == os.geteuid()
    assert job["committed_step"] == 2 and job["newest_committed_step"] == 3
    assert [r["rank"] for r in job["ranks"]] == [0, 1]
    for r in job["ranks"]:
        mine = by_job[r["job"]]
        assert r["session_id"] == mine["session_id"]
        assert r["chunk_updates"] == mine["chunk_updates"] > 0
        assert r["committed_step"] == mine["committed_step"]
        assert r["chunks"] == mine["chunks"] > 0
    assert job["chunk_updates"] == sum(r["chunk_updates"] for r in job["ranks"])
    assert job["chunks"] == sum(r["chunks"] for r in job["ranks"])
    # ListSessions has the same row.
    assert [(g["job"], g["live_ranks"]) for g in listed["data_parallel_jobs"]] == [(JOB, 2)]
    # The binding's dicts carry the marks too.
    from fuyou import _fuyou
    admin = _fuyou.AdminClient.connect(daemon.address, 10.0)
    marked = {s["job"]: s for s in admin.list_sessions()}
    assert (marked[rank_job(0)]["data_parallel_job"], marked[rank_job(0)]["rank"]) == (JOB, 0)
    assert {j["name"]: j["world_size"] for j in admin.list_jobs()}[rank_job(1)] == WORLD
    assert admin.get_stats()["data_parallel_jobs"][0]["job"] == JOB

    # A rank leaves: the job's row has one live rank.
    opened[1].close()
    (job,) = get_stats(daemon)["data_parallel_jobs"]
    assert job["live_ranks"] == 1 and [r["rank"] for r in job["ranks"]] == [0]


def test_fuyouctl_shows_one_row_for_the_job_and_its_ranks_beneath(ranks_training):
    daemon, _, _ = ranks_training
    for command, header, job_column in ((["stats"], "DATA-PARALLEL JOB", "DATA-PARALLEL JOB"),
                                        (["sessions"], "SESSION", "JOB"), (["jobs"], "JOB", "JOB"),
                                        (["top", "--once", "--interval", "0.2"], "JOB ", "JOB")):
        text = ctl(daemon, *command)
        rows = table(text, header)
        at, group = row_of(rows, job_column, JOB)
        assert group["_indent"][job_column] == 0, text
        assert group["RANKS"] == "2/2", text
        assert group["STEP"].startswith("2"), text  # what every rank has committed
        # The ranks beneath, by rank, indented.
        for rank in range(WORLD):
            assert rows[at + 1 + rank][job_column] == rank_job(rank), text
            assert rows[at + 1 + rank]["RANKS"] == f"rank {rank}", text
            assert rows[at + 1 + rank]["_indent"][job_column] == 2, text
        if command[0] != "stats":
            assert row_of(rows, job_column, "ordinary")[1]["RANKS"] == "-", text
        if command[0] in ("stats", "top"):
            assert rows[at + 1]["STEP"] == "3", text
    assert row_of(table(ctl(daemon, "stats"), "DATA-PARALLEL JOB"), "DATA-PARALLEL JOB", JOB)[1]["STEP"] == \
        "2 (newest 3)"
    jobs = table(ctl(daemon, "jobs"), "JOB")
    assert row_of(jobs, "JOB", JOB)[1]["OPEN"] == "2 of 2"

    listed = ctl_json(daemon, "jobs")
    (dp,) = listed["data_parallel_jobs"]
    assert dp["name"] == JOB and dp["ranks"] == [0, 1] and dp["open_ranks"] == 2
    assert dp["committed_step"] == 2 and dp["newest_committed_step"] == 3
    on_storage = {j["name"]: j for j in listed["jobs"]}
    assert dp["bytes_on_storage"] == sum(on_storage[rank_job(r)]["bytes_on_storage"] for r in (0, 1)) > 0
    assert on_storage[rank_job(0)]["data_parallel_job"] == JOB and on_storage["ordinary"]["world_size"] == 0


def test_metrics_show_the_job_and_its_ranks(ranks_training):
    daemon, port, _ = ranks_training
    stats = get_stats(daemon)
    values, types = {}, {}
    for family in parser.text_string_to_metric_families(scrape(port)):
        types[family.name] = family.type
        for sample in family.samples:
            values[(sample.name, frozenset(sample.labels.items()))] = sample.value
    job = {"uid": str(os.geteuid()), "data_parallel_job": JOB, "world_size": str(WORLD)}

    def value(name, **labels):
        return values[(name, frozenset({**job, **labels}.items()))]

    assert types["fuyou_data_parallel_live_ranks"] == "gauge"
    assert types["fuyou_data_parallel_rank_chunk_updates"] == "counter"
    assert value("fuyou_data_parallel_live_ranks") == 2
    assert value("fuyou_data_parallel_committed_step") == 2
    (row,) = stats["data_parallel_jobs"]
    for r in row["ranks"]:
        rank = str(r["rank"])
        assert value("fuyou_data_parallel_rank_committed_step", rank=rank) == r["committed_step"]
        assert value("fuyou_data_parallel_rank_chunk_updates_total", rank=rank) == int(r["chunk_updates"])
        assert value("fuyou_data_parallel_rank_update_seconds_total", rank=rank) == pytest.approx(
            r["update_seconds"])
    assert values[("fuyou_data_parallel_jobs_not_shown", frozenset())] == 0
    # No sample names the ordinary job.
    assert not any(("data_parallel_job", "ordinary") in labels for _, labels in values)


PROMETHEUS = "/usr/bin/prometheus"


@pytest.mark.slow
@pytest.mark.integration
def test_a_real_prometheus_sums_the_ranks_of_the_job(ranks_training, tmp_path):
    """Prometheus scrapes the families and its own query language adds the
    ranks up: the job's updates are what GetStats' job row says."""
    if shutil.which(PROMETHEUS) is None:
        pytest.skip(f"{PROMETHEUS} not installed (Debian package prometheus, deploy/install-deps.sh)")
    daemon, metrics_port, _ = ranks_training
    web_port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: fuyoud\n    scrape_timeout: 1s\n"
        f"    static_configs:\n      - targets: ['127.0.0.1:{metrics_port}']\n")
    log_path = tmp_path / "prometheus.log"
    with open(log_path, "wb") as log:
        prometheus = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{web_port}"], stdout=log, stderr=subprocess.STDOUT)
        try:
            def query(expression):
                url = f"http://127.0.0.1:{web_port}/api/v1/query?" + urllib.parse.urlencode({"query": expression})
                with urllib.request.urlopen(url, timeout=5) as answer:
                    body = json.load(answer)
                assert body["status"] == "success", body
                result = body["data"]["result"]
                return float(result[0]["value"][1]) if result else None

            def wait_for(expression, timeout=30.0):
                # Bounded wait for Prometheus to have scraped; no claim about speed.
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline:
                    assert prometheus.poll() is None, log_path.read_text()[-3000:]
                    try:
                        got = query(expression)
                        if got is not None:
                            return got
                    except (urllib.error.URLError, ConnectionError):
                        pass  # not listening yet
                    time.sleep(0.2)
                pytest.fail(f"Prometheus had no {expression} within {timeout} s; its log:\n"
                            + log_path.read_text()[-3000:])

            (row,) = get_stats(daemon)["data_parallel_jobs"]
            # A plain scrape config: `data_parallel_job` does not clash with the scrape's `job`.
            of_job = '{data_parallel_job="%s",job="fuyoud"}' % JOB
            assert wait_for(f'fuyou_data_parallel_live_ranks{of_job}') == 2
            assert wait_for(f'sum(fuyou_data_parallel_rank_chunk_updates_total{of_job})') == \
                row["chunk_updates"]
            assert wait_for(f'count(fuyou_data_parallel_rank_committed_step{of_job})') == WORLD
            assert wait_for(f'min(fuyou_data_parallel_rank_committed_step{of_job})') == \
                wait_for(f'fuyou_data_parallel_committed_step{of_job}') == 2
        finally:
            prometheus.terminate()
            try:
                prometheus.wait(10)
            except subprocess.TimeoutExpired:
                prometheus.kill()
