"""fuyoud's Prometheus endpoint (issue 13): a real daemon that trains, its
/metrics parsed with prometheus_client's own parser and checked against GetStats;
and a real Prometheus server that scrapes it (marked slow and integration)."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

import fuyou
from metrics_util import free_port, get_stats, open_optimizer, scrape, start_metrics_daemon, train

parser = pytest.importorskip("prometheus_client.parser",
                             reason="python3-prometheus-client is not installed (deploy/install-deps.sh)")


def samples(text: str) -> dict:
    """{(sample name, frozenset(labels)): value} and the families' types."""
    values, types = {}, {}
    for family in parser.text_string_to_metric_families(text):
        types[family.name] = family.type
        for sample in family.samples:
            values[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return values, types


def value(values, name, **labels):
    return values[(name, frozenset(labels.items()))]


@pytest.fixture
def metrics_daemon():
    with tempfile.TemporaryDirectory(prefix="fuyou-metrics-") as tmp:
        port = free_port()
        daemon = start_metrics_daemon(Path(tmp), port)
        try:
            yield daemon, port
        finally:
            daemon.stop()


def fetch_weights_twice(daemon):
    """Two FetchWeights of a chunk that stores its working weights (issue 12)."""
    from fuyou import _fuyou
    session = _fuyou.Session.open("metrics-weights", 2, 4096, address=daemon.address)
    session.register_chunk(0, 1024, _fuyou.DTYPE_BFLOAT16, _fuyou.DTYPE_FLOAT32, bytearray(2048),
                           store_weights=True)
    for _ in range(2):
        slot = session.acquire_slot(5.0)
        session.send_fetch_weights(0, slot)
        session.release_slot(session.wait_weights(0, 10.0))
    session.close()


def test_metrics_parse_and_show_the_figures_of_get_stats(metrics_daemon):
    daemon, port = metrics_daemon
    assert f"Prometheus metrics on http://127.0.0.1:{port}/metrics" in daemon.log_tail(100000)
    model, opt = open_optimizer(daemon, "metrics-job")
    train(model, opt, steps=4)
    admin = fuyou.admin_client(daemon.address)
    during, _ = samples(scrape(port))
    assert value(during, "fuyou_sessions") == 1
    opt.close()
    fetch_weights_twice(daemon)
    stats = get_stats(daemon)
    values, types = samples(scrape(port))
    assert stats["scope"] == "STATS_SCOPE_DAEMON"

    assert types["fuyou_chunk_updates"] == "counter"
    assert types["fuyou_chunk_update_seconds"] == "histogram"
    assert types["fuyou_step_seconds"] == "histogram"
    assert types["fuyou_dram_budget_bytes"] == "gauge"
    assert types["fuyou_build_info"] == "gauge"
    # Same figures as GetStats (nothing trains between the two reads).
    assert stats["chunk_updates"] > 0
    assert value(values, "fuyou_chunk_updates_total") == stats["chunk_updates"]
    assert value(values, "fuyou_params_updated_total") == stats["params_updated"]
    assert value(values, "fuyou_steps_committed_total") == stats["steps_committed"] == 4
    assert value(values, "fuyou_cache_hits_total") == stats["cache_hits"]
    assert value(values, "fuyou_cache_misses_total") == stats["cache_misses"]
    assert value(values, "fuyou_dram_budget_bytes") == stats["dram_budget_bytes"] == 256 << 20
    assert value(values, "fuyou_dram_bytes_in_use") == stats["dram_bytes_in_use"]
    assert value(values, "fuyou_sessions") == stats["live_sessions"] == 0
    for path in stats["storage"]:
        assert value(values, "fuyou_storage_read_bytes_total", path=path["path"]) == path["bytes_read"]
        assert value(values, "fuyou_storage_written_bytes_total", path=path["path"]) == path["bytes_written"]
    assert sum(p["bytes_written"] for p in stats["storage"]) > 0
    assert value(values, "fuyou_chunks_speculative_total") == stats["chunks_speculative"]
    assert value(values, "fuyou_chunks_redone_total", reason="changed") == stats["chunks_redone_changed"]
    assert value(values, "fuyou_chunks_redone_total", reason="clipped") == stats["chunks_redone_clipped"]
    assert value(values, "fuyou_chunks_rolled_back_total", reason="skipped_step") == \
        stats["chunks_rolled_back_skipped_step"]
    assert value(values, "fuyou_redo_seconds_total") == pytest.approx(stats["redo_seconds"])
    assert types["fuyou_weights_fetches"] == "counter"
    assert value(values, "fuyou_weights_fetches_total") == stats["weights_fetches"] == 2
    assert value(values, "fuyou_weights_fetch_cache_hits_total") == stats["weights_fetch_cache_hits"]
    assert value(values, "fuyou_weights_read_bytes_total") == stats["weights_bytes_read"]
    health = admin.health()
    assert value(values, "fuyou_build_info", version=health["version"]) == 1
    assert value(values, "fuyou_uptime_seconds") > 0
    # One kernel-time observation per chunk update; one step time per commit
    # after a session's first.
    assert value(values, "fuyou_chunk_update_seconds_count") == stats["chunk_updates"]
    assert value(values, "fuyou_chunk_update_seconds_bucket", le="+Inf") == stats["chunk_updates"]
    assert value(values, "fuyou_chunk_update_seconds_sum") > 0
    assert value(values, "fuyou_step_seconds_count") == 3


def test_only_get_metrics_is_served(metrics_daemon):
    _, port = metrics_daemon
    with pytest.raises(urllib.error.HTTPError) as not_found:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10)
    assert not_found.value.code == 404
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", data=b"x", method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code in (405, 413)


