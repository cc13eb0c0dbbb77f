"""The train step's multi-node job on the cluster: create it (or adopt it when a retried step finds it), stream
its rank-0 log, and return or raise with the operator's reason.

The job's manifest comes from :mod:`rloo.k8s.builders`; this module only talks to the Kubernetes API.

The job must not outlive the step that waits for it: it holds every GPU of ``num_nodes`` nodes until its own
``activeDeadlineSeconds`` (48 h) otherwise. So the step deletes it (Foreground: its pods go first) on every way
out but success: the job failed, the step's own deadline passed, an API error it could not get past, and
SIGTERM (KFP terminating the run, the pod evicted). What the step cannot see, its pod killed without notice,
is left to the job's owner reference to that pod (:class:`rloo.k8s.builders.OwnerPod`). A job that
succeeded is kept: its pods are done and hold nothing, its status and log stay readable, and a retried step
that finds it returns at once instead of training again.

A job submitted to a Kueue queue (``queue_name``) is created suspended and waits for Kueue to admit it; one that
Kueue never admits (a LocalQueue that does not exist, no quota, a deactivated Workload) would look like a job
still running until the step's 48-hour deadline. So the wait for admission is bounded (``admission_timeout_s``),
and Kueue's Workload for the job says why it waits: the step fails at once when it never can be admitted
(exit 2) and at the bound when the queue had no room (exit 75: a later retry may be admitted).

Transient API errors (5xx, 429, a dropped connection, a read timeout, and the Kubeflow SDK's ``RuntimeError``
wrapping one) are retried with exponential backoff a bounded number of times; any other refusal (403, 422, ...)
fails the step at once with the API's message.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from rloo.errors import UserError
from rloo.k8s.builders import (
    API_VERSION,
    KIND,
    QUEUE_LABEL,
    TRAINJOB_API_VERSION,
    TRAINJOB_KIND,
    OwnerPod,
    owner_from_env,
)

__all__ = [
    "ADMISSION_TIMEOUT_S",
    "JOB_NAME_LABEL",
    "REPLICA_TYPE_LABEL",
    "TRAINJOB_LOG_STEP",
    "NotAdmitted",
    "OwnerPod",
    "StepTerminated",
    "admission_error",
    "delete_unfinished_job",
    "is_suspended",
    "is_transient",
    "job_outcome",
    "on_existing_job",
    "owner_from_env",
    "run_multi_node",
    "workload_verdict",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

# Labels the training operator puts on a PyTorchJob's pods (kubeflow/training-operator v1).
JOB_NAME_LABEL = "training.kubeflow.org/job-name"
REPLICA_TYPE_LABEL = "training.kubeflow.org/replica-type"
# The terminal conditions: a PyTorchJob's (training operator v1) and a TrainJob's (Trainer v2).
_TERMINAL = {"Succeeded": "succeeded", "Complete": "succeeded", "Failed": "failed"}
# The step of a TrainJob whose log the train step streams: node 0, which the rank-0 processes run on.
TRAINJOB_LOG_STEP = "node-0"

# Retrying the Kubernetes API: 1, 2, 4, ... 30 s apart, about 2 minutes in all (an API server restarting, a
# control-plane upgrade), then the step fails (and deletes its job).
API_ATTEMPTS = 8
API_BACKOFF_S = 1.0
API_BACKOFF_MAX_S = 30.0
# Each request's own limit: a connection that went silent is a read timeout (retried), not a hung step.
API_REQUEST_TIMEOUT_S = 60
# Deleting the job after SIGTERM has to fit in the pod's grace period (30 s by default).
CLEANUP_ATTEMPTS = 3
CLEANUP_REQUEST_TIMEOUT_S = 8
_TRANSIENT_STATUS = frozenset({0, 429, 500, 502, 503, 504})  # 0: the client's own connection-level failure

# How long a suspended job may wait for Kueue to admit it (the admission_timeout_s parameter's default).
ADMISSION_TIMEOUT_S = 1800
# Kueue's Workload of a job (kubernetes-sigs/kueue pkg/controller/jobframework/reconciler.go, ConstructWorkload:
# controlled by the job and labelled with its uid). Both API versions hold the same conditions; v1beta1 is
# what every Kueue release serves (0.15+ also v1beta2, its storage version).
KUEUE_GROUP = "kueue.x-k8s.io"
KUEUE_VERSIONS = ("v1beta1", "v1beta2")
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
# The QuotaReserved condition's message when the queue cannot exist for the job (workload_controller.go,
# getQueueBlocker: "LocalQueue q doesn't exist", "ClusterQueue cq doesn't exist"; reason Inadmissible, or
# Misconfigured under the UnadmittedWorkloadsExplicitStatus feature gate, off by default in 0.19).
_MISCONFIGURED = re.compile(r"\b(LocalQueue|ClusterQueue) \S+ doesn't exist")


class StepTerminated(SystemExit):
    """SIGTERM reached the step while its job ran (KFP terminating the run, the pod evicted): the job is
    deleted and the step exits with 143, as a process killed by SIGTERM does."""

    def __init__(self) -> None:
        super().__init__(128 + signal.SIGTERM)


class NotAdmitted(UserError):
    """Kueue did not admit the job within ``admission_timeout_s``: the queue had no room for it then; a later
    retry may be admitted (exit 75, EX_TEMPFAIL)."""

    exit_code = 75


def job_outcome(job: dict[str, Any]) -> tuple[str, str]:
    """``("succeeded" | "failed" | "running", reason)`` from a PyTorchJob's or TrainJob's status conditions.

    The operators append conditions (PyTorchJob: Created, Running, Restarting, Succeeded, Failed; TrainJob:
    Suspended, Complete, Failed, ...); the newest true terminal one decides, and its reason and message are
    what the user needs to see.
    """
    conds = [c for c in (job.get("status") or {}).get("conditions") or [] if c.get("status") == "True"]
    conds.sort(key=lambda c: str(c.get("lastTransitionTime") or c.get("lastUpdateTime") or ""))
    for cond in reversed(conds):
        state = _TERMINAL.get(str(cond.get("type")))
        if state:
            why = ": ".join(x for x in (cond.get("reason"), cond.get("message")) if x) or cond["type"]
            return state, " ".join(str(why).split())
    return "running", ""


def on_existing_job(job: dict[str, Any]) -> str:
    """What a (retried) step does with this run's job that it finds already there: ``wait`` for a running or
    finished one, ``replace`` a failed one (the new job resumes from the checkpoints in object storage) and
    one being deleted (an earlier attempt's clean-up: waiting for it would end in 'deleted')."""
    if (job.get("metadata") or {}).get("deletionTimestamp"):
        return "replace"
    return "replace" if job_outcome(job)[0] == "failed" else "wait"


def is_suspended(job: dict[str, Any]) -> bool:
    """Whether the job waits to be started: ``spec.suspend`` (a TrainJob's) or ``spec.runPolicy.suspend`` (a
    PyTorchJob's), which Kueue clears when it admits the job; without either, a TrainJob's own ``Suspended``
    condition (Trainer v2.3 pkg/apis/trainer/v1alpha1/trainjob_types.go: True while suspended, then False with
    reason Resumed)."""
    spec = job.get("spec") or {}
    flag = spec.get("suspend", (spec.get("runPolicy") or {}).get("suspend"))
    if flag is not None:
        return bool(flag)
    return _condition(job, "Suspended", "True") is not None


def _condition(obj: dict[str, Any] | None, kind: str, status: str) -> dict[str, Any] | None:
    for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind and cond.get("status") == status:
            return dict(cond)
    return None


def _said(cond: dict[str, Any] | None) -> str:
    """A condition's message (its reason when it has none), in one line."""
    if cond is None:
        return ""
    return " ".join(str(cond.get("message") or cond.get("reason") or "").split())


def workload_verdict(workload: dict[str, Any] | None) -> tuple[str, str]:
    """What Kueue's Workload of a suspended job says, from its conditions (kubernetes-sigs/kueue
    apis/kueue/v1beta1/workload_types.go): ``("misconfigured", why)`` for a queue that does not exist, which
    no wait heals; ``("deactivated", why)`` for a Workload Kueue will not admit again (``spec.active`` false,
    or Evicted with a Deactivated... reason); ``("pending", why)`` while it waits (QuotaReserved False:
    "couldn't assign flavors ...", or Evicted: preempted); ``("admitted", "")``; ``("none", "")`` without a
    Workload."""
    if workload is None:
        return "none", ""
    evicted = _condition(workload, "Evicted", "True")
    if (workload.get("spec") or {}).get("active") is False or str(
        (evicted or {}).get("reason", "")
    ).startswith("Deactivated"):
        return "deactivated", _said(evicted) or "its spec.active is false"
    if _condition(workload, "Admitted", "True") is not None:
        return "admitted", ""
    blocked = _condition(workload, "QuotaReserved", "False")
    why = _said(blocked)
    if blocked is not None and (blocked.get("reason") == "Misconfigured" or _MISCONFIGURED.search(why)):
        return "misconfigured", why
    return "pending", why or _said(evicted)


def admission_error(
    job: dict[str, Any],
    workload: dict[str, Any] | None,
    *,
    waited_s: float,
    timeout_s: float,
    kueue_served: bool = True,
    readable: bool = True,
) -> UserError | None:
    """The one-line error a suspended ``job`` fails with after ``waited_s`` seconds, given Kueue's
    ``workload`` for it (:func:`workload_verdict`), or ``None`` while it may still be admitted. ``kueue_served``:
    whether the API serves Kueue's Workloads at all; ``readable``: whether this service account may read
    them (otherwise the wait is bounded without Kueue's reason). Exit 2 for what no wait heals, 75 for a
    queue that had no room in time."""
    meta = job.get("metadata") or {}
    what = f"{job.get('kind')} {meta.get('namespace')}/{meta.get('name')}"
    queue = (meta.get("labels") or {}).get(QUEUE_LABEL) or str(
        (workload or {}).get("spec", {}).get("queueName", "")
    )
    named = f"queue_name {queue!r}" if queue else "no queue_name"
    namespace = meta.get("namespace")
    state, why = workload_verdict(workload)
    if not kueue_served:
        return UserError(
            f"{what} is suspended for Kueue ({named}), but this cluster serves no Kueue Workloads: install Kueue "
            "or leave queue_name empty."
        )
    if state == "misconfigured":
        return UserError(
            f"Kueue cannot admit {what} ({named}): {why}; set queue_name to a LocalQueue of namespace {namespace} "
            f"whose ClusterQueue exists (kubectl get localqueues -n {namespace})."
        )
    if state == "deactivated":
        return UserError(f"Kueue deactivated the Workload of {what} ({named}): {why}; it will not start it.")
    if waited_s < timeout_s:
        return None
    if state == "none" and readable:
        group = str(job.get("apiVersion", "")).split("/")[0]
        framework = f"{group}/{str(job.get('kind', '')).lower()}"
        return UserError(
            f"{what} stayed suspended for {waited_s:.0f} s ({named}) and Kueue made no Workload for it: Kueue "
            f"admits it only with its {framework} integration on (integrations.frameworks in Kueue's "
            "configuration)."
        )
    if not readable:
        why = "Kueue's reason unknown: this service account may not list workloads.kueue.x-k8s.io"
    return NotAdmitted(
        f"Kueue did not admit {what} to {named} within admission_timeout_s={timeout_s:g}: "
        f"{why or 'it is still queued'}; raise admission_timeout_s, or free quota in its ClusterQueue "
        f"(kubectl get workloads -n {namespace})."
    )


def is_transient(error: BaseException) -> bool:
    """Whether an API call that raised ``error`` may succeed when tried again: a 5xx or 429 answer, a failed or
    timed-out connection, also behind the ``RuntimeError`` the Kubeflow SDK wraps every failure in."""
    import urllib3
    from kubernetes.client.rest import ApiException

    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, ApiException):
            return seen.status in _TRANSIENT_STATUS
        if isinstance(seen, urllib3.exceptions.HTTPError | ConnectionError | TimeoutError):
            return True
        if isinstance(seen, multiprocessing.TimeoutError):  # the SDK's async_req calls
            return True
        seen = seen.__cause__
    return False


