#!/usr/bin/env python3
"""RPC fuzz test of fuyoud (CTest: rpc_fuzz, labels fuzz and integration).

Starts a real fuyoud (in CI the ASan+UBSan one of build-asan) on a private
socket, then for FUYOU_FUZZ_SECONDS (default 60) runs side by side:
- fuzz_worker.py as uid 65534 (nobody): random and mutated messages on every RPC
  and stream message, see its docstring;
- legit_job (C++, the real clientlib) as root, again and again: trains a job of
  its own, checks every weight against a plain AdamW, resumes it and deletes it.
Passes when the worker found nothing, every legit_job run passed (at least one
ran to its end), and the daemon, stopped with SIGTERM, exits 0 with no sanitizer
report on its stderr. Otherwise it fails and prints what it saw, the daemon's
stderr (with the sanitizer's report) included.

Usage: rpc_fuzz.py --daemon PATH --legit-job PATH --pb2-dir DIR [--seconds N]
Needs root (to run the worker as another user).
"""

import argparse
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import grpc

NOBODY = 65534
# The limits of issue 20 that the worker checks (fuzz_worker.py's connection_flood, copy_job).
MAX_CONNECTIONS_PER_USER = 32
MAX_STORAGE_PER_USER = "512MiB"
SANITIZER_MARKERS = ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:",
                     "SUMMARY: AddressSanitizer", "SUMMARY: UndefinedBehaviorSanitizer", "ERROR: ThreadSanitizer")
HERE = os.path.dirname(os.path.abspath(__file__))


def log(message):
    print(f"rpc_fuzz: {message}", flush=True)


def health(socket_path, timeout):
    """True when the daemon at socket_path answers Health."""
    with grpc.insecure_channel("unix:" + socket_path) as channel:
        try:
            channel.unary_unary("/fuyou.v1.Admin/Health")(b"", timeout=timeout)
            return True
        except grpc.RpcError:
            return False


