"""The multi-node job on the cluster, against the Kubernetes API boundary (the real Kubeflow SDK above it):
created, followed, adopted or replaced by a retried step, and deleted on every way out but success."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import pytest

from rloo.k8s.builders import OwnerPod, build_job, build_pytorchjob, build_trainjob, owner_from_env
from rloo.k8s.jobs import run_multi_node
from tests.fixtures.kube_api import FakeKubeAPI, install_fake_api
from tests.k8s.test_builders import OWNER_REF, POD_ENV, _spec


@pytest.fixture
def kube(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Install a FakeKubeAPI (made by the returned function) in place of the Kubernetes client's APIs."""

    def install(**kw: Any) -> FakeKubeAPI:
        return install_fake_api(monkeypatch, **kw)

    return install


def test_trainjob_step_creates_follows_and_returns(kube: Any, capsys: pytest.CaptureFixture[str]) -> None:
    fake = kube()
    m = build_trainjob(_spec())
    run_multi_node(m, poll_seconds=0.05, timeout_s=60)
    assert fake.created == [m]
    out = capsys.readouterr().out
    assert "[rloo] created TrainJob team-a/rloo-train-abc" in out
    assert "[node-0] step 1 loss 0.5\n[node-0] done\n" in out  # node 0's log, streamed through the SDK


def test_trainjob_step_fails_with_the_controllers_reason(kube: Any) -> None:
    kube(outcome="Failed", reason="DeadlineExceeded", message="TrainJob exceeded\n its deadline")
    with pytest.raises(
        RuntimeError,
        match=r"^TrainJob team-a/rloo-train-abc failed: DeadlineExceeded: TrainJob exceeded its deadline$",
    ):
        run_multi_node(build_trainjob(_spec()), poll_seconds=0.05, timeout_s=60)


def _condition(kind: str, reason: str) -> dict[str, str]:
    return {
        "type": kind,
        "status": "True",
        "reason": reason,
        "message": "",
        "lastTransitionTime": "2025-12-31T23:00:00Z",
    }


