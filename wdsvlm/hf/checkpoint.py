"""What ``wdsvlm.hf`` keeps in a Trainer's checkpoint folder beside the Trainer's own files: the
Loader's state of every rank (``loader_states/rank-R-of-W.json``), and how the model's weights
are read back under the names the model has now."""

from __future__ import annotations

import json
import os
import re
from typing import Any

from .. import compat
from ..errors import WdsvlmError

STATES = "loader_states"
_NAME = re.compile(r"rank-(\d+)-of-(\d+)\.json$")


def state_path(checkpoint: str, rank: int, world_size: int) -> str:
    return os.path.join(checkpoint, STATES, f"rank-{rank:05d}-of-{world_size:05d}.json")


def save_loader_state(checkpoint: str, state: dict, rank: int, world_size: int) -> None:
    """This rank's ``Loader.state_dict()`` into the checkpoint folder (written whole, then
    renamed: a folder never holds half a state)."""
    path = state_path(checkpoint, rank, world_size)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(state, f)
    os.replace(path + ".tmp", path)


def load_loader_states(checkpoint: str) -> list[dict]:
    """Every rank's Loader state saved in ``checkpoint``, in rank order; an error names what is
    missing."""
    folder = os.path.join(checkpoint, STATES)
    found = {}
    sizes = set()
    if os.path.isdir(folder):
        for name in os.listdir(folder):
            match = _NAME.fullmatch(name)
            if match:
                found[int(match[1])] = os.path.join(folder, name)
                sizes.add(int(match[2]))
    if not found:
        raise WdsvlmError(
            f"checkpoint {checkpoint} holds no Loader state ({STATES}/ is missing or empty): it "
            "was not saved by a wdsvlm.hf Trainer, so the data would restart from the beginning; "
            "resume from a checkpoint saved by wdsvlm.hf.Trainer or with_loader"
        )
    (world_size,) = sizes if len(sizes) == 1 else (None,)
    if world_size is None or sorted(found) != list(range(world_size)):
        raise WdsvlmError(
            f"checkpoint {checkpoint} holds the Loader states of ranks {sorted(found)} of a run "
            f"of {sorted(sizes)} ranks: a rank's state is missing (was the save cut short?)"
        )
    states = []
    for rank in range(world_size):
        with open(found[rank]) as f:
            states.append(json.load(f))
    return states


def load_weights(model: Any, checkpoint: str) -> bool:
    """Load the weights a Trainer saved in ``checkpoint`` into ``model`` under its current
    parameter names; False if this cannot be done here (the Trainer's own loading is used).

    ``save_pretrained`` writes some models' weights under older names (Qwen2/2.5-VL's
    ``model.language_model.*`` as ``model.*``), and the stock Trainer loads them back without
    converting them, leaving those weights as they were with only a warning. The names a save
    writes are found by reverting the model's own state dict the way ``save_pretrained`` does,
    and matched to the model's names by tensor identity; any weight left unloaded is an error,
    found from the files' headers before the model is touched. The files are then loaded one at
    a time, each into the model before the next is read: a rank holds one shard, not the model.
    """
    files = weight_files(checkpoint)
    if not files:
        return False
    own = model.state_dict()
    by_identity: dict[tuple, list[str]] = {}
    for name, tensor in own.items():
        by_identity.setdefault(_identity(tensor), []).append(name)
    saved_as: dict[str, list[str]] = {}
    for saved_name, tensor in compat.revert_weight_conversion(model, dict(own)).items():
        names = by_identity.get(_identity(tensor))
        if names is None:
            return False  # a weight converted on save, not only renamed: the Trainer's way
        saved_as[saved_name] = names
    check_coverage(checkpoint, files, saved_as, set(own))
    del own, by_identity  # the model's tensors are not needed here any more
    for path in files:
        _load_file(model, path, saved_as)
    return True


def weight_files(checkpoint: str) -> list[str]:
    """The safetensors files of the model's weights in ``checkpoint`` (none: not saved so)."""
    file = os.path.join(checkpoint, "model.safetensors")
    index = os.path.join(checkpoint, "model.safetensors.index.json")
    if os.path.isfile(file):
        return [file]
    if os.path.isfile(index):
        with open(index) as f:
            shards = json.load(f)["weight_map"].values()
        return sorted({os.path.join(checkpoint, v) for v in shards})
    return []


def check_coverage(checkpoint: str, files: list[str], saved_as: dict, wanted: set[str]) -> None:
    """Every weight named in ``wanted`` is in ``files`` and nothing else is (read from their
    headers)."""
    import safetensors

    loaded: set[str] = set()
    unexpected = []
    for path in files:
        with safetensors.safe_open(path, framework="pt") as f:
            for saved_name in f.keys():
                names = saved_as.get(saved_name)
                if names is None:
                    unexpected.append(saved_name)
                else:
                    loaded.update(names)  # tied weights share one tensor
    missing = sorted(wanted - loaded)
    if missing or unexpected:
        raise WdsvlmError(
            f"checkpoint {checkpoint} does not hold this model's weights: "
            f"{len(missing)} missing (e.g. {missing[:3]}), {len(unexpected)} unknown "
            f"(e.g. {unexpected[:3]}); resuming would train from weights not in the checkpoint"
        )


def _load_file(model: Any, path: str, saved_as: dict) -> None:
    """One file's weights into ``model``; they are let go on return."""
    import safetensors.torch

    part = {
        name: tensor
        for saved_name, tensor in safetensors.torch.load_file(path, device="cpu").items()
        for name in saved_as[saved_name]
    }
    model.load_state_dict(part, strict=False)


def _identity(tensor: Any) -> tuple:
    return (tensor.data_ptr(), tuple(tensor.shape), str(tensor.dtype))
