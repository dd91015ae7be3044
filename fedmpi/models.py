"""Model zoo. Every model is ``classifier(features(x))``.

``features(x)`` returns the penultimate representation ``[B, feature_dim]``
(FedGPS aligns these) and ``classifier`` is a single ``nn.Linear`` head.
Models adapt to the input size: pooling uses ``ceil_mode`` and the head sits on
an adaptive average pool, so the 8×8 ``digits`` images work with every model.

``norm`` selects the normalisation layer: ``bn`` (BatchNorm with running
statistics), ``static_bn`` (BatchNorm without running statistics, as in
HeteroFL/FedLAGC: batch statistics in training *and* evaluation) or ``gn``
(GroupNorm).
"""
from __future__ import annotations

import abc
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from fedmpi.errors import ConfigError
from fedmpi.config.core import Config

NormFactory = Callable[[int], nn.Module]


def norm_layer(kind: str) -> NormFactory:
    """Return a constructor ``f(channels) -> nn.Module`` for ``model.norm``."""
    if kind == "bn":
        return nn.BatchNorm2d
    if kind == "static_bn":
        return lambda c: nn.BatchNorm2d(c, track_running_stats=False)
    if kind == "gn":
        return lambda c: nn.GroupNorm(min(32, c // 2) or 1, c)
    raise ConfigError(f"config key 'model.norm' expects one of bn|static_bn|gn, got {kind!r}")


class FeatureModel(nn.Module, metaclass=abc.ABCMeta):
    """Base class: ``forward(x) = classifier(features(x))``."""

    feature_dim: int
    classifier: nn.Linear

    @abc.abstractmethod
    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Penultimate representation ``[B, feature_dim]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))

    def head_parameter_names(self) -> list[str]:
        """Names of the classifier's parameters (the FedVG "head block")."""
        return [f"classifier.{n}" for n, _ in self.classifier.named_parameters()]