def _api_message(error: Any) -> str:
    """An ``ApiException`` in one line: its status, reason and the API server's own message."""
    message = ""
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        message = str(json.loads(error.body).get("message") or "")
    text = " ".join(str(x) for x in (error.status, error.reason) if x)
    return " ".join(f"{text}: {message}".split()) if message else text


def _call(
    action: str,
    what: str,
    fn: Callable[..., T],
    *args: Any,
    ok: tuple[int, ...] = (),
    attempts: int | None = None,
    **kw: Any,
) -> T:
    """``fn(*args, **kw)``, retried with exponential backoff while it fails transiently. An ``ApiException``
    whose status is in ``ok`` is the caller's to handle (404, 409) and raised as it is; any other failure
    becomes a one-line ``RuntimeError`` that says what was refused."""
    from kubernetes.client.rest import ApiException

    attempts = attempts or API_ATTEMPTS  # read at call time: tests shorten it
    delay = API_BACKOFF_S
    for attempt in range(1, attempts + 1):
        try:
            return fn(*args, **kw)
        except ApiException as e:
            if e.status in ok:
                raise
            error: Exception = e
            detail = _api_message(e)
        except Exception as e:
            error, detail = e, " ".join(f"{type(e).__name__}: {e}".split())
        transient = is_transient(error)
        if not transient or attempt == attempts:
            tries = f" (after {attempts} attempts)" if transient else ""
            hint = ""
            if isinstance(error, ApiException) and error.status in (401, 403):
                hint = " (the pipeline's service account needs the Role the Helm chart installs)"
            raise RuntimeError(f"could not {action} {what}: {detail}{tries}{hint}") from error
        print(
            f"[rloo] {action} {what}: {detail}; retrying in {delay:g}s ({attempt}/{attempts - 1})", flush=True
        )
        time.sleep(delay)
        delay = min(2 * delay, API_BACKOFF_MAX_S)
    raise AssertionError("unreachable")  # the last attempt returns or raises


