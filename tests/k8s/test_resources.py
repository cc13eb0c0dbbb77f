"""What a pod checks about itself before it trains: the GPUs it asked for are the ones it sees."""

from __future__ import annotations

import pytest

from rloo.errors import UserError
from rloo.k8s.resources import gpus_granted


def test_a_pod_that_got_its_gpus_trains_on_them() -> None:
    assert gpus_granted("8", "nvidia.com/gpu", visible=8) == 8
    assert gpus_granted("0", "nvidia.com/gpu", visible=0) == 0  # a CPU-only run asks for none


def test_a_pod_without_its_gpus_stops_in_one_line() -> None:
    # what a step scheduled without its accelerator limit sees: it must not train for hours on the CPU
    with pytest.raises(UserError, match=r"asked for 4 nvidia.com/gpu and sees 0 CUDA device\(s\)") as e:
        gpus_granted("4", "nvidia.com/gpu", visible=0)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("limit", ["", "1.5", "-1", "{{$.inputs.parameters['x']}}"])
def test_a_limit_that_is_not_a_count_is_refused(limit: str) -> None:
    with pytest.raises(UserError, match="not a whole number of GPUs"):
        gpus_granted(limit, "nvidia.com/gpu", visible=1)
