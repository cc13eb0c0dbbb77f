"""A damaged SFT model is refused where it enters the run (the fetch step), by its weights' headers, naming
the model as the user gave it: not by the train step after minutes of scheduling, naming a scratch copy.

What a sound weights file is, as the libraries that read it decide:
- safetensors (huggingface/safetensors ``safetensors/src/tensor.rs``, ``SafeTensors::read_metadata`` and
  ``Metadata::validate``): 8 bytes little-endian header length N (at most 100,000,000), N bytes of UTF-8
  JSON, then the data, which the tensors' ``data_offsets`` cover end to end, each span the size its shape
  and dtype need, the last ending at the end of the file (``MetadataIncompleteBuffer`` otherwise). The real
  library is the oracle here: the check must refuse exactly what ``safe_open`` refuses.
- ``torch.save`` (pytorch/pytorch ``torch/serialization.py``): a zip archive, recognised by its first bytes
  (``_is_zipfile``: ``PK\\x03\\x04``) and read from its central directory at the end, holding
  ``<name>/data.pkl``; or the legacy format, which starts with the pickled ``MAGIC_NUMBER``.
- a sharded model's ``*.index.json`` (transformers ``modeling_utils.py``): ``weight_map`` names every shard.
"""

from __future__ import annotations

import json
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
import torch

from rloo.demo.tiny import TinySetup
from rloo.errors import UserError
from rloo.models import check_weight_headers, safetensors_header_problem, torch_pickle_problem
from rloo.stages.fetch import fetch_model
from rloo.storage import MANIFEST_NAME
from tests.fixtures.servers import S3Server, use_s3


def _header(data: bytes) -> tuple[int, dict]:
    (n,) = struct.unpack("<Q", data[:8])
    return n, json.loads(data[8 : 8 + n])


def _with_header(data: bytes, header: dict) -> bytes:
    n, _ = _header(data)
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data[8 + n :]


def _shifted(data: bytes) -> bytes:
    """The first tensor's span moved by one byte: the offsets no longer cover the data end to end."""
    _, header = _header(data)
    name = next(k for k in header if k != "__metadata__")
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin + 1, end + 1]
    return _with_header(data, header)


def _wrong_shape(data: bytes) -> bytes:
    _, header = _header(data)
    name = next(k for k in header if k != "__metadata__" and header[k]["shape"])
    header[name]["shape"] = [header[name]["shape"][0] * 2, *header[name]["shape"][1:]]
    return _with_header(data, header)


CORRUPTIONS = {
    "sound": lambda d: d,
    "truncated to half": lambda d: d[: len(d) // 2],
    "one byte short": lambda d: d[:-1],
    "one byte more": lambda d: d + b"\0",
    "header length zeroed": lambda d: b"\0" * 8 + d[8:],
    "header length huge": lambda d: struct.pack("<Q", 2**40) + d[8:],
    "header overwritten": lambda d: d[:8] + b"\xff" * 16 + d[24:],
    "offsets shifted": _shifted,
    "shape says more": _wrong_shape,
    "empty file": lambda d: b"",
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_the_header_check_refuses_what_safetensors_refuses(
    tiny_setup: TinySetup, tmp_path: Path, corruption: str
) -> None:
    from safetensors import SafetensorError, safe_open

    f = tmp_path / "model.safetensors"
    f.write_bytes(CORRUPTIONS[corruption]((tiny_setup.policy / "model.safetensors").read_bytes()))
    try:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                st.get_slice(name)
        refused = False
    except (SafetensorError, OSError, ValueError):
        refused = True
    problem = safetensors_header_problem(f)
    assert (problem is not None) == refused, (corruption, problem)
    assert refused == (corruption != "sound")


def _damaged_copy(tiny_setup: TinySetup, dst: Path) -> Path:
    shutil.copytree(tiny_setup.policy, dst)
    weights = dst / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a download cut short
    return dst


def test_fetch_refuses_a_local_sft_model_with_truncated_weights(
    tiny_setup: TinySetup, tmp_path: Path
) -> None:
    bad = _damaged_copy(tiny_setup, tmp_path / "sft")
    dest = tmp_path / "store" / "sft"
    with pytest.raises(UserError) as err:
        fetch_model(str(bad), str(dest))
    message = str(err.value)
    assert err.value.exit_code == 2
    assert message.startswith(f"model {bad}: model.safetensors is not readable safetensors ("), message
    assert "re-download or re-save" in message
    assert not (dest / MANIFEST_NAME).exists()  # nothing published for the train step to read
    fetch_model(str(tiny_setup.policy), str(dest))  # the sound model passes
    assert (dest / MANIFEST_NAME).is_file()


def test_fetch_names_the_s3_source_not_its_scratch_copy(
    tiny_setup: TinySetup, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, s3_server: S3Server
) -> None:
    server = use_s3(s3_server, monkeypatch)
    uri = server.copy_up(_damaged_copy(tiny_setup, tmp_path / "sft"), f"corrupt-{tmp_path.name}")
    with pytest.raises(UserError) as err:
        fetch_model(uri, str(tmp_path / "store" / "sft"))
    message = str(err.value)
    assert message.startswith(f"model {uri}: model.safetensors is not readable safetensors"), message
    assert tempfile.gettempdir() not in message and str(tmp_path) not in message


def test_torch_save_files_by_their_headers(tmp_path: Path) -> None:
    state = {"w": torch.arange(64, dtype=torch.float32)}
    zipped, legacy = tmp_path / "zipped.bin", tmp_path / "legacy.bin"
    torch.save(state, zipped)
    torch.save(state, legacy, _use_new_zipfile_serialization=False)
    assert torch_pickle_problem(zipped) is None and torch_pickle_problem(legacy) is None
    cut = tmp_path / "cut.bin"
    cut.write_bytes(zipped.read_bytes()[:-40])  # the central directory is at the end
    with pytest.raises(Exception):  # noqa: B017 - torch's own reader refuses it too
        torch.load(cut, weights_only=True)
    assert "zip archive does not read" in (torch_pickle_problem(cut) or "")
    noise = tmp_path / "noise.bin"
    noise.write_bytes(b"<html>rate limited</html>")
    assert "neither a zip header" in (torch_pickle_problem(noise) or "")


def test_a_sharded_model_must_have_every_shard(tiny_setup: TinySetup, tmp_path: Path) -> None:
    model = tmp_path / "sharded"
    shutil.copytree(tiny_setup.policy, model)
    (model / "model.safetensors").rename(model / "model-00001-of-00002.safetensors")
    _, header = _header((model / "model-00001-of-00002.safetensors").read_bytes())
    names = [k for k in header if k != "__metadata__"]
    weight_map = {n: "model-00001-of-00002.safetensors" for n in names[:-1]}
    weight_map[names[-1]] = "model-00002-of-00002.safetensors"
    (model / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    with pytest.raises(UserError, match=r"names 1 missing shard\(s\) \(model-00002-of-00002\.safetensors\)"):
        check_weight_headers(model, shown=f"model {model}")
