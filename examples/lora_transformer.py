"""LoRA on a frozen transformer: only the adapter and the head travel.

A Vision Transformer from Hugging Face ``transformers``, built from a configuration with
random weights (nothing is downloaded), wrapped by ``peft``'s LoRA: the attention's query
and value projections get rank-4 adapters, the classifier head stays trainable, and every
other weight is frozen (``requires_grad=False``). fedmpi exchanges, aggregates and
checkpoints only the trainable vector, so ``/rounds/bytes_up`` is 4 bytes × trainable
parameters × participants. Needs ``pip install -e ".[peft]"``::

    fedmpi run configs/quickstart.yaml --set model.name=examples.lora_transformer:vit_lora \\
        --set train.rounds=5 --out runs/lora
    mpiexec -n 3 fedmpi run configs/quickstart.yaml \\
        --set model.name=examples.lora_transformer:vit_lora --out runs/lora-n3

Your own Hugging Face model is the same factory with ``from_pretrained`` on a local
directory (docs/large-models.md).
"""
from __future__ import annotations

from torch import nn


class Logits(nn.Module):
    """A Hugging Face classifier as fedmpi calls a model: images in, logits out."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(pixel_values=x).logits


def vit_lora(input_shape, num_classes, rank: int = 4):
    """A 2-layer ViT (hidden 64, 8×8 patches) for ``input_shape`` = (C, H, W), random
    weights from the global torch RNG (fedmpi seeds it: every rank builds the same model),
    with LoRA adapters of ``rank`` on query and value; the head is trained in full."""
    from peft import LoraConfig, get_peft_model
    from transformers import ViTConfig, ViTForImageClassification

    c, h, _ = input_shape
    config = ViTConfig(image_size=h, patch_size=8, num_channels=c, hidden_size=64,
                       num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                       num_labels=num_classes)
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, modules_to_save=["classifier"],
                      target_modules=r".*\.(q_proj|v_proj|query|value)$")   # transformers 5 | 4
    return Logits(get_peft_model(ViTForImageClassification(config), lora))
