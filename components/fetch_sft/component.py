"""Fetch the SFT checkpoint (Hub id, s3:// prefix or local directory) into object storage, verified."""

from kfp import dsl
from kfp.dsl import Markdown, Model, Output

from rloo.pipeline.images import SLIM_IMAGE


@dsl.component(base_image=SLIM_IMAGE, install_kfp_package=False)
def fetch_sft(plan: str, kfp_run_id: str, sft_model: Output[Model], summary: Output[Markdown]):
    """The Model artifact is only the fetched model's record (its metadata, also its file): the weights stay in
    our bucket, at the record's ``uri``."""
    from rloo.pipeline.reports import fetch_markdown
    from rloo.stages import fetch
    from rloo.stages.context import step

    # a store out of reach exits 75 (retried), anything else the user can fix 2 (not retried)
    with step("fetch", kfp_run_id, plan=plan, give_up=False, says="fetching the SFT model failed:") as s:
        done = fetch.run(s.plan, kfp_run_id)
    done.write(model=sft_model, summary=summary, markdown=fetch_markdown(done.record))