class _Job:
    """This run's TrainJob or PyTorchJob as a custom object: read, create, delete, each call retried."""

    def __init__(self, api: Any, manifest: dict[str, Any], plural: str) -> None:
        self.api, self.manifest, self.plural = api, manifest, plural
        self.group, self.version = manifest["apiVersion"].split("/")
        self.namespace, self.name = manifest["metadata"]["namespace"], manifest["metadata"]["name"]
        self.what = f"{manifest['kind']} {self.namespace}/{self.name}"

    def _path(self) -> tuple[str, str, str, str]:
        return self.group, self.version, self.namespace, self.plural

    def get(
        self, *, attempts: int | None = None, request_timeout: float = API_REQUEST_TIMEOUT_S
    ) -> dict[str, Any] | None:
        """The job as the API has it; ``None`` once it is gone (or its kind is not installed)."""
        from kubernetes.client.rest import ApiException

        try:
            return _call(
                "read",
                self.what,
                self.api.get_namespaced_custom_object,
                *self._path(),
                self.name,
                ok=(404,),
                attempts=attempts,
                _request_timeout=request_timeout,
            )
        except ApiException:
            return None

    def create(self) -> bool:
        """Create the job; ``False`` when one of that name is already there."""
        from kubernetes.client.rest import ApiException

        try:
            _call(
                "create",
                self.what,
                self.api.create_namespaced_custom_object,
                *self._path(),
                self.manifest,
                ok=(409,),
                _request_timeout=API_REQUEST_TIMEOUT_S,
            )
        except ApiException:
            return False
        return True

    def delete(self, *, attempts: int | None = None, request_timeout: float = API_REQUEST_TIMEOUT_S) -> bool:
        """Delete the job, its pods first (Foreground); ``False`` when it was already gone."""
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        try:
            _call(
                "delete",
                self.what,
                self.api.delete_namespaced_custom_object,
                *self._path(),
                self.name,
                ok=(404,),
                attempts=attempts,
                body=client.V1DeleteOptions(propagation_policy="Foreground"),
                _request_timeout=request_timeout,
            )
        except ApiException:
            return False
        return True

    def add_owners(self, existing: dict[str, Any]) -> None:
        """Make this step's pod an owner of the job it adopts too. The garbage collector deletes a job once all
        its owners are gone: with only the first attempt's pod as its owner, deleting that pod (pod GC, a lost
        node) would take the job from under the retry. Best effort: the job runs either way."""
        want = self.manifest["metadata"].get("ownerReferences") or []
        meta = existing.get("metadata") or {}
        have = meta.get("ownerReferences") or []
        new = [ref for ref in want if ref["uid"] not in {h.get("uid") for h in have}]
        if not new:
            return
        # a merge patch replaces the list: the resourceVersion makes a concurrent change a conflict, not a loss
        patch = {
            "metadata": {"ownerReferences": [*have, *new], "resourceVersion": meta.get("resourceVersion")}
        }
        try:
            _call(
                "add this step's pod to the owners of",
                self.what,
                self.api.patch_namespaced_custom_object,
                *self._path(),
                self.name,
                patch,
                _request_timeout=API_REQUEST_TIMEOUT_S,
            )
        except RuntimeError as e:
            print(f"[rloo] {e}: the job is deleted if the first attempt's pod is", flush=True)


