"""The admin API's job listing from Python: one's own jobs, all users' for an
administrator, and a damaged job shown as such (issue 8)."""

import os
from pathlib import Path

import pytest

import fuyou
from helpers import make_model
from train_util import CHUNK_BYTES, step_loss


def _train_one_step(daemon, job):
    model = make_model()
    opt = fuyou.AdamW(model.parameters(), address=daemon.address, timeout=20.0, chunk_bytes=CHUNK_BYTES,
                      lr=1e-3, job=job)
    step_loss(model, 0).backward()
    opt.step()
    opt.close()


def test_list_jobs_shows_own_jobs_and_all_users_for_an_administrator(daemon):
    if os.geteuid() != 0:
        pytest.skip("all_users is for administrators: run as root (the CI user)")
    _train_one_step(daemon, "admin-listed")
    admin = fuyou.admin_client(daemon.address)
    own = {j["name"]: j for j in admin.list_jobs()}
    assert own["admin-listed"]["owner_uid"] == os.geteuid()
    assert own["admin-listed"]["committed_step"] == 1
    assert own["admin-listed"]["damaged"] == ""
    everyone = {j["name"] for j in admin.list_jobs(all_users=True)}
    assert "admin-listed" in everyone


def test_a_damaged_job_is_listed_with_its_reason_and_can_be_deleted(daemon):
    _train_one_step(daemon, "admin-damaged")
    manifest = Path(daemon.data_dir) / "users" / str(os.geteuid()) / "jobs" / "admin-damaged" / "manifest.pb"
    manifest.write_bytes(b"garbage")
    admin = fuyou.admin_client(daemon.address)
    listed = {j["name"]: j for j in admin.list_jobs()}
    assert listed["admin-damaged"]["damaged"] != ""
    admin.delete_job("admin-damaged")
    assert "admin-damaged" not in {j["name"] for j in admin.list_jobs()}
