"""Networks as plain nn.Modules, built by torchvision from a name; the training logic lives in model.py.

    python -c "from project.backbones import ARCHS; print(ARCHS)"
"""

import abc
import difflib
import re
from collections import defaultdict
from collections.abc import Mapping
from typing import Optional, Protocol, runtime_checkable

import torch
from classifier_engine import ConfigError
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torchvision import models
from torchvision.models import WeightsEnum

NETWORK = "network"  # the attribute of HasNetwork; its tensors are `network.*` in a checkpoint's state_dict


@runtime_checkable
class HasNetwork(Protocol):
    """A LightningModule whose whole network is the plain nn.Module `self.network`: what EMA, FreezeBackbone, the
    weights, the checkpoints (`network.` keys), export and the optimizer's groups work on. Yours can be one too."""

    network: nn.Module


class Network(abc.ABC):
    """Any nn.Module, as the type of `model.backbone`: `class_path: my_module.MyNet` (a class taking num_classes).
    An abstract class with nn.Module as a virtual subclass: --help lists no subclasses (730 lines for nn.Module)."""

    @abc.abstractmethod
    def forward(self, *args, **kwargs): ...


Network.register(nn.Module)


# The classification builders at the top level of torchvision.models (not its detection, video, ... submodules).
ARCHS: tuple[str, ...] = tuple(models.list_models(module=models))


def family_of(arch: str) -> str:
    """The torchvision module an arch is defined in ("resnet", "efficientnet", "vision_transformer", ...)."""
    return models.get_model_builder(arch).__module__.rsplit(".", 1)[-1]


def _by_family() -> dict[str, list[str]]:
    families: dict[str, list[str]] = defaultdict(list)
    # Digit runs compare as numbers: resnet18 before resnet101.
    for arch in sorted(ARCHS, key=lambda n: [int(run) if run.isdigit() else run for run in re.split(r"(\d+)", n)]):
        families[family_of(arch)].append(arch)
    # ResNets first: the family the template's configs and README are written around.
    return dict(sorted(families.items(), key=lambda item: (item[0] != "resnet", item[0])))


FAMILIES: dict[str, list[str]] = _by_family()
# ResNet, Wide ResNet and ResNeXt: the builders of torchvision.models.resnet, the ones taking zero_init_residual.
RESNET_ARCHS: tuple[str, ...] = tuple(FAMILIES["resnet"])

# Whatever the weights: no auxiliary classifiers (a tuple in training mode), init_weights given (silences a warning).
_FIXED_OPTIONS = dict.fromkeys(("googlenet", "inception_v3"), {"aux_logits": False, "init_weights": True})


