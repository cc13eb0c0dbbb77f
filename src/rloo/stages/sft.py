"""The SFT model as the steps share it: the rule a local one must follow, the Hub's answer about a Hub id,
and the name a fetched one goes by in cards and reports. The validate, fetch, evaluate and push steps all
read it here, so no step module imports another.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from rloo.errors import UserError

# What a local SFT model must be: a full model. A LoRA adapter alone names its base model by a path or an
# unpinned Hub id that the pods would have to reach on their own, and vLLM cannot load it.
SFT_MODEL_HINT = (
    "give a Hub id, an s3:// prefix or a model directory (a LoRA adapter's merged model: 'rloo train "
    "--use_peft --merge_adapter' writes it to <output_dir>/merged)"
)


def local_sft_model(model: str) -> Path:
    """The directory the local SFT model ``model`` names, when it holds a full model
    (:func:`rloo.models.local_model_dir`, the rule of every stage); one line naming the parameter otherwise."""
    from rloo.models import local_model_dir

    try:
        return local_model_dir("model", model, adapter=False, hint=SFT_MODEL_HINT)
    except UserError as e:  # the flag --model is the pipeline parameter model
        raise UserError(re.sub(r"--model\b", "model", str(e))) from None


def hub_model_info(model: str, revision: str | None, hub_api: Any = None) -> Any:
    """The Hub's ``model_info`` of ``revision`` (default: main) of ``model``; a one-line UserError for a repo
    or revision the Hub does not know or will not serve (the validate step's check and the fetch step's pin
    both ask here). ``hub_api``: an ``HfApi`` (tests pass a stand-in)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        return (hub_api or HfApi()).model_info(model, revision=revision or None)
    except GatedRepoError:
        raise UserError(
            f"model {model}: gated on the Hugging Face Hub; accept its terms and put a token in the hf_secret."
        ) from None
    except RevisionNotFoundError:
        raise UserError(
            f"model {model}: the Hugging Face Hub has no revision {revision!r} of it; give a commit, branch or "
            "tag that exists (or no model_revision for the current main)."
        ) from None
    except RepositoryNotFoundError:
        raise UserError(
            f"model {model}: not found on the Hugging Face Hub (a private repo needs HF_TOKEN in the hf_secret); "
            "check the id, or give an s3:// prefix or a directory."
        ) from None


def durable_model_name(fetched: dict[str, Any]) -> str:
    """How to name a fetched SFT model in cards and reports: its Hub id, else the store URI it was copied to
    (a path on the machine that ran the fetch step means nothing later)."""
    from rloo.storage.location import source_kind

    source = str(fetched.get("source") or "")
    if source and source_kind(source) == "hub":
        return source
    return str(fetched.get("uri") or source)