def run_multi_node(
    manifest: dict[str, Any],
    *,
    timeout_s: float,
    poll_seconds: float = 30.0,
    admission_timeout_s: float = ADMISSION_TIMEOUT_S,
) -> None:
    """Create the multi-node job (or adopt it when a retried step finds it; replace it when it had failed or
    is being deleted), stream its rank-0 node's log into this step's log, and return when it succeeds; raise
    with the operator's reason when it fails.

    Whenever the step does not end in success, the job is deleted first (see the module docstring): its
    failure, ``timeout_s`` (the step's deadline, in seconds), ``admission_timeout_s`` spent suspended (waiting
    for Kueue: see the module docstring), an API error, and SIGTERM, which
    raises :class:`StepTerminated` (exit status 143) while this runs in the main thread; the previous SIGTERM
    handler is back afterwards.

    Thin on purpose: the job comes from :func:`rloo.k8s.builders.build_job`, decisions from
    :func:`job_outcome` and :func:`on_existing_job`. A ``TrainJob``'s log is followed with the Kubeflow SDK,
    a ``PyTorchJob``'s (which that SDK does not handle) with the Kubernetes client; both are created, read and
    deleted as custom objects: the SDK can neither create *this* manifest (``TrainerClient.train`` assembles
    its own TrainJob, so what ``rloo pipeline manifest`` prints and the tests validate would not be what is
    created) nor wait through a transient API error (``wait_for_job_status`` gives up on the first failed
    read), nor say the controller's reason for a failure.
    """
    deadline = time.monotonic() + timeout_s
    with _sigterm_raises() as hold_sigterm:
        follow: Callable[[threading.Event], None]
        if manifest["kind"] == TRAINJOB_KIND:
            trainer = _trainer_client(manifest["metadata"]["namespace"])
            job = _Job(trainer.backend.custom_api, manifest, "trainjobs")

            def follow(done: threading.Event) -> None:
                _follow_trainjob_log(trainer, job.name, done, poll_seconds)

        else:
            from kubernetes import client, config

            config.load_incluster_config()
            job = _Job(client.CustomObjectsApi(), manifest, "pytorchjobs")
            core = client.CoreV1Api()

            def follow(done: threading.Event) -> None:
                _follow_master_log(core, job, done, poll_seconds)

        done = threading.Event()
        try:
            _start(job, deadline, poll_seconds)
            threading.Thread(target=follow, args=(done,), daemon=True, name="job-log").start()
            _wait(job, deadline, timeout_s, poll_seconds, _Admission(job, admission_timeout_s))
        except BaseException as error:
            hold_sigterm()  # a second SIGTERM must not cut the clean-up short
            _delete_after_failure(job, error)
            raise
        finally:
            done.set()
    print(f"[rloo] {job.what} succeeded", flush=True)


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[Callable[[], None]]:
    """SIGTERM raises :class:`StepTerminated` inside the block, so that the block's clean-up runs; yields a
    function that ignores further SIGTERMs (called when the clean-up starts). Python runs signal handlers in
    the main thread only, and only the main thread may install them: elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return

    def on_sigterm(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise StepTerminated()

    def hold() -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield hold
    finally:
        # None: a handler not installed from Python; the default is what the process had then
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def _delete_after_failure(job: _Job, error: BaseException) -> None:
    """Delete the job on the step's way out; a failure to do so is reported, never raised over ``error``."""
    why = "was terminated" if isinstance(error, StepTerminated) else "failed"
    print(f"[rloo] the train step {why}: deleting {job.what} so that it does not hold its nodes", flush=True)
    try:
        # short: after SIGTERM, the pod's grace period is all there is
        job.delete(attempts=CLEANUP_ATTEMPTS, request_timeout=CLEANUP_REQUEST_TIMEOUT_S)
    except Exception as e:
        print(
            f"[rloo] {e}; it runs until its deadline unless deleted by hand: kubectl delete {job.plural} "
            f"-n {job.namespace} {job.name}",
            file=sys.stderr,
            flush=True,
        )


