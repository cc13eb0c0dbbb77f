"""Fetch the SFT checkpoint (Hub id, s3:// prefix or local directory) into object storage, verified."""

from kfp import dsl
from kfp.dsl import Markdown, Model, Output

from rloo.pipeline.images import SLIM_IMAGE


@dsl.component(base_image=SLIM_IMAGE, install_kfp_package=False)
def fetch_sft(plan: str, kfp_run_id: str, sft_model: Output[Model], summary: Output[Markdown]):
    import json
    import os
    import sys

    from rloo.errors import UserError
    from rloo.pipeline.reports import fetch_markdown
    from rloo.stages import fetch
    from rloo.stages.plan import StagePlan

    os.environ["KFP_RUN_ID"] = kfp_run_id
    try:
        # a Hub id is pinned to one commit (model_revision, else main's commit now), recorded in the metadata
        meta = fetch.run(StagePlan.from_json(plan), kfp_run_id)
    except UserError as e:  # credentials, bucket, a bad model: one line, not a traceback
        print(f"fetching the SFT model failed: {e}", file=sys.stderr)
        raise SystemExit(e.exit_code) from None  # 75 (a store out of reach) is retried, 2 is not
    # The weights stay in our bucket (metadata "uri"); the KFP artifact itself is only this small record, so
    # the KFP launcher never copies gigabytes between its own store and ours.
    sft_model.metadata.update(meta)
    with open(sft_model.path, "w") as f:
        json.dump(meta, f)
    with open(summary.path, "w") as f:
        f.write(fetch_markdown(meta))