def test_a_metrics_address_in_use_stops_the_daemon_with_a_message(tmp_path):
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(fuyou.DaemonUnavailable) as refused:
            start_metrics_daemon(tmp_path, port)
    assert f"cannot bind the metrics address 127.0.0.1:{port}" in str(refused.value)


def test_metrics_are_off_unless_configured(daemon):
    """The default daemon (conftest's) has no metrics listener: the log says
    nothing about it and no HTTP port is opened."""
    assert "Prometheus metrics on" not in daemon.log_tail(100000)


PROMETHEUS = "/usr/bin/prometheus"


def prometheus_query(port: int, query: str):
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    with urllib.request.urlopen(url, timeout=5) as answer:
        body = json.load(answer)
    assert body["status"] == "success", body
    result = body["data"]["result"]
    return float(result[0]["value"][1]) if result else None


@pytest.mark.slow
@pytest.mark.integration
def test_a_real_prometheus_scrapes_a_training_daemon(metrics_daemon, tmp_path):
    if shutil.which(PROMETHEUS) is None:
        pytest.skip(f"{PROMETHEUS} not installed (Debian package prometheus, deploy/install-deps.sh)")
    daemon, metrics_port = metrics_daemon
    web_port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: fuyoud\n    scrape_timeout: 1s\n"
        f"    static_configs:\n      - targets: ['127.0.0.1:{metrics_port}']\n")
    log = open(tmp_path / "prometheus.log", "wb")
    prometheus = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{web_port}"], stdout=log, stderr=subprocess.STDOUT)
    try:
        model, opt = open_optimizer(daemon, "scraped-job")

        def wait_for(what, condition, timeout=20.0):
            # Bounded wait for Prometheus to have scraped; no claim about speed.
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                assert prometheus.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
                try:
                    got = condition()
                    if got is not None:
                        return got
                except (urllib.error.URLError, ConnectionError):
                    pass  # not listening yet
                time.sleep(0.2)
            pytest.fail(f"Prometheus did not {what} within {timeout} s; its log:\n"
                        + (tmp_path / "prometheus.log").read_text()[-3000:])

        train(model, opt, steps=1)
        first = wait_for("scrape fuyoud", lambda: prometheus_query(web_port, "fuyou_chunk_updates_total"))
        train(model, opt, steps=3, first=1)
        grown = wait_for("see fuyou_chunk_updates_total grow", lambda: (
            lambda v: v if v is not None and v > first else None)(
                prometheus_query(web_port, "fuyou_chunk_updates_total")))
        opt.close()
        assert grown > first
        assert wait_for("see the target up", lambda: prometheus_query(web_port, 'up{job="fuyoud"}')) == 1
    finally:
        prometheus.terminate()
        try:
            prometheus.wait(10)
        except subprocess.TimeoutExpired:
            prometheus.kill()
        log.close()