# Both kinds a run's job may be (multinode_backend): the exit handler looks for either, since it runs whether or
# not the validate step did (and so without the plan that names the backend).
_JOB_KINDS = ((TRAINJOB_API_VERSION, TRAINJOB_KIND, "trainjobs"), (API_VERSION, KIND, "pytorchjobs"))


def delete_unfinished_job(name: str, namespace: str) -> list[str]:
    """Delete this run's job ``name`` in ``namespace``, a TrainJob or a PyTorchJob, unless it succeeded; what
    was done, one line each. Never raises: the caller is the exit handler, which must go on to close the run.

    It is the clean-up that survives KFP terminating a run. Argo's emissary forwards SIGTERM to KFP's
    launcher, which has no handler and exits at once with the container, so the train step's own clean-up
    (:func:`run_multi_node`) is killed before or during its DELETE; the job's owner reference to the step's pod
    fires only when Argo deletes that pod (the workflow's TTL, a day by default). A job that is gone, never
    was, or whose kind is not installed (404) needs nothing; transient errors are retried briefly; a refusal
    (RBAC) is a line to print. A kind this service account may not read it could not have created (the
    launcher runs under the same one): that refusal is only reported when no kind could be read at all."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        return []  # not in a cluster (kfp.local): no job was created
    api = client.CustomObjectsApi()
    lines: list[str] = []
    refused: list[str] = []
    for api_version, kind, plural in _JOB_KINDS:
        manifest = {
            "apiVersion": api_version,
            "kind": kind,
            "metadata": {"name": name, "namespace": namespace},
        }
        job = _Job(api, manifest, plural)
        try:
            current = job.get(attempts=CLEANUP_ATTEMPTS, request_timeout=CLEANUP_REQUEST_TIMEOUT_S)
            if current is None:
                continue
            if job_outcome(current)[0] == "succeeded":
                lines.append(f"{job.what} succeeded: kept")
                continue
            if job.delete(attempts=CLEANUP_ATTEMPTS, request_timeout=CLEANUP_REQUEST_TIMEOUT_S):
                lines.append(f"deleted {job.what}, which the run left behind (it held its nodes)")
        except RuntimeError as e:
            if _refused(e):
                refused.append(str(e))
            else:
                lines.append(
                    f"warning: {e}; delete it by hand: kubectl delete {plural} -n {namespace} {name}"
                )
    if len(refused) == len(_JOB_KINDS):
        lines.append(f"warning: {refused[0]}; a job this run left behind is not deleted")
    return lines


def _refused(error: RuntimeError) -> bool:
    """Whether ``error`` (from :func:`_call`) is the API server's refusal to this service account."""
    from kubernetes.client.rest import ApiException

    cause = error.__cause__
    return isinstance(cause, ApiException) and cause.status in (401, 403)