class LeNet(FeatureModel):
    """LeNet-5 style: conv(6,5)–pool–conv(16,5)–pool–fc120–fc84–head.

    Convolutions are padded ("same") so inputs as small as 8×8 work; on 28×28
    MNIST this is the usual padded LeNet. No normalisation layers.
    """

    def __init__(self, in_channels: int, num_classes: int, image_size: int) -> None:
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(in_channels, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2, ceil_mode=True),
            nn.Conv2d(6, 16, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2, ceil_mode=True),
        )
        side = -(-(-(-image_size // 2)) // 2)  # two ceil-mode halvings
        self.fc = nn.Sequential(nn.Flatten(), nn.Linear(16 * side * side, 120), nn.ReLU(),
                                nn.Linear(120, 84), nn.ReLU())
        self.feature_dim = 84
        self.classifier = nn.Linear(84, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(x))


class CNN(FeatureModel):
    """The ECGR paper's CNN: four blocks conv3×3 → norm → ReLU → max-pool with
    32, 64, 128, 256 channels, global average pool, linear head."""

    def __init__(self, in_channels: int, num_classes: int, norm: NormFactory,
                 widths: tuple[int, ...] = (32, 64, 128, 256)) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c = in_channels
        for w in widths:
            layers += [nn.Conv2d(c, w, 3, padding=1, bias=False), norm(w), nn.ReLU(inplace=True),
                       nn.MaxPool2d(2, ceil_mode=True)]
            c = w
        self.body = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.feature_dim = c
        self.classifier = nn.Linear(c, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, cout: int, stride: int, norm: NormFactory) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = norm(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = norm(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), norm(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int, norm: NormFactory) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = norm(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = norm(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = norm(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), norm(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = torch.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return torch.relu(out + self.shortcut(x))


class ResNet(FeatureModel):
    """ResNet with the CIFAR stem (3×3 conv, stride 1, no max-pool) or, with
    ``stem="imagenet"``, torchvision's stem (7×7 conv stride 2, 3×3 max-pool
    stride 2), as used for 64–224 px inputs (FedVG: Tiny-ImageNet, COVID19,
    DermaMNIST with ResNet-50).

    Each residual block is a child of ``layer1``…``layer4``; FedVG's ``block``
    granularity groups parameters by these module paths.
    """

    def __init__(self, block: Any, depths: tuple[int, int, int, int], in_channels: int,
                 num_classes: int, norm: NormFactory, stem: str = "cifar") -> None:
        super().__init__()
        if stem == "imagenet":
            self.conv1 = nn.Conv2d(in_channels, 64, 7, 2, 3, bias=False)
            self.maxpool: nn.Module = nn.MaxPool2d(3, 2, 1)
        else:
            self.conv1 = nn.Conv2d(in_channels, 64, 3, 1, 1, bias=False)
            self.maxpool = nn.Identity()
        self.bn1 = norm(64)
        cin = 64
        stages = []
        for i, (width, depth) in enumerate(zip((64, 128, 256, 512), depths)):
            blocks = []
            for j in range(depth):
                stride = 2 if (i > 0 and j == 0) else 1
                blocks.append(block(cin, width, stride, norm))
                cin = width * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.feature_dim = cin
        self.classifier = nn.Linear(cin, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        out = self.maxpool(torch.relu(self.bn1(self.conv1(x))))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        return torch.flatten(self.pool(out), 1)


class MLP(FeatureModel):
    """Multi-layer perceptron on the flattened input (tabular features, or any tensor
    shape): ``Linear → ReLU`` per width of ``model.mlp.hidden``, then the head. No
    normalisation layers (the inputs are standardised by :meth:`Dataset.prepare`)."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int,
                 hidden: tuple[int, ...] = (64, 64)) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = 1
        for d in input_shape:
            width *= int(d)
        for h in hidden:
            layers += [nn.Linear(width, int(h)), nn.ReLU()]
            width = int(h)
        self.body = nn.Sequential(*layers)
        self.feature_dim = width
        self.classifier = nn.Linear(width, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class ViT(FeatureModel):
    """Vision Transformer from torchvision (``VisionTransformer``, patch 16).

    ``vit_s16``: 12 blocks, 6 heads, width 384, MLP 1536 (ViT-S/16);
    ``vit_b16``: 12 blocks, 12 heads, width 768, MLP 3072 (ViT-B/16).
    ``features(x)`` is the final-LayerNorm class token; ``classifier`` the head.
    Inputs must be square with a side divisible by 16 (224 in the FedVG paper).
    Randomly initialised (no pretrained weights are downloaded). For FedVG's
    ``block`` granularity each ``encoder_layer_i`` is a block.
    """

    SPECS = {"vit_s16": (12, 6, 384, 1536), "vit_b16": (12, 12, 768, 3072)}

    def __init__(self, name: str, in_channels: int, num_classes: int, image_size: int) -> None:
        super().__init__()
        from torchvision.models.vision_transformer import VisionTransformer

        layers, heads, hidden, mlp = self.SPECS[name]
        self.body = VisionTransformer(image_size, 16, layers, heads, hidden, mlp)
        if in_channels != 3:
            self.body.conv_proj = nn.Conv2d(in_channels, hidden, 16, 16)
        self.body.heads = nn.Identity()
        self.feature_dim = hidden
        self.classifier = nn.Linear(hidden, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


MODEL_NAMES = ("lenet", "cnn", "resnet18", "resnet34", "resnet50", "vit_s16", "vit_b16", "mlp")
#: A built-in name or a factory ``(input_shape, num_classes) -> nn.Module``.
ModelSpec = Union[str, Callable[[tuple[int, ...], int], nn.Module]]


def model_spec(cfg: Config, model: Optional[Callable] = None) -> ModelSpec:
    """What :func:`build_model` builds for ``cfg``: a factory given to :func:`fedmpi.run`
    (``model``), an import path's factory (:mod:`fedmpi.imports`), the MLP with
    ``model.mlp.hidden``, or a built-in name."""
    from fedmpi import imports

    if model is not None:
        return imports.model_factory(model)
    name = cfg.model.name
    if imports.is_import_path(name):
        return imports.model_factory(name)
    if name == "mlp":
        hidden = tuple(cfg.model.mlp.hidden)
        return lambda input_shape, num_classes: MLP(input_shape, num_classes, hidden)
    return name


def build_model(name: ModelSpec, input_shape: tuple[int, ...], num_classes: int,
                norm: str = "bn") -> nn.Module:
    """Build ``model.name`` (or a factory from :func:`model_spec`) for inputs of
    shape ``input_shape``: ``(C, H, W)`` for the image models, any shape for
    ``mlp`` and user factories.

    Parameter initialisation uses the global torch RNG; callers seed it so that
    every rank builds the identical initial model.
    """
    if callable(name):
        return name(tuple(input_shape), num_classes)
    if name == "mlp":
        return MLP(input_shape, num_classes)
    if len(input_shape) != 3:
        raise ConfigError(f"config key 'model.name': {name} needs images [C, H, W], the data has "
                          f"inputs of shape {tuple(input_shape)} (use mlp or your own model)")
    c, h, w = input_shape
    if name == "lenet":
        return LeNet(c, num_classes, h)
    if name in ViT.SPECS:
        if h != w or h % 16:
            raise ConfigError(f"config key 'model.name': {name} needs square inputs with a side "
                              f"divisible by 16 (e.g. 224), the data has {h}x{w}")
        return ViT(name, c, num_classes, h)
    # ResNets: torchvision's ImageNet stem from 64 px up, the CIFAR stem below.
    stem = "imagenet" if min(h, w) >= 64 else "cifar"
    nf = norm_layer(norm)
    if name == "cnn":
        return CNN(c, num_classes, nf)
    if name == "resnet18":
        return ResNet(BasicBlock, (2, 2, 2, 2), c, num_classes, nf, stem)
    if name == "resnet34":
        return ResNet(BasicBlock, (3, 4, 6, 3), c, num_classes, nf, stem)
    if name == "resnet50":
        return ResNet(Bottleneck, (3, 4, 6, 3), c, num_classes, nf, stem)
    raise ConfigError(f"config key 'model.name': model {name!r} is not available; "
                      f"choose one of {', '.join(MODEL_NAMES)}")
