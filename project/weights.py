"""Start a network from pretrained weights: a torchvision weights name, a state_dict file or one of our .ckpt files.

    python -m project fit --config configs/quickstart.yaml --model.arch=resnet18 --model.finetune.weights=IMAGENET1K_V1
"""

import os
import pickle
import re
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from classifier_engine import ConfigError, Decision, MissingInputError, load_checkpoint
from torch import nn
from torchvision.models import WeightsEnum, get_model_weights

from project.backbones import NETWORK, classifier_head, head_outputs, torchvision_weights

CKPT_PREFIX = NETWORK + "."  # the network of a HasNetwork module (ImageClassifier), in its checkpoints
# torchvision's DenseNet files predate a rename of 'norm.1' to 'norm1' (relu, conv): renamed as its builder does.
_OLD_DENSENET_KEY = re.compile(r"^(.*denselayer\d+\.(?:norm|relu|conv))\.([12]\.[a-z_]+)$")


@dataclass(frozen=True)
class LoadReport:
    """What load_pretrained did: how many tensors came from the file, which ones kept their fresh initialisation."""

    source: str
    loaded: int
    new: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()  # file tensors of parts the network was built without (GoogLeNet's aux heads)
    head_change: str = ""  # e.g. "1000 -> 10 classes"

    def summary(self) -> str:  # one log line
        line = f"pretrained weights: loaded {self.loaded} tensors from {self.source}"
        if self.new:
            line += f"; newly initialised ({self.head_change}): {', '.join(self.new)}"
        if self.dropped:
            line += f"; ignored {len(self.dropped)} tensors of parts this network lacks ({self.dropped[0]}, ...)"
        return line


def _copy_with_metadata(state: Mapping, rename: Callable[[str], Optional[str]] = lambda key: key) -> OrderedDict:
    """A copy with renamed keys (None drops one), keeping the module versions MNASNet's load hook needs (_metadata)."""
    copy: OrderedDict = OrderedDict()
    for key, value in state.items():
        if (name := rename(key)) is not None:
            copy[name] = value
    metadata = getattr(state, "_metadata", None)
    if metadata is not None:
        copy._metadata = OrderedDict()  # keyed by module path, "" for the root: renamed as a key prefix
        for module_path, value in metadata.items():
            if (name := rename(module_path + ".")) is not None:
                copy._metadata[name[:-1]] = value
    return copy


def hub_file(entry: WeightsEnum) -> Path:
    """Where torch.hub keeps (and looks for) the file of a torchvision weights entry."""
    return Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(urllib.parse.urlparse(entry.url).path)


def _weight_names(arch: str) -> str:
    return ", ".join([*get_model_weights(arch).__members__])


def _from_hub(arch: str, name: str, entry: WeightsEnum) -> dict[str, torch.Tensor]:
    path = hub_file(entry)
    cached = path.is_file()
    try:
        # torch.hub reads a cached file without any network access and checks a download's hash against its name.
        state = entry.get_state_dict(progress=True, check_hash=True, weights_only=True, map_location="cpu")
    except Exception as error:
        if cached:
            raise ConfigError(f"could not read {path} ({type(error).__name__}: {error}): delete it and run again to "
                              f"download {arch} {name} afresh") from error
        raise MissingInputError(
            f"could not download {arch} weights {name} from {entry.url} ({type(error).__name__}: {error}); "
            f"on a machine without network, download that URL elsewhere and put {path.name} into {path.parent} "
            "(the torch hub cache: $TORCH_HOME/hub/checkpoints, by default ~/.cache/torch/hub/checkpoints)"
        ) from None
    return _copy_with_metadata(state, lambda key: _OLD_DENSENET_KEY.sub(r"\1\2", key))


def _all_tensors(content: Mapping) -> bool:
    return all(isinstance(v, torch.Tensor) for v in content.values())


def _from_file(path: Path) -> dict[str, torch.Tensor]:
    try:
        content = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
        if refused is None:
            raise ConfigError(f"{path} is not a torch checkpoint (torch.load cannot read it)") from None
        raise ConfigError(
            f"{path} holds a pickled {refused.group(1)}, which torch.load(weights_only=True) refuses (it could run "
            "code): save the weights alone, torch.save(network.state_dict(), path)"
        ) from None
    except Exception as error:
        raise ConfigError(f"{path} is not a torch checkpoint ({type(error).__name__}: {error})") from None
    if isinstance(content, Mapping) and "state_dict" not in content and not _all_tensors(content):
        content = load_checkpoint(path)  # a sharded checkpoint (strategy fsdp2_sharded): its weights are in a folder
    if isinstance(content, Mapping) and isinstance(content.get("state_dict"), Mapping):
        # One of our Lightning checkpoints: the network is the `network.` part of `state_dict` (with EMA, the average).
        state = _copy_with_metadata(content["state_dict"],
                                    lambda key: key.removeprefix(CKPT_PREFIX) if key.startswith(CKPT_PREFIX) else None)
        if not state:
            first = next(iter(content["state_dict"]), "<none>")
            raise ConfigError(f"{path} is a Lightning checkpoint without `{CKPT_PREFIX}` weights (first key "
                              f"{first!r}): expected an ImageClassifier checkpoint or a plain state_dict file")
        return state
    if isinstance(content, Mapping) and content and _all_tensors(content):
        return content
    raise ConfigError(f"{path} holds a {type(content).__name__}, not a state_dict (name -> tensor) nor a Lightning "
                      ".ckpt: save one with torch.save(network.state_dict(), path)")