@pytest.mark.parametrize("kind", ["trainjob", "pytorchjob"])
def test_retried_step_replaces_a_failed_job_and_adopts_a_running_one(
    kind: str, kube: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    m = build_job(_spec(), kind)
    ok = "Complete" if kind == "trainjob" else "Succeeded"
    fake = kube(outcome=ok, existing=[_condition("Failed", "BackoffLimitExceeded")])
    run_multi_node(m, poll_seconds=0.05, timeout_s=60)
    assert fake.deleted == ["rloo-train-abc"] and fake.created == [m]
    assert "failed before this retry: replacing it" in capsys.readouterr().out
    fake = kube(outcome=ok, existing=[] if kind == "trainjob" else [_condition("Created", "Created")])
    run_multi_node(m, poll_seconds=0.05, timeout_s=60)
    assert fake.deleted == [] and fake.created == []
    assert "adopting" in capsys.readouterr().out


def test_pytorchjob_step_follows_the_master(kube: Any, capsys: pytest.CaptureFixture[str]) -> None:
    kube(outcome="Failed", reason="PyTorchJobFailed", message="Worker exited 137")
    with pytest.raises(
        RuntimeError, match=r"^PyTorchJob team-a/rloo-train-abc failed: PyTorchJobFailed: Worker exited 137$"
    ):
        run_multi_node(build_pytorchjob(_spec()), poll_seconds=0.05, timeout_s=60)
    assert "[master] step 1 loss 0.5\n" in capsys.readouterr().out


# The step's job does not outlive it: every way out but success deletes it ------------------------------------

KINDS = ["trainjob", "pytorchjob"]
DONE = {"trainjob": "Complete", "pytorchjob": "Succeeded"}
PLURAL = {"trainjob": "trainjobs", "pytorchjob": "pytorchjobs"}
WHAT = {"trainjob": "TrainJob team-a/rloo-train-abc", "pytorchjob": "PyTorchJob team-a/rloo-train-abc"}


def _api_error(status: int, message: str = "") -> Exception:
    from kubernetes.client.rest import ApiException

    error = ApiException(
        status=status, reason={403: "Forbidden", 500: "Internal Server Error"}.get(status, "")
    )
    error.body = json.dumps({"kind": "Status", "message": message}) if message else None
    return error


@pytest.fixture
def fast_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    from rloo.k8s import jobs

    monkeypatch.setattr(
        jobs, "API_BACKOFF_S", 0.01, raising=False
    )  # (raising: the tests also run on old code)


@pytest.mark.parametrize("kind", KINDS)
def test_sigterm_deletes_the_job_and_exits_143(
    kind: str, kube: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """KFP terminating the run sends the step's pod SIGTERM: the job goes with it, not 48 hours later."""
    import signal
    import threading
    import time

    fake = kube(outcome=None)  # a job that would run on

    class Previous(Exception):
        pass

    def previous(signum: int, frame: Any) -> None:
        raise Previous()

    def terminate_once_the_job_runs() -> None:
        # not after a fixed delay: importing the Kubeflow SDK alone can take longer than that on a busy machine
        deadline = time.monotonic() + 60
        while not fake.created and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGTERM)

    before = signal.signal(signal.SIGTERM, previous)
    timer = threading.Thread(target=terminate_once_the_job_runs, daemon=True)
    try:
        timer.start()
        with pytest.raises(SystemExit) as info:
            run_multi_node(
                build_job(_spec(owner=owner_from_env(POD_ENV)), kind), poll_seconds=0.05, timeout_s=60
            )
        assert info.value.code == 143
        assert signal.getsignal(signal.SIGTERM) is previous  # the step's handler is gone again
    finally:
        timer.join(timeout=60)
        signal.signal(signal.SIGTERM, before)
    assert fake.deleted == ["rloo-train-abc"] and fake.objects == {}
    assert fake.delete_policies == ["Foreground"]  # the pods go first
    assert fake.created[0]["metadata"]["ownerReferences"] == [OWNER_REF]
    assert f"the train step was terminated: deleting {WHAT[kind]}" in capsys.readouterr().out


@pytest.mark.parametrize("kind", KINDS)
def test_transient_api_errors_are_retried_and_the_job_kept(
    kind: str, kube: Any, fast_backoff: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 503 on create and an API server answering 500 for a while: the step gets through, the job completes
    and stays (a finished job holds nothing, and a retried step finds it and returns)."""
    faults = {"create": [_api_error(503)], "get": [_api_error(500), _api_error(500), _api_error(500)]}
    fake = kube(outcome=DONE[kind], faults=faults)
    m = build_job(_spec(), kind)
    run_multi_node(m, poll_seconds=0.05, timeout_s=60)
    assert fake.faults == {"create": [], "get": []}  # every fault was met
    assert fake.created == [m] and fake.deleted == []
    (job,) = fake.objects.values()
    assert job["status"]["conditions"][-1]["type"] == DONE[kind]
    out = capsys.readouterr().out
    assert f"[rloo] create {WHAT[kind]}: 503; retrying in 0.01s (1/7)" in out
    assert f"[rloo] {WHAT[kind]} succeeded" in out


@pytest.mark.parametrize("kind", KINDS)
def test_a_refused_call_fails_at_once_and_the_job_is_deleted(
    kind: str, kube: Any, fast_backoff: None, capsys: pytest.CaptureFixture[str]
) -> None:
    denied = _api_error(403, f'{PLURAL[kind]} "rloo-train-abc" is forbidden: User cannot get')
    # every read refused (a Role without "get"): the SDK's reads for the log thread meet it too
    fake = kube(outcome=None, faults={"get": [denied] * 100})
    with pytest.raises(RuntimeError) as info:
        run_multi_node(build_job(_spec(), kind), poll_seconds=0.05, timeout_s=10)
    assert str(info.value) == (
        f'could not read {WHAT[kind]}: 403 Forbidden: {PLURAL[kind]} "rloo-train-abc" is forbidden: User cannot '
        "get (the pipeline's service account needs the Role the Helm chart installs)"
    )
    assert "retrying" not in capsys.readouterr().out
    assert fake.deleted == ["rloo-train-abc"] and fake.objects == {}


def test_retries_are_bounded(kube: Any, fast_backoff: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from rloo.k8s import jobs

    monkeypatch.setattr(jobs, "API_ATTEMPTS", 3, raising=False)
    fake = kube(outcome=None, faults={"get": [_api_error(500)] * 100})
    with pytest.raises(
        RuntimeError, match=r"^could not read TrainJob team-a/rloo-train-abc: 500 .*\(after 3 attempts\)$"
    ):
        run_multi_node(build_trainjob(_spec()), poll_seconds=0.05, timeout_s=60)
    assert fake.deleted == ["rloo-train-abc"]


@pytest.mark.parametrize("kind", KINDS)
def test_the_steps_timeout_deletes_the_job(kind: str, kube: Any) -> None:
    import threading

    fake = kube(outcome=None)
    # (before this change a PyTorchJob step had no timeout: the job finishing late keeps such a run from hanging)
    late = threading.Timer(8.0, lambda: (setattr(fake, "outcome", DONE[kind]), fake._finish()))
    late.start()
    try:
        with pytest.raises(TimeoutError, match=f"^{WHAT[kind]} did not finish within the step's 2 s$"):
            run_multi_node(build_job(_spec(), kind), poll_seconds=0.05, timeout_s=2)
    finally:
        late.cancel()
    assert fake.deleted == ["rloo-train-abc"] and fake.objects == {}


@pytest.mark.parametrize("kind", KINDS)
def test_a_failed_job_is_deleted_and_its_reason_raised(kind: str, kube: Any) -> None:
    fake = kube(outcome="Failed", reason="BackoffLimitExceeded", message="node-0 exited with 137")
    with pytest.raises(
        RuntimeError, match=f"^{WHAT[kind]} failed: BackoffLimitExceeded: node-0 exited with 137$"
    ):
        run_multi_node(build_job(_spec(owner=owner_from_env(POD_ENV)), kind), poll_seconds=0.05, timeout_s=60)
    assert fake.created[0]["metadata"]["ownerReferences"] == [OWNER_REF]
    assert fake.deleted == ["rloo-train-abc"] and fake.objects == {}
    assert fake.delete_policies == ["Foreground"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_retried_step_adopts_the_running_job_and_owns_it_too(kind: str, kube: Any) -> None:
    """The first attempt's pod may be deleted while the retry waits: the job must not go with it."""
    fake = kube(outcome=DONE[kind])
    first = build_job(_spec(owner=OwnerPod("attempt-1", "uid-1", "team-a")), kind)
    fake.put(PLURAL[kind], first, resourceVersion="7")
    run_multi_node(build_job(_spec(owner=owner_from_env(POD_ENV)), kind), poll_seconds=0.05, timeout_s=60)
    assert fake.created == [] and fake.deleted == []
    (job,) = fake.objects.values()
    assert [r["uid"] for r in job["metadata"]["ownerReferences"]] == ["uid-1", "1f0c-uid"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_job_being_deleted_is_replaced_not_adopted(kind: str, kube: Any) -> None:
    """An earlier attempt's clean-up is still deleting the job (Foreground waits for its pods)."""
    fake = kube(outcome=DONE[kind])
    old = build_job(_spec(), kind)
    fake.put(PLURAL[kind], old, deletionTimestamp="2026-01-01T00:00:00Z")
    m = build_job(_spec(), kind)
    run_multi_node(m, poll_seconds=0.05, timeout_s=60)
    assert fake.deleted == ["rloo-train-abc"] and fake.created == [m]


def test_transient_errors_are_told_from_refusals() -> None:
    import urllib3

    from rloo.k8s.jobs import is_transient

    def sdk_wrapped(error: Exception) -> RuntimeError:  # how the Kubeflow SDK raises every failure
        try:
            raise RuntimeError("Failed to get TrainJob: team-a/x") from error
        except RuntimeError as e:
            return e

    for status in (429, 500, 502, 503, 504):
        assert is_transient(_api_error(status)) and is_transient(sdk_wrapped(_api_error(status)))
    for status in (400, 401, 403, 404, 409, 422):
        assert not is_transient(_api_error(status)) and not is_transient(sdk_wrapped(_api_error(status)))
    reset = urllib3.exceptions.ProtocolError("Connection aborted.", ConnectionResetError(104, "reset"))
    assert is_transient(reset) and is_transient(sdk_wrapped(reset))
    assert is_transient(sdk_wrapped(TimeoutError("Timeout to get TrainJob")))
    assert not is_transient(ValueError("bad")) and not is_transient(RuntimeError("TrainJob x is Failed"))


def _job(*conds: tuple[str, str, str, str]) -> dict[str, object]:
    return {
        "status": {
            "conditions": [
                {"type": t, "status": st, "lastTransitionTime": ts, "reason": "R" + t, "message": msg}
                for t, st, ts, msg in conds
            ]
        }
    }


def test_job_outcome_follows_the_newest_terminal_condition() -> None:
    from rloo.k8s.jobs import job_outcome, on_existing_job

    assert job_outcome({}) == ("running", "")
    created = ("Created", "True", "2026-01-01T00:00:00Z", "")
    running = ("Running", "True", "2026-01-01T00:01:00Z", "")
    assert job_outcome(_job(created, running)) == ("running", "")
    failed = ("Failed", "True", "2026-01-01T00:05:00Z", "master exited\n with code 137")
    assert job_outcome(_job(created, running, failed)) == ("failed", "RFailed: master exited with code 137")
    # listed out of order, a later success (after a restart) wins over an earlier failure
    succeeded = ("Succeeded", "True", "2026-01-01T00:09:00Z", "done")
    assert job_outcome(_job(succeeded, created, failed))[0] == "succeeded"
    # a condition that is no longer true does not count
    assert job_outcome(_job(("Failed", "False", "2026-01-01T00:05:00Z", "x"), running))[0] == "running"
    assert on_existing_job(_job(created, running, failed)) == "replace"
    assert on_existing_job(_job(created, running)) == "wait"
    assert on_existing_job(_job(created, succeeded)) == "wait"


# A job Kueue never admits: the wait for admission is bounded, and Kueue's Workload says why -------------------


def _workload(
    job: str, *conditions: dict[str, str], active: bool = True, queue: str = "team-q"
) -> dict[str, Any]:
    """Kueue's Workload of the job (kubernetes-sigs/kueue pkg/controller/jobframework/reconciler.go,
    ConstructWorkload: named <kind>-<job>-<hash>, labelled kueue.x-k8s.io/job-uid with the job's uid)."""
    return {
        "apiVersion": "kueue.x-k8s.io/v1beta1",
        "kind": "Workload",
        "metadata": {
            "name": f"trainjob-{job}-3f2a1",
            "namespace": "team-a",
            "labels": {"kueue.x-k8s.io/job-uid": f"uid-{job}"},
            "creationTimestamp": "2026-01-01T00:00:01Z",
        },
        "spec": {"queueName": queue, "active": active},
        "status": {"conditions": list(conditions)},
    }


def _kueue_condition(kind: str, status: str, reason: str, message: str) -> dict[str, str]:
    return {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": "2026-01-01T00:00:02Z",
    }


QUEUED = {"queue_name": "team-q"}  # the job is created suspended, for Kueue to admit


@pytest.mark.parametrize("kind", KINDS)
def test_a_queue_that_does_not_exist_fails_at_once_with_exit_2(kind: str, kube: Any) -> None:
    """kubernetes-sigs/kueue pkg/controller/core/workload_controller.go (getQueueBlocker): a Workload whose
    LocalQueue does not exist gets QuotaReserved=False, "LocalQueue team-q doesn't exist" (reason Inadmissible,
    or Misconfigured with UnadmittedWorkloadsExplicitStatus); no wait heals it."""
    import time

    from rloo.errors import UserError

    fake = kube(outcome=None)
    fake.workloads = [
        _workload(
            "rloo-train-abc",
            _kueue_condition("QuotaReserved", "False", "Inadmissible", "LocalQueue team-q doesn't exist"),
        )
    ]
    start = time.monotonic()
    with pytest.raises(UserError) as info:
        run_multi_node(
            build_job(_spec(**QUEUED), kind), poll_seconds=0.05, timeout_s=60, admission_timeout_s=30
        )
    assert time.monotonic() - start < 15
    assert info.value.exit_code == 2
    assert str(info.value) == (
        f"Kueue cannot admit {WHAT[kind]} (queue_name 'team-q'): LocalQueue team-q doesn't exist; set queue_name "
        "to a LocalQueue of namespace team-a whose ClusterQueue exists (kubectl get localqueues -n team-a)."
    )
    assert fake.deleted == ["rloo-train-abc"] and fake.objects == {}


@pytest.mark.parametrize("kind", KINDS)
def test_no_quota_in_time_fails_with_exit_75_and_kueues_reason(
    kind: str, kube: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """kubernetes-sigs/kueue pkg/scheduler/flavorassigner/flavorassigner.go: a Workload the ClusterQueue has no
    room for stays QuotaReserved=False, "couldn't assign flavors to pod set ...": the step gives up at
    admission_timeout_s (a later retry may find room), not at its 48-hour deadline."""
    from rloo.k8s.jobs import NotAdmitted

    message = "couldn't assign flavors to pod set node: insufficient unused quota for nvidia.com/gpu in flavor h100, 16 more needed"
    fake = kube(outcome=None)
    fake.workloads = [
        _workload("rloo-train-abc", _kueue_condition("QuotaReserved", "False", "Pending", message))
    ]
    with pytest.raises(NotAdmitted) as info:
        run_multi_node(
            build_job(_spec(**QUEUED), kind), poll_seconds=0.05, timeout_s=60, admission_timeout_s=1
        )
    assert info.value.exit_code == 75
    assert str(info.value) == (
        f"Kueue did not admit {WHAT[kind]} to queue_name 'team-q' within admission_timeout_s=1: {message}; raise "
        "admission_timeout_s, or free quota in its ClusterQueue (kubectl get workloads -n team-a)."
    )
    assert fake.deleted == ["rloo-train-abc"]
    out = capsys.readouterr().out
    assert f"[rloo] {WHAT[kind]} waits for Kueue to admit it (queue 'team-q', at most 1 s)" in out
    assert f"[rloo] Kueue: {message}" in out
    assert ("team-a", "kueue.x-k8s.io", "workloads", "list") in fake.calls


@pytest.mark.parametrize("kind", KINDS)
def test_a_deactivated_workload_fails_at_once(kind: str, kube: Any) -> None:
    """kubernetes-sigs/kueue pkg/workload/evict/evict.go: a deactivated Workload (spec.active false, e.g. past
    its requeuing limit) is Evicted with reason Deactivated[DueTo...]; Kueue does not admit it again."""
    from rloo.errors import UserError

    fake = kube(outcome=None)
    evicted = _kueue_condition(
        "Evicted",
        "True",
        "DeactivatedDueToRequeuingLimitExceeded",
        "The workload is deactivated due to exceeding the maximum number of re-queuing retries",
    )
    fake.workloads = [_workload("rloo-train-abc", evicted, active=False)]
    with pytest.raises(
        UserError, match=r"^Kueue deactivated the Workload of .*re-queuing retries; it will not"
    ) as info:
        run_multi_node(
            build_job(_spec(**QUEUED), kind), poll_seconds=0.05, timeout_s=60, admission_timeout_s=30
        )
    assert info.value.exit_code == 2 and fake.deleted == ["rloo-train-abc"]


def test_the_wait_for_kueue_ends_at_the_admission_timeout_not_at_the_next_poll(
    kube: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A suspended job is looked at again when admission_timeout_s runs out, however long the poll interval: a
    step with a 10 s admission bound and the default 30 s poll fails after ~10 s, not 30 (the error is the
    one kubernetes-sigs/kueue pkg/scheduler's still-pending Workload gives)."""
    from rloo.errors import UserError
    from rloo.k8s import jobs

    slept: list[float] = []
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        real_sleep(min(seconds, 0.05))  # the pauses are recorded; the test does not wait them out

    monkeypatch.setattr(jobs.time, "sleep", sleep)
    fake = kube(outcome=None)
    waiting = _kueue_condition("QuotaReserved", "False", "Pending", "couldn't assign flavors to pod set node")
    fake.workloads = [_workload("rloo-train-abc", waiting)]
    with pytest.raises(UserError, match=r"admission_timeout_s=0\.3") as info:
        run_multi_node(
            build_trainjob(_spec(**QUEUED)), poll_seconds=3600, timeout_s=7200, admission_timeout_s=0.3
        )
    assert info.value.exit_code == 75  # no quota yet: a retry of the step may find room
    assert slept and max(slept) <= 0.31, slept


def test_a_job_admitted_within_the_bound_runs_to_the_end(
    kube: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """Kueue admits the job by clearing spec.suspend (kubernetes-sigs/kueue pkg/controller/jobframework
    reconciler.go, startJob); the time it then runs does not count against admission_timeout_s."""
    import threading

    fake = kube(outcome=None)
    waiting = _kueue_condition("QuotaReserved", "False", "Pending", "couldn't assign flavors to pod set node")
    fake.workloads = [_workload("rloo-train-abc", waiting)]

    def admit() -> None:
        fake.objects[("trainjobs", "rloo-train-abc")]["spec"]["suspend"] = False

    def finish() -> None:
        fake.outcome = "Complete"
        fake._finish()

    timers = [threading.Timer(0.5, admit), threading.Timer(3.0, finish)]
    for t in timers:
        t.start()
    try:
        run_multi_node(
            build_trainjob(_spec(**QUEUED)), poll_seconds=0.05, timeout_s=60, admission_timeout_s=1.5
        )
    finally:
        for t in timers:
            t.cancel()
    assert fake.deleted == []
    assert "[rloo] Kueue admitted TrainJob team-a/rloo-train-abc" in capsys.readouterr().out


def test_a_trainjobs_suspended_condition_counts_without_spec_suspend() -> None:
    """kubeflow/trainer pkg/apis/trainer/v1alpha1/trainjob_types.go (v2.3): condition Suspended, True while
    suspended, False (reason Resumed) once Kueue lets it run."""
    from rloo.k8s.jobs import is_suspended

    def job(status: str) -> dict[str, Any]:
        return {
            "spec": {},
            "status": {"conditions": [_kueue_condition("Suspended", status, "Suspended", "")]},
        }

    assert is_suspended(job("True")) and not is_suspended(job("False"))
    assert is_suspended({"spec": {"runPolicy": {"suspend": True}}})  # a PyTorchJob's
    assert not is_suspended({**job("True"), "spec": {"suspend": False}})  # admitted; the controller lags


@pytest.mark.parametrize("kind", KINDS)
def test_no_workload_for_the_job_names_kueues_integration(kind: str, kube: Any) -> None:
    """kubernetes-sigs/kueue config/components/manager/controller_manager_config.yaml: Kueue 0.19 ships with
    kubeflow.org/pytorchjob commented out of integrations.frameworks: no Workload is ever made, the job stays
    suspended. At the bound the step says which integration, exit 2."""
    from rloo.errors import UserError

    kube(outcome=None)
    with pytest.raises(UserError) as info:
        run_multi_node(
            build_job(_spec(**QUEUED), kind), poll_seconds=0.05, timeout_s=60, admission_timeout_s=0.5
        )
    framework = "trainer.kubeflow.org/trainjob" if kind == "trainjob" else "kubeflow.org/pytorchjob"
    assert info.value.exit_code == 2
    assert f"Kueue made no Workload for it: Kueue admits it only with its {framework} integration on" in str(
        info.value
    )


def test_workloads_it_may_not_read_bound_the_wait_all_the_same(
    kube: Any, fast_backoff: None, capsys: pytest.CaptureFixture[str]
) -> None:
    from rloo.k8s.jobs import NotAdmitted

    fake = kube(outcome=None, faults={"list": [_api_error(403, "workloads is forbidden")] * 100})
    with pytest.raises(
        NotAdmitted, match="Kueue's reason unknown: this service account may not list workloads"
    ):
        run_multi_node(
            build_trainjob(_spec(**QUEUED)), poll_seconds=0.05, timeout_s=60, admission_timeout_s=0.5
        )
    assert fake.deleted == ["rloo-train-abc"]
    assert capsys.readouterr().out.count("workloads is forbidden") == 1  # told once, not every poll