def _start(job: _Job, deadline: float, poll_seconds: float) -> None:
    """Create the job, or adopt this run's job of the same name (a retried step), or replace it."""
    if job.create():
        print(f"[rloo] created {job.what}", flush=True)
        return
    existing = job.get()
    if existing is not None and on_existing_job(existing) == "wait":
        print(f"[rloo] adopting {job.what} (this step was retried)", flush=True)
        job.add_owners(existing)
        return
    if existing is not None:
        deleting = bool((existing.get("metadata") or {}).get("deletionTimestamp"))
        print(
            f"[rloo] {job.what} {'was being deleted' if deleting else 'failed'} before this retry: replacing it",
            flush=True,
        )
        job.delete()
    _wait_until_gone(job, deadline, poll_seconds)
    if not job.create():
        raise RuntimeError(f"{job.what} was created again by someone else while this step replaced it")
    print(f"[rloo] created {job.what}", flush=True)


def _wait_until_gone(job: _Job, deadline: float, poll_seconds: float) -> None:
    """Return once the job is gone: a deleted job's name is free only then (Foreground: after its pods)."""
    while job.get() is not None:
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{job.what} was still being deleted at the step's deadline")
        time.sleep(min(5.0, poll_seconds))


class _Admission:
    """The wait of a suspended job for Kueue: how long it has waited (since it was last seen running), what
    Kueue's Workload for it says, and the error to fail with (:func:`admission_error`)."""

    def __init__(self, job: _Job, timeout_s: float) -> None:
        self.job, self.timeout_s = job, timeout_s
        self.since: float | None = None
        self.versions = list(KUEUE_VERSIONS)
        self.readable = True
        self.told = ""

    def seconds_left(self) -> float:
        """Until the admission timeout while the job waits for Kueue (infinite otherwise): the wait looks again
        then, so a short timeout is not rounded up to the poll interval."""
        if self.since is None:
            return float("inf")
        return max(0.0, self.since + self.timeout_s - time.monotonic())

    def check(self, current: dict[str, Any]) -> None:
        """Raise the job's admission error, if it has one now; print what Kueue says when that changes."""
        if not is_suspended(current):
            if self.since is not None:
                print(f"[rloo] Kueue admitted {self.job.what}", flush=True)
            self.since = None
            return
        now = time.monotonic()
        if self.since is None:
            self.since = now
            queue = ((current.get("metadata") or {}).get("labels") or {}).get(QUEUE_LABEL, "")
            print(
                f"[rloo] {self.job.what} waits for Kueue to admit it (queue {queue!r}, at most "
                f"{self.timeout_s:g} s)",
                flush=True,
            )
        workload = self._workload(str((current.get("metadata") or {}).get("uid") or ""))
        why = workload_verdict(workload)[1]
        if why and why != self.told:
            print(f"[rloo] Kueue: {why}", flush=True)
            self.told = why
        error = admission_error(
            current,
            workload,
            waited_s=now - self.since,
            timeout_s=self.timeout_s,
            kueue_served=bool(self.versions),
            readable=self.readable,
        )
        if error is not None:
            raise error

    def _workload(self, uid: str) -> dict[str, Any] | None:
        """Kueue's newest Workload for the job of ``uid``; ``None`` when there is none or it cannot be read
        (a refusal is told once; a transient failure is skipped until the next poll)."""
        from kubernetes.client.rest import ApiException

        if not (uid and self.readable):
            return None
        for version in list(self.versions):
            try:
                found = _call(
                    "list Kueue's Workloads of",
                    self.job.what,
                    self.job.api.list_namespaced_custom_object,
                    KUEUE_GROUP,
                    version,
                    self.job.namespace,
                    "workloads",
                    label_selector=f"{JOB_UID_LABEL}={uid}",
                    ok=(404,),
                    attempts=CLEANUP_ATTEMPTS,
                    _request_timeout=CLEANUP_REQUEST_TIMEOUT_S,
                )
            except ApiException:  # this version is not served (or Kueue is not installed)
                self.versions.remove(version)
                continue
            except RuntimeError as e:
                if _refused(e):
                    self.readable = False
                    print(f"[rloo] {e}: the wait for admission is bounded without Kueue's reason", flush=True)
                return None
            self.versions = [version]
            items = list((found or {}).get("items") or [])
            return (
                max(items, key=lambda w: str(w["metadata"].get("creationTimestamp", ""))) if items else None
            )
        return None