def fetch_weights(weights: str, *, arch: Optional[str]) -> Optional[Path]:
    """prepare_data's part: a torchvision weights file into the hub cache, read back whole; None for a file path."""
    entry = torchvision_weights(arch, weights) if arch is not None else None
    if entry is None:
        return None
    _from_hub(arch, weights, entry)  # reading it back also proves the cached file whole
    return hub_file(entry)


def _absent_part(network: nn.Module, key: str) -> bool:
    """True when key lies under an attribute the network set to None (GoogLeNet's aux1 without aux_logits)."""
    module: object = network
    for part in key.split(".")[:-1]:
        if not hasattr(module, part):
            return False
        module = getattr(module, part)
        if module is None:
            return True
    return False


def load_state(network: nn.Module, state: Mapping[str, torch.Tensor], *, source: str, num_classes: int) -> LoadReport:
    """Copy `state` into network, all but a head for another class count; any other difference is one ConfigError."""
    head_name, head = classifier_head(network)
    if head_outputs(head) != num_classes:
        raise ConfigError(f"the last Linear/Conv2d of {type(network).__name__}, {head_name!r}, gives "
                          f"{head_outputs(head)} outputs, not num_classes={num_classes}: register its head last")
    own = network.state_dict()
    state = _copy_with_metadata(state)
    head_keys = [key for key in own if key.startswith(head_name + ".")]
    file_classes: Optional[int] = None
    for key in head_keys:
        tensor, target = state.get(key), own[key]
        # The head may differ in its class count (dim 0) only; any other shape change is another architecture.
        if tensor is not None and tensor.shape != target.shape and tensor.shape[1:] == target.shape[1:]:
            del state[key]
            file_classes = tensor.shape[0]
    for key, tensor in state.items():  # checked here for one line naming the first; torch lists them all
        if key in own and tensor.shape != own[key].shape:
            raise ConfigError(f"{source}: {key!r} has shape {tuple(tensor.shape)} in the file but "
                              f"{tuple(own[key].shape)} in the network: the file is for another architecture (check "
                              "--model.arch)")
    try:
        result = network.load_state_dict(state, strict=False)
    except RuntimeError as error:  # a shape mismatch behind a key a version hook renamed
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        first = next((line for line in lines if "size mismatch" in line), lines[-1])
        raise ConfigError(f"{source}: {first}") from None
    new = [key for key in result.missing_keys if key in head_keys]
    missing = [key for key in result.missing_keys if key not in head_keys]
    if missing:
        raise ConfigError(f"{source} has no tensor {missing[0]!r} (shape {tuple(own[missing[0]].shape)} in the "
                          f"network; {len(missing)} missing in all): the file is for another architecture, or its keys "
                          "carry a prefix")
    dropped = [key for key in result.unexpected_keys if _absent_part(network, key)]
    unexpected = [key for key in result.unexpected_keys if key not in dropped]
    if unexpected:
        raise ConfigError(f"{source} has a tensor {unexpected[0]!r} (shape {tuple(state[unexpected[0]].shape)}) the "
                          f"network does not have ({len(unexpected)} such in all): the file is for another "
                          "architecture (check --model.arch)")
    change = f"{file_classes} -> {num_classes} classes" if file_classes is not None else "no head in the file"
    return LoadReport(source, len(own) - len(result.missing_keys), tuple(new), tuple(dropped), change if new else "")


def load_pretrained(network: nn.Module, weights: str, *, arch: Optional[str], num_classes: int) -> LoadReport:
    """Load `weights`, a torchvision weights name of arch (DEFAULT, IMAGENET1K_V1, ...) or a file, into network."""
    entry = torchvision_weights(arch, weights) if arch is not None else None
    path = Path(weights).expanduser()
    if entry is not None:
        state, source = _from_hub(arch, weights, entry), f"{arch} {weights} ({hub_file(entry)})"
    elif path.is_file():
        state, source = _from_file(path), str(path)
    elif arch is None:
        raise ConfigError(f"--model.finetune.weights {weights!r} is not a file: with --model.backbone it takes the "
                          "path of a state_dict or .ckpt file (a weights name needs a torchvision --model.arch)")
    else:
        raise ConfigError(f"--model.finetune.weights {weights!r} is neither a file nor a torchvision weights name of "
                          f"{arch} (one of: {_weight_names(arch)}): give one of those names, or the path of a "
                          "state_dict or .ckpt file")
    return load_state(network, state, source=source, num_classes=num_classes)


def eval_sizes(arch: str, weights_name: str) -> tuple[int, int]:
    """(resize, crop) of the evaluation transform that goes with a torchvision weights entry."""
    entry = torchvision_weights(arch, weights_name)
    if entry is None:
        raise ConfigError(f"{arch} has no torchvision weights {weights_name!r}; expected one of: {_weight_names(arch)}")
    preset = entry.transforms()
    return preset.resize_size[0], preset.crop_size[0]


def weights_eval_sizes(given) -> list[Decision]:
    """A pass of the run plan: torchvision weights' evaluation resize and crop become the data's, unless given."""
    model, data = given.config.model.get("init_args"), given.config.data.get("init_args")
    weights = model.get("finetune.weights") if model is not None else None
    if not weights or data is None or model.get("backbone") is not None:
        return []
    arch = model.get("arch")
    if not arch or torchvision_weights(arch, weights) is None:
        return []
    explicit = given.explicit.get("data.init_args") or {}
    sizes = dict(zip(("eval_resize_size", "eval_crop_size"), eval_sizes(arch, weights)))
    edits = tuple((f"data.init_args.{key}", value) for key, value in sizes.items()
                  if key in data and explicit.get(key) is None and data[key] != value)
    return [Decision("evaluation sizes", sizes, f"the evaluation transform of {arch} {weights}", edits=edits)] \
        if edits else []