def unknown_arch_message(arch: str) -> str:
    """One line: the bad name, a close match if any, every valid name by family, and the way to bring your own."""
    close = difflib.get_close_matches(arch, ARCHS, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    families = "; ".join(", ".join(names) for names in FAMILIES.values())
    return (f"unknown arch {arch!r}{hint}; expected one of: {families} "
            "(or pass your own network with --model.backbone, see README 'Add your model')")


def torchvision_weights(arch: str, name: str) -> Optional[WeightsEnum]:
    """The torchvision weights entry `name` (IMAGENET1K_V1, DEFAULT, ...) of arch, or None if arch has no such entry."""
    enum = models.get_model_weights(arch)
    return enum.__members__.get(name)  # members include the DEFAULT alias


def _options_for_weights(arch: str, entry: WeightsEnum) -> dict:
    """Builder options torchvision itself sets when it builds arch with these weights (see each builder's source)."""
    if arch in ("googlenet", "inception_v3"):
        return {"transform_input": True}  # ported from TensorFlow: the network re-normalises its input itself
    if family_of(arch) == "vision_transformer":
        return {"image_size": entry.meta["min_size"][0]}  # position embeddings are sized for it (SWAG E2E: 384)
    if family_of(arch) == "maxvit":
        return {"input_size": entry.meta["min_size"]}
    return {}


def build_network(arch: str, num_classes: int, *, zero_init_residual: bool = False, weights: Optional[str] = None,
                  image_sizes: Optional[Mapping[str, int]] = None) -> nn.Module:
    """Build a randomly initialised torchvision classifier by name, shaped as torchvision weights named by `weights`
    need (ViT's image size, GoogLeNet's input transform; project.weights loads them). `image_sizes` ({option: side})
    builds a ViT for that size and refuses, naming the option, a size the network cannot take (check_image_sizes)."""
    if arch not in ARCHS:
        raise ConfigError(unknown_arch_message(arch))
    options = dict(_FIXED_OPTIONS.get(arch, {}))
    if zero_init_residual:
        if arch not in RESNET_ARCHS:
            raise ConfigError(f"zero_init_residual applies to the ResNet family ({', '.join(RESNET_ARCHS)}), not to "
                              f"arch {arch!r} ({family_of(arch)}): drop --model.zero_init_residual")
        options["zero_init_residual"] = True
    entry = torchvision_weights(arch, weights) if weights is not None else None
    if entry is not None:
        options.update(_options_for_weights(arch, entry))
    sizes = dict(image_sizes or {})
    if sizes and family_of(arch) == "vision_transformer" and "image_size" not in options:
        # The first size is the training crop's; a ViT cannot take a second one, which check_image_sizes then names.
        key, side = next(iter(sizes.items()))
        with torch.device("meta"):  # the patch side, from a ViT built without memory (16 for vit_b_16)
            patch = models.get_model(arch, weights=None).patch_size
        if side % patch:
            raise ConfigError(f"model.arch {arch} cuts images into {patch} px patches: {key}={side} is not a multiple "
                              f"of {patch}; set {_options(sizes)} to one such size (e.g. {-(-side // patch) * patch})")
        options["image_size"] = side
    network = models.get_model(arch, weights=None, num_classes=num_classes, **options)
    check_image_sizes(network, sizes, arch=arch, weights=weights)
    return network


def image_size_problem(network: nn.Module, side: int) -> Optional[str]:
    """Why `network` cannot take a batch of side x side images (the first line of its own error), or None if it can:
    one training-mode forward on meta tensors, shapes only. Only torchvision's are probed: yours may not run on meta."""
    tensors = {name: torch.empty_like(tensor, device="meta")
               for name, tensor in (*network.named_parameters(), *network.named_buffers())}
    images = torch.empty(2, 3, side, side, device="meta")  # 2: BatchNorm refuses one value per channel in training
    try:
        with torch.no_grad():
            torch.func.functional_call(network, tensors, (images,))
    except Exception as error:  # noqa: BLE001  any failure of the forward is the answer
        line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return line if len(line) <= 110 else line[:110].rsplit(" ", 1)[0] + " ..."
    return None


def _options(keys) -> str:
    """data.a, data.b and data.c"""
    keys = list(keys)
    return keys[0] if len(keys) == 1 else f"{', '.join(keys[:-1])} and {keys[-1]}"


def check_image_sizes(network: nn.Module, image_sizes: Mapping[str, int], *, arch: str,
                      weights: Optional[str] = None) -> None:
    """ConfigError (one line naming the option, what the network takes) for the first size it cannot take."""
    entry = torchvision_weights(arch, weights) if weights is not None else None
    for key, side in image_sizes.items():
        reason = image_size_problem(network, side)
        if reason is None:
            continue
        fixed = getattr(network, "image_size", None)  # a ViT: position embeddings for one image size
        if isinstance(fixed, int) and entry is not None:
            fix = f"its weights {weights} take {fixed} px images only: set {_options(image_sizes)} to {fixed}"
        elif isinstance(fixed, int):
            fix = (f"a ViT takes images of one size, a multiple of its {network.patch_size} px patches: set "
                   f"{_options(image_sizes)} to one such size")
        else:
            smallest = min(e.meta["min_size"][0] for e in models.get_model_weights(arch))
            fix = f"its torchvision weights take {smallest} px or more: set {key} to at least {smallest}"
        raise ConfigError(f"model.arch {arch} cannot take the {side} px images of {key} ({reason}): {fix}")


def shard_blocks(network: nn.Module) -> list[nn.Module]:
    """The blocks FSDP shards one by one (and activation checkpointing recomputes): ResNet stages, ViT encoder blocks,
    ConvNeXt/Swin stages; for another network, its top-level children that hold parameters."""
    if isinstance(network, models.ResNet):
        return [network.layer1, network.layer2, network.layer3, network.layer4]
    if isinstance(network, models.VisionTransformer):
        return list(network.encoder.layers)
    if isinstance(network, (models.ConvNeXt, models.SwinTransformer)):
        return [stage for stage in network.features if any(True for _ in stage.parameters())]
    return [child for child in network.children() if any(True for _ in child.parameters())]


def classifier_head(network: nn.Module) -> tuple[str, nn.Module]:
    """The qualified name and module of the layer producing the logits: the last nn.Linear or nn.Conv2d registered
    (as every torchvision classifier does: fc, classifier.1, heads.head, ...; a custom backbone must do the same)."""
    found: Optional[tuple[str, nn.Module]] = None
    for name, module in network.named_modules():
        if isinstance(module, (nn.Linear, nn.Conv2d)):
            found = (name, module)
    if found is None:
        raise ConfigError(f"{type(network).__name__} has no nn.Linear or nn.Conv2d layer: cannot find its classifier "
                          "head (the last such layer registered in __init__)")
    return found


def head_outputs(head: nn.Module) -> int:
    """How many logits the head produces."""
    return head.out_features if isinstance(head, nn.Linear) else head.out_channels


class NetworkRunner:
    """Runs a network as configured: NHWC input (channels_last) and a torch.compile'd graph (compile). Not an
    nn.Module, so state_dict keys stay free of `_orig_mod.`; DataParallel's replicas share it but run uncompiled."""

    def __init__(self, *, channels_last: bool = False, compile: bool = False) -> None:
        self.channels_last, self.compile = channels_last, compile
        self.compiled: Optional[nn.Module] = None
        self._compiled_from: Optional[nn.Module] = None

    def configure(self, network: nn.Module) -> None:
        """The network's memory format, and the compiled graph once (LightningModule.configure_model calls it)."""
        # FSDP2 shards contiguous parameters only (fully_shard refuses NHWC ones; converted after it, its lazy init
        # fails): there the NHWC input alone makes the convolutions NHWC (cuDNN and oneDNN follow input or weight).
        if self.channels_last and not isinstance(network, FSDPModule):
            network.to(memory_format=torch.channels_last)
        if self.compile and self._compiled_from is not network:
            self.compiled, self._compiled_from = torch.compile(network), network

    def __call__(self, network: nn.Module, images: torch.Tensor) -> torch.Tensor:
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        if self.compiled is not None and network is self._compiled_from:
            return self.compiled(images)
        return network(images)