def _wait(job: _Job, deadline: float, timeout_s: float, poll_seconds: float, admission: _Admission) -> None:
    """Poll the job's conditions until it succeeds (return), fails or vanishes (raise), or the deadline; while
    it is suspended, ``admission`` bounds the wait for Kueue."""
    while True:
        current = job.get()
        if current is None:
            raise RuntimeError(f"{job.what} was deleted while the step waited for it")
        state, reason = job_outcome(current)
        if state == "succeeded":
            return
        if state == "failed":
            raise RuntimeError(f"{job.what} failed: {reason}")
        admission.check(current)
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{job.what} did not finish within the step's {timeout_s:g} s")
        time.sleep(min(poll_seconds, left, admission.seconds_left() + 0.01))


def _trainer_client(namespace: str) -> Any:
    """The Kubeflow SDK's TrainerClient for ``namespace`` (in-cluster credentials in the step's pod)."""
    from kubeflow.common.types import KubernetesBackendConfig
    from kubeflow.trainer import TrainerClient

    # The client first reads Trainer's version ConfigMap in the control plane's namespace, which this step
    # may not (its Role is in the pipeline's namespace), and only warns about it: not worth a warning here.
    sdk_log = logging.getLogger("kubeflow.trainer.backends.kubernetes.backend")
    level = sdk_log.level
    sdk_log.setLevel(logging.ERROR)
    try:
        return TrainerClient(backend_config=KubernetesBackendConfig(namespace=namespace))
    finally:
        sdk_log.setLevel(level)


