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
    from rloo.pipeline.platform import Platform

# What a required pipeline parameter becomes when it is not given: visibly a placeholder, yet a value every
# check accepts (the job only carries output_uri and the training config).
PLACEHOLDERS: dict[str, Any] = {
    "model": "<model>",
    "dataset_name": "<dataset_name>",
    "eval_dataset_name": "<eval_dataset_name>",
    "judge_base_url": "http://judge.invalid/v1",
    "judge_model": "<judge_model>",
    "output_uri": "s3://<bucket>/<prefix>",
}
# The namespace when the namespace parameter is empty: none in the manifest, so 'kubectl apply -n' decides.
NO_NAMESPACE = ""
# The train step's pod owns the job it launches (rloo.pipeline.trainjob.OwnerPod); only a run knows which.
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
    from dataclasses import replace

    from rloo.pipeline.images import TRAIN_IMAGE
    from rloo.pipeline.layout import RunLayout
    from rloo.pipeline.params import check_params, with_defaults
    from rloo.pipeline.steps import check_pipeline_params, multinode_spec
    from rloo.pipeline.trainjob import OwnerPod, build_job

    given = check_params(params, required=False)
    p = with_defaults({k: v for k, v in PLACEHOLDERS.items() if k not in given} | given)
    if not _has_reward_source(p):
        p["reward_model_path"] = "<reward_model_path>"  # a reward source is required; none was given
    train_config = check_pipeline_params(p, check_paths=False)
    if int(p["num_nodes"]) < 2:
        raise UserError(
            f"the multi-node job is for num_nodes >= 2 (got {p['num_nodes']}): pass --param num_nodes=N."
        )
    spec = multinode_spec(
        run_id=run_id,
        run_name=run_id,
        sft_uri=RunLayout(str(p["output_uri"]), run_id).sft,  # where the fetch step publishes the SFT model
        train_config=train_config,
        output_uri=str(p["output_uri"]),
        namespace=str(p["namespace"]) or NO_NAMESPACE,
        image=(platform.images.get("train") if platform else None) or TRAIN_IMAGE,
        gpu_count=int(p["gpu_count"]),
        num_nodes=int(p["num_nodes"]),
        gpu_resource=str(p["gpu_resource"]),
        node_selector=dict(p["gpu_node_selector"]),
        cpu=str(p["train_cpu"]),
        memory=str(p["train_memory"]),
        service_account=str(p["train_service_account"]),
        s3_secret=str(p["s3_secret"]),
        mlflow_secret=str(p["mlflow_secret"]),
        hf_secret=str(p["hf_secret"]),
        mlflow_experiment=str(p["mlflow_experiment"]),
        queue_name=str(p["queue_name"]),
        priority_class=str(p["priority_class"]),
        istio_sidecar=bool(p["istio_sidecar"]),
        pod_platform=platform,
    )
    # the owner as a run sets it, shown with placeholders (no namespace: the pod runs in the job's)
    spec = replace(spec, owner=OwnerPod(OWNER_PLACEHOLDER_NAME, OWNER_PLACEHOLDER_UID))
    return build_job(spec, str(p["multinode_backend"]), str(p["training_runtime"]))


# Plain scalars a YAML 1.2 reader (kubectl's Go YAML) takes for a number, a boolean or null, which PyYAML
# (YAML 1.1) writes unquoted: "3e-06" is a string to PyYAML and a float to kubectl, and a float in a
# container's command is refused by the API server.
_NOT_A_STRING_IN_YAML_12 = re.compile(
    r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?|[-+]?\.(inf|Inf|INF)|\.(nan|NaN|NAN)"
    r"|0x[0-9a-fA-F]+|0o[0-7]+|true|True|TRUE|false|False|FALSE|null|Null|NULL|~|"
)


def _has_reward_source(params: dict[str, Any]) -> bool:
    return bool(params.get("reward_model_path")) or "--reward_funcs" in str(
        params.get("extra_train_args", "")
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
        pass

    def represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
        style = '"' if _NOT_A_STRING_IN_YAML_12.fullmatch(value) else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Dumper.add_representer(str, represent_str)
    text = yaml.dump(
        manifest(params, run_id=run_id, platform=platform), Dumper=Dumper, sort_keys=False, width=120
    )
    return OWNER_NOTE + text
