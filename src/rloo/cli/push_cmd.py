"""``rloo push``: publish a trained model and promote it when the evaluation says it is better.

Registered by :mod:`rloo.cli` as the ``push`` command. A user error is one line on stderr and exit 2.
"""

from __future__ import annotations

import json
import sys

from rloo.errors import UserError

DESCRIPTION = (
    "Publish a trained model to object storage (<storage_uri>/<run_id>/ with a manifest), the MLflow Model "
    "Registry (--registered_model_name) and the Hugging Face Hub (--hub_repo_id, token from HF_TOKEN), and "
    "promote it (MLflow alias 'champion', copy to --production_uri) only if the 95% lower bound of the paired "
    "win-rate difference (trained - SFT) in --eval_results is above --promotion_margin and, when another run's "
    "model is champion, so is the difference with the champion on the same examples and judge; otherwise it is "
    "registered as 'candidate'. The decision is written to <output_dir>/push_result.json."
)


def main(argv: list[str]) -> int:
    from rloo.parsing import parse_config
    from rloo.push.config import PushConfig

    try:
        cfg = parse_config(PushConfig, argv, prog="rloo push", description=DESCRIPTION)
        from rloo.cli.output import setup_logging

        setup_logging()
        from rloo.push.runner import run_push

        result = run_push(cfg)
    except UserError as e:
        print(f"rloo push: error: {e}", file=sys.stderr)
        return e.exit_code
    print(json.dumps({k: result.to_dict()[k] for k in ("decision", "reason", "run_key")}))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