class LegitJobs:
    """Runs legit_job again and again (new job each time) until stopped."""

    def __init__(self, program, socket_path, steps=4):
        self.program = program
        self.socket_path = socket_path
        self.steps = steps
        self.passed = 0
        self.failures = []
        self._stop = threading.Event()
        self._process = None
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self):
        self._thread.start()

    def _loop(self):
        run = 0
        while not self._stop.is_set() or self.passed == 0:
            job = f"legit-{os.urandom(6).hex()}-{run}"
            run += 1
            self._process = subprocess.Popen([self.program, self.socket_path, job, str(self.steps)],
                                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            output, _ = self._process.communicate()
            if self._process.returncode == 0:
                self.passed += 1
            elif not self._stop.is_set() or self._process.returncode > 0:
                self.failures.append(f"{job}: exit {self._process.returncode}: {output.strip()[-3000:]}")
                return
            else:
                return  # killed by kill()

    def kill(self):
        """Stops at once (the daemon is gone: the run in progress cannot pass)."""
        self._stop.set()
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
        self._thread.join()

    def stop_and_wait(self):
        """Lets the run in progress (or a first one) finish."""
        self._stop.set()
        self._thread.join()


def start_daemon(daemon, tmp, stderr_file):
    socket_path = os.path.join(tmp, "fuyoud.sock")
    args = [daemon, "--socket", socket_path, "--data-dir", os.path.join(tmp, "data"), "--socket-mode", "0666",
            "--dram-budget", "64MiB", "--max-segment", "8MiB", "--job-quota", "256MiB", "--drain-seconds", "5",
            "--log-level", "warn", "--max-connections-per-user", str(MAX_CONNECTIONS_PER_USER),
            "--max-storage-per-user", MAX_STORAGE_PER_USER]
    process = subprocess.Popen(args, stdout=stderr_file, stderr=stderr_file, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return process, socket_path
        if os.path.exists(socket_path) and health(socket_path, 5):
            return process, socket_path
        time.sleep(0.1)
    return process, socket_path


def prepare_worker(tmp, pb2_dir):
    """A directory the unprivileged worker can read (the build tree may be under a
    private home) and one it can write (hypothesis's scratch files)."""
    lib = os.path.join(tmp, "worker-lib")
    os.mkdir(lib)
    for source in glob.glob(os.path.join(HERE, "fuzz_*.py")) + glob.glob(os.path.join(pb2_dir, "*_pb2.py")):
        shutil.copy(source, lib)
    home = os.path.join(tmp, "worker-home")
    os.mkdir(home)
    os.chown(home, NOBODY, NOBODY)
    return lib, home


def sanitizer_report(text):
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if any(marker in line for marker in SANITIZER_MARKERS):
            return "\n".join(lines[max(0, i - 2):i + 80])
    return ""


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--daemon", required=True)
    parser.add_argument("--legit-job", required=True)
    parser.add_argument("--pb2-dir", required=True)
    parser.add_argument("--seconds", type=float, default=float(os.environ.get("FUYOU_FUZZ_SECONDS", "60")))
    args = parser.parse_args()
    if os.geteuid() != 0:
        log("needs root, to run the fuzzer as uid 65534 beside a job of root; skipped")
        return 77  # CTest's SKIP_RETURN_CODE

    tmp = tempfile.mkdtemp(prefix="fuyou-fuzz-")
    os.chmod(tmp, 0o755)
    problems = []
    daemon_log_path = os.path.join(tmp, "fuyoud.log")
    daemon_log = open(daemon_log_path, "w")
    daemon = None
    try:
        daemon, socket_path = start_daemon(args.daemon, tmp, daemon_log)
        if daemon.poll() is not None or not health(socket_path, 5):
            problems.append("fuyoud did not start")
            return 1
        log(f"fuyoud pid {daemon.pid} on {socket_path}; fuzzing for {args.seconds:.0f} s as uid {NOBODY}, "
            f"legit_job as uid {os.getuid()}")
        lib, home = prepare_worker(tmp, args.pb2_dir)
        legit = LegitJobs(args.legit_job, socket_path)
        legit.start()
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": lib, "HOME": home, "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1", "HYPOTHESIS_STORAGE_DIRECTORY": os.path.join(home, ".hypothesis"),
               "FUYOU_FUZZ_DETAILS": os.environ.get("FUYOU_FUZZ_DETAILS", "")}
        started = time.monotonic()
        worker = subprocess.Popen(
            [sys.executable, os.path.join(lib, "fuzz_worker.py"), "--socket", socket_path, "--daemon-pid",
             str(daemon.pid), "--seconds", str(args.seconds), "--max-connections-per-user",
             str(MAX_CONNECTIONS_PER_USER), "--max-storage-per-user", str(512 << 20)],
            cwd=home, env=env, user=NOBODY, group=NOBODY, extra_groups=[])
        while worker.poll() is None:
            if daemon.poll() is not None:
                problems.append(f"fuyoud died while fuzzing (exit status {daemon.returncode})")
                worker.kill()
                worker.wait()
                break
            time.sleep(0.2)
        if worker.returncode != 0 and daemon.returncode is None:
            problems.append(f"the fuzzer found a problem (exit {worker.returncode}; its report is above)")
        log(f"fuzzer done after {time.monotonic() - started:.0f} s; waiting for the legit job in progress")
        if daemon.poll() is None:
            legit.stop_and_wait()
        else:
            legit.kill()
        log(f"legit_job: {legit.passed} runs passed, {len(legit.failures)} failed")
        problems += [f"legit_job failed: {failure}" for failure in legit.failures]
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
            try:
                status = daemon.wait(timeout=120)
            except subprocess.TimeoutExpired:
                daemon.kill()
                status = daemon.wait()
                problems.append("fuyoud did not exit within 120 s of SIGTERM")
            if status != 0:
                problems.append(f"fuyoud exited with status {status} after SIGTERM, not 0")
    finally:
        if daemon is not None and daemon.poll() is None:
            daemon.kill()
            daemon.wait()
        daemon_log.close()
        with open(daemon_log_path, errors="replace") as f:
            daemon_output = f.read()
        report = sanitizer_report(daemon_output)
        if report:
            problems.append("the sanitizer reported:\n" + report)
        if problems:
            # Without protobuf's complaints about the fuzzer's invalid UTF-8.
            lines = [line for line in daemon_output.splitlines() if "contains invalid UTF-8" not in line]
            log("fuyoud's last output:\n" + "\n".join(lines)[-8000:])
        shutil.rmtree(tmp, ignore_errors=True)
        for problem in problems:
            log("FAIL: " + problem)
    if not problems:
        log("passed")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