def _follow_trainjob_log(trainer: Any, name: str, done: threading.Event, poll_seconds: float) -> None:
    """Stream node 0's log through the SDK (``get_job`` / ``get_job_logs``) until ``done``."""
    seen: set[str] = set()  # pod names: a replaced node-0 pod is followed again
    while not done.is_set():
        try:
            step = next((s for s in trainer.get_job(name).steps if s.name == TRAINJOB_LOG_STEP), None)
            if step is not None and step.pod_name not in seen and step.status not in (None, "Pending"):
                seen.add(step.pod_name)
                for line in trainer.get_job_logs(name, follow=True, step=TRAINJOB_LOG_STEP):
                    sys.stdout.write(f"[{TRAINJOB_LOG_STEP}] {line}\n")
                    sys.stdout.flush()
        except Exception as e:  # logs are a convenience: the job's status decides the outcome
            log.warning("following %s's log: %s", TRAINJOB_LOG_STEP, e)
        done.wait(min(10.0, poll_seconds))


def _follow_master_log(core: Any, job: _Job, done: threading.Event, poll_seconds: float) -> None:
    """Stream a PyTorchJob's master pod's log until ``done``."""
    selector = f"{JOB_NAME_LABEL}={job.name},{REPLICA_TYPE_LABEL}=master"
    seen: set[tuple[str, str]] = set()  # (pod, uid): a restarted master pod is followed again
    while not done.is_set():
        try:
            for pod in core.list_namespaced_pod(job.namespace, label_selector=selector).items:
                key = (pod.metadata.name, pod.metadata.uid)
                if key in seen or pod.status.phase not in ("Running", "Succeeded", "Failed"):
                    continue
                seen.add(key)
                stream = core.read_namespaced_pod_log(
                    pod.metadata.name, job.namespace, follow=True, _preload_content=False
                )
                for line in stream.stream():
                    sys.stdout.write(f"[master] {line.decode(errors='replace')}")
                    sys.stdout.flush()
        except Exception as e:  # logs are a convenience: status polling decides the outcome
            log.warning("following the master's log: %s", e)
        done.wait(min(10.0, poll_seconds))
