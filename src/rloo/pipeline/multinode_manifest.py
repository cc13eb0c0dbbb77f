"""``rloo pipeline manifest``: the multi-node job the train step would create for some pipeline parameters, as
YAML, for review or ``kubectl apply``.

The parameters get the checks ``rloo pipeline submit`` applies (names, types, the validate step's checks,
without looking at storage or the Hub); required ones that are not given become placeholders. What only a run
knows is a placeholder too: the SFT model's URI is where the fetch step writes it, the run id ``--run_id``.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from rloo.errors import UserError

if TYPE_CHECKING:
    from rloo.k8s.platform import Platform

# What a required pipeline parameter becomes when it is not given: visibly a placeholder ("<name>"), yet a value
# every check accepts (the job only carries output_uri and the training config); these two must parse.
PLACEHOLDERS: dict[str, Any] = {
    "judge_base_url": "http://judge.invalid/v1",
    "output_uri": "s3://<bucket>/<prefix>",
}


def placeholders() -> dict[str, Any]:
    """A placeholder for every required pipeline parameter."""
    from rloo.pipeline.params import pipeline_params

    return {p.name: PLACEHOLDERS.get(p.name, f"<{p.name}>") for p in pipeline_params() if p.required}


# The namespace when the namespace parameter is empty: none in the manifest, so 'kubectl apply -n' decides.
NO_NAMESPACE = ""
# The train step's pod owns the job it launches (rloo.k8s.builders.OwnerPod); only a run knows which.
OWNER_PLACEHOLDER_NAME = "<launcher pod>"
OWNER_PLACEHOLDER_UID = "<launcher pod uid>"
OWNER_NOTE = (
    "# metadata.ownerReferences: the train step's pod, which a run fills in (the job is deleted with it).\n"
    f"# {OWNER_PLACEHOLDER_NAME!r} and {OWNER_PLACEHOLDER_UID!r} are placeholders: remove ownerReferences before\n"
    "# applying this job by hand, or Kubernetes deletes it at once (its owner does not exist).\n"
)


def manifest(
    params: dict[str, Any], *, run_id: str = "manual", platform: Platform | None = None
) -> dict[str, Any]:
    """The job (TrainJob or PyTorchJob, by ``multinode_backend``) for ``params`` (pipeline parameters)."""
    from rloo.k8s.builders import OwnerPod, check_queue_backend
    from rloo.k8s.platform import Platform
    from rloo.pipeline.images import TRAIN_IMAGE
    from rloo.pipeline.params import check_params, with_defaults
    from rloo.stages.layout import RunLayout
    from rloo.stages.train import job_manifest, multinode_spec
    from rloo.stages.validate import build_plan

    given = check_params(params, required=False)
    p = with_defaults({k: v for k, v in placeholders().items() if k not in given} | given)
    if not _has_reward_source(p):
        p["reward_model_path"] = "<reward_model_path>"  # a reward source is required; none was given
    plan = build_plan(p, check_paths=False)
    check_queue_backend(p, platform or Platform())  # the validate step's own check, with the same platform
    if not plan.cluster.multinode:
        raise UserError(
            f"the multi-node job is for num_nodes >= 2 (got {p['num_nodes']}): pass --param num_nodes=N."
        )
    spec = multinode_spec(
        plan,
        run_id=run_id,
        run_name=run_id,
        sft_uri=RunLayout(plan.run.output_uri, run_id).sft,  # where the fetch step publishes the SFT model
        namespace=plan.cluster.namespace or NO_NAMESPACE,
        image=(platform.images.get("train") if platform else None) or TRAIN_IMAGE,
        # the owner as a run sets it, shown with placeholders (no namespace: the pod runs in the job's)
        owner=OwnerPod(OWNER_PLACEHOLDER_NAME, OWNER_PLACEHOLDER_UID),
        pod_platform=platform,
    )
    return job_manifest(plan, spec)


# Plain scalars a YAML 1.2 reader (kubectl's Go YAML) takes for a number, a boolean or null, which PyYAML
# (YAML 1.1) writes unquoted: "3e-06" is a string to PyYAML and a float to kubectl, and a float in a
# container's command is refused by the API server.
_NOT_A_STRING_IN_YAML_12 = re.compile(
    r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?|[-+]?\.(inf|Inf|INF)|\.(nan|NaN|NAN)"
    r"|0x[0-9a-fA-F]+|0o[0-7]+|true|True|TRUE|false|False|FALSE|null|Null|NULL|~|"
)


def _has_reward_source(params: dict[str, Any]) -> bool:
    extra = str(params.get("extra_train_args", ""))
    # a teacher alone is a run too: on-policy distillation
    return (
        bool(params.get("reward_model_path")) or "--reward_funcs" in extra or "--teacher_model_path" in extra
    )


def placeholders_left(params: dict[str, Any]) -> list[str]:
    """The parameters the job carries that ``params`` leave to placeholders: the job cannot be applied as it
    is until they are given."""
    left = [name for name in ("output_uri", "dataset_name") if not params.get(name)]
    return left if _has_reward_source(params) else [*left, "reward_model_path"]


def manifest_yaml(params: dict[str, Any], *, run_id: str = "manual", platform: Platform | None = None) -> str:
    """:func:`manifest` as YAML that every YAML reader reads back as the same strings."""
    import yaml

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True  # a job read by people and kubectl: the same value twice, not an &id001 anchor

    def represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
        style = '"' if _NOT_A_STRING_IN_YAML_12.fullmatch(value) else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Dumper.add_representer(str, represent_str)
    text = yaml.dump(
        manifest(params, run_id=run_id, platform=platform), Dumper=Dumper, sort_keys=False, width=120
    )
    return OWNER_NOTE + text
