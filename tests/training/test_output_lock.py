"""One ``rloo train`` per output at a time (rloo.training.output_lock).

Two real ``rloo train`` processes on one local output_dir: the second is refused at start in one line naming
the first (host, pid, since when) and exits 75, writing nothing; the first carries on, its metrics.jsonl in
order, and the same command resumes after it stopped. A holder killed with SIGKILL blocks nobody. An s3://
output_dir is locked by a conditional write on the (real, SeaweedFS) server; stale locks are taken over.
Under torchrun only rank 0 locks, and a refusal stops every rank.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rloo.demo.tiny import TinySetup
from rloo.storage.errors import StorageError
from rloo.storage.location import Location
from rloo.training import output_lock
from rloo.training.output_lock import LOCK_NAME, Holder, LocalLock, OutputInUse, OutputLock, S3Lock
from tests.fixtures import recipes, zygote
from tests.fixtures.servers import S3Server, free_port, use_s3
from tests.fixtures.train_cli import start_train, train_argv, updates, wait_for_updates


def _run(argv: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return zygote.run(["-m", "rloo.cli", *argv], env=recipes.subprocess_env(**env), timeout=300)


def _error_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_a_second_run_on_one_output_dir_is_refused_and_the_first_carries_on(
    tiny_setup: TinySetup, toy_dataset: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    first = start_train(train_argv(tiny_setup, toy_dataset, str(out), max_steps=100_000))
    try:
        wait_for_updates(first, out, 2)
        second = _run(train_argv(tiny_setup, toy_dataset, str(out), max_steps=100_000))
        assert second.returncode == 75, second.stderr
        line = _error_line(second)
        assert line.startswith(
            f"rloo train: error: --output_dir {out} is in use by another rloo train (host "
            f"{socket.gethostname()}, pid {first.pid}, since 20"
        ), line
        assert f"lock {out / LOCK_NAME}" in line and "the same command resumes" in line
        assert first.poll() is None  # the first run is untouched
        first.send_signal(signal.SIGTERM)
        _, stderr = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 143, stderr
    assert not (out / LOCK_NAME).exists()  # released, and deleted, at the end
    (ckpt,) = out.glob("checkpoint-*")
    done = int(ckpt.name.split("-")[1])
    written = updates(out)
    assert written == list(range(1, len(written) + 1)) and len(written) >= done  # one writer, in order
    # the lock does not get in the way of resuming
    resumed = _run(train_argv(tiny_setup, toy_dataset, str(out), max_steps=done + 1))
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {ckpt}" in resumed.stdout
    assert updates(out) == list(range(1, done + 2))
    assert not (out / LOCK_NAME).exists()


def test_a_holder_killed_with_sigkill_blocks_nobody(
    tiny_setup: TinySetup, toy_dataset: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    first = start_train(train_argv(tiny_setup, toy_dataset, str(out), max_steps=100_000, save_steps=1))
    wait_for_updates(first, out, 3)
    first.kill()
    first.communicate(timeout=60)
    holder = Holder.parse((out / LOCK_NAME).read_bytes())  # left behind, naming a dead process
    assert holder is not None and holder.pid == first.pid
    again = _run(train_argv(tiny_setup, toy_dataset, str(out), max_steps=4, save_steps=1))
    assert again.returncode == 0, again.stderr
    assert "resumed from" in again.stdout
    assert not (out / LOCK_NAME).exists()


def test_a_refused_or_failed_start_leaves_no_output_dir(tmp_path: Path) -> None:
    out = tmp_path / "a" / "b" / "out"
    lock = OutputLock.acquire(out)
    assert (out / LOCK_NAME).is_file()
    again = OutputLock.acquire(out)  # a second trainer in the same process shares it
    again.release()
    assert (out / LOCK_NAME).is_file()
    other = LocalLock(out, flag="--output_dir", where=str(out), holder=Holder.this_process())
    with pytest.raises(OutputInUse, match=r"is in use by another rloo train \(host .*, pid \d+, since "):
        other.acquire()  # as another process would (flock locks conflict between open files)
    assert OutputInUse.exit_code == 75
    lock.release()
    lock.release()  # idempotent
    assert not (tmp_path / "a").exists()  # the lock made a/b/out; nothing else was written: all gone
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine\n")
    OutputLock.acquire(kept).release()
    assert sorted(p.name for p in kept.iterdir()) == ["notes.txt"]


# -- s3:// output_dir -------------------------------------------------------------------------------------
@pytest.fixture
def s3(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    return use_s3(s3_server, monkeypatch)


def _prefix(server: S3Server, name: str) -> Location:
    return Location.parse(f"s3://{server.bucket}/lock-tests/{name}-{os.getpid()}-{time.time_ns()}")


def _other_host() -> Holder:
    return Holder("another-host", 4242, "2030-01-01T00:00:00Z", "t0")


def test_s3_lock_is_a_conditional_write(s3: S3Server, caplog: pytest.LogCaptureFixture) -> None:
    loc = _prefix(s3, "cond")
    first = S3Lock(loc, flag="--output_dir", holder=_other_host())
    first.acquire()
    body = json.loads(s3.client().get_object(Bucket=s3.bucket, Key=f"{loc.key}/{LOCK_NAME}")["Body"].read())
    assert (body["host"], body["pid"]) == ("another-host", 4242)
    second = S3Lock(loc, flag="--output_dir", holder=Holder.this_process())
    with pytest.raises(OutputInUse) as info:
        second.acquire()
    msg = str(info.value)
    assert msg.startswith(
        f"--output_dir {loc.uri} is in use by another rloo train (host another-host, pid 4242, since "
        "2030-01-01T00:00:00Z; lock "
    )
    assert "its lock expires 120s after its last refresh" in msg and "\n" not in msg
    first.release()
    with pytest.raises(Exception, match=r"NoSuchKey|Not Found|404"):
        s3.client().get_object(Bucket=s3.bucket, Key=f"{loc.key}/{LOCK_NAME}")
    second.acquire()  # free again
    second.release()


def test_s3_lock_on_a_missing_bucket_says_so_and_creates_nothing(s3: S3Server) -> None:
    loc = Location.parse("s3://rloo-lock-no-such-bucket/x")
    with pytest.raises(StorageError, match="bucket 'rloo-lock-no-such-bucket' does not exist"):
        S3Lock(loc, flag="--output_dir", holder=Holder.this_process()).acquire()
    # SeaweedFS creates a bucket on a write into it: the lock never writes before the bucket is known
    names = [b["Name"] for b in s3.client().list_buckets()["Buckets"]]
    assert "rloo-lock-no-such-bucket" not in names


def test_s3_stale_locks_are_taken_over(
    s3: S3Server, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    loc = _prefix(s3, "stale")
    key = f"{loc.key}/{LOCK_NAME}"
    # a process of this host that is gone: taken over at once
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = Holder(socket.gethostname(), dead.pid, "2030-01-01T00:00:00Z", "t1")
    s3.client().put_object(Bucket=s3.bucket, Key=key, Body=gone.to_json())
    with caplog.at_level(logging.WARNING, logger="rloo"):
        taker = S3Lock(loc, flag="--output_dir", holder=Holder.this_process())
        taker.acquire()
    assert f"took over a stale lock (of host {socket.gethostname()}, pid {dead.pid}" in caplog.text
    taker.release()
    # another host's lock not refreshed for longer than the expiry: taken over
    monkeypatch.setattr(output_lock, "S3_EXPIRY_S", 1.0)
    s3.client().put_object(Bucket=s3.bucket, Key=key, Body=_other_host().to_json())
    time.sleep(2.5)  # Last-Modified has whole seconds
    late = S3Lock(loc, flag="--output_dir", holder=Holder.this_process())
    late.acquire()
    assert json.loads(s3.client().get_object(Bucket=s3.bucket, Key=key)["Body"].read())["pid"] == os.getpid()
    late.release()


def test_s3_lock_is_refreshed_and_a_lost_one_is_not_deleted(
    s3: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(output_lock, "S3_HEARTBEAT_S", 0.2)
    loc = _prefix(s3, "beat")
    key = f"{loc.key}/{LOCK_NAME}"
    lock = S3Lock(loc, flag="--output_dir", holder=_other_host())
    lock.acquire()
    first_etag = lock.etag
    deadline = time.monotonic() + 20
    while lock.etag == first_etag:  # each refresh is a new write
        assert time.monotonic() < deadline, "never refreshed"
        time.sleep(0.05)
    # someone else took it over: this run stops refreshing and leaves their lock alone
    s3.client().put_object(Bucket=s3.bucket, Key=key, Body=Holder.this_process().to_json())
    deadline = time.monotonic() + 20
    while not lock.lost:
        assert time.monotonic() < deadline, "never noticed"
        time.sleep(0.05)
    lock.release()
    assert json.loads(s3.client().get_object(Bucket=s3.bucket, Key=key)["Body"].read())["pid"] == os.getpid()
    s3.client().delete_object(Bucket=s3.bucket, Key=key)


def test_rloo_train_on_an_s3_output_held_by_another_process_is_refused(
    s3: S3Server, tiny_setup: TinySetup, toy_dataset: Path, tmp_path: Path
) -> None:
    loc = _prefix(s3, "train")
    holder = S3Lock(loc, flag="--output_dir", holder=_other_host())
    holder.acquire()
    try:
        argv = [
            *train_argv(tiny_setup, toy_dataset, loc.uri, max_steps=1),
            "--local_dir",
            str(tmp_path / "stage"),
        ]
        refused = _run(argv, **s3.env())
    finally:
        holder.release()
    assert refused.returncode == 75, refused.stderr
    line = _error_line(refused)
    assert line.startswith(
        f"rloo train: error: --output_dir {loc.uri} is in use by another rloo train (host another-host, "
        "pid 4242, since 2030-01-01T00:00:00Z; lock "
    ), line
    assert not (tmp_path / "stage").exists()  # the staging directory is gone with its lock
    assert s3.client().list_objects_v2(Bucket=s3.bucket, Prefix=loc.key + "/").get("KeyCount") == 0


# -- several processes --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_under_torchrun_only_rank_0_locks_and_a_refusal_stops_every_rank(
    tiny_setup: TinySetup, toy_dataset: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    cmd += ["--master_port", str(free_port()), "-m", "rloo.cli"]
    argv = train_argv(tiny_setup, toy_dataset, str(out), max_steps=1)
    # rank 1 taking the lock too would refuse its own run: the plain run trains
    ok = subprocess.run(
        [*cmd, *argv], env=recipes.subprocess_env(), capture_output=True, text=True, timeout=300
    )
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert (out / "training_complete.json").is_file() and not (out / LOCK_NAME).exists()
    held = OutputLock.acquire(tmp_path / "busy")
    try:
        start = time.monotonic()
        refused = subprocess.run(
            [*cmd, *train_argv(tiny_setup, toy_dataset, str(tmp_path / "busy"), max_steps=1)],
            env=recipes.subprocess_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert time.monotonic() - start < 120  # no rank left waiting
    finally:
        held.release()
    assert refused.returncode != 0
    errors = [line for line in refused.stderr.splitlines() if line.startswith("rloo train: error:")]
    assert len(errors) == 2, refused.stderr[-3000:]  # one line from each rank
    assert all(f"--output_dir {tmp_path / 'busy'} is in use by another rloo train" in e for e in errors)
