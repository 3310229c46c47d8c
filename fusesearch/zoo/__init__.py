"""The model zoo: well-known architectures written from their papers with `onnx.helper`.

Problem: the loader, canonicalizer, enumerator and solvers need realistic graphs that exercise
the idioms real exporters emit (explicit BatchNormalization, decomposed LayerNorm, Shape chains,
Clip-attribute ReLU6, opset-11 Resize, control flow, ...) without downloads or torch.
Approach: one builder module per family; each model draws deterministic weights from a numpy
Generator with a fixed seed, so building twice gives byte-identical `SerializeToString()`.
Graph inputs have symbolic dims (`batch`, and `seq` for text models); `default_dims` binds them.
Invariants: every model passes `onnx.checker.check_model(full_check=True)` and runs in ONNX
Runtime (CPU) with finite outputs at its default dims.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import onnx

from ..errors import BadInput
from .bert import bert_base, bert_small
from .gpt2 import gpt2
from .llama import llama_decode, llama_prefill
from .mobilenet import mobilenetv2
from .recurrent import rnn_control
from .resnet import resnet18, resnet50
from .unet import unet
from .vit import vit_base, vit_small
from .yolo import yolo_neck

__all__ = ["ZOO", "ZooEntry", "build_model", "list_models"]


@dataclass(frozen=True)
class ZooEntry:
    """One zoo model: its name, a one-line description, its builder and its default dims."""

    name: str
    description: str
    build: Callable[..., onnx.ModelProto]
    default_dims: Mapping[str, int]

    def params(self) -> tuple[str, ...]:
        """Names of the keyword parameters `build` accepts (empty for fixed models)."""
        return tuple(inspect.signature(self.build).parameters)


_IMAGE = MappingProxyType({"batch": 1})
_TEXT = MappingProxyType({"batch": 1, "seq": 128})
_DECODE = MappingProxyType({"batch": 1, "past": 128})

ZOO: dict[str, ZooEntry] = {
    e.name: e
    for e in (
        ZooEntry("resnet18", "ResNet-18, opset 9 model-zoo style, Sum residuals, explicit BN",
                 resnet18, _IMAGE),
        ZooEntry("resnet50", "ResNet-50 v1.5, opset 13, 175 nodes with explicit BN",
                 resnet50, _IMAGE),
        ZooEntry("mobilenetv2", "MobileNetV2 1.0, opset 10, Clip-attribute ReLU6, depthwise convs",
                 mobilenetv2, _IMAGE),
        ZooEntry("vit-small", "ViT-S/16, opset 17, LayerNormalization op, 12x384, 6 heads",
                 vit_small, _IMAGE),
        ZooEntry("vit-base", "ViT-B/16, opset 17, LayerNormalization op, 12x768, 12 heads",
                 vit_base, _IMAGE),
        ZooEntry("bert-base", "BERT-base, opset 12 PyTorch export style, decomposed LayerNorm",
                 bert_base, _TEXT),
        ZooEntry("bert-small", "BERT, 2x128, 2 heads (configurable), same idioms as bert-base",
                 bert_small, _TEXT),
        ZooEntry("gpt2", "GPT-2 small decoder, opset 17, in-graph causal mask, tied LM head",
                 gpt2, _TEXT),
        ZooEntry("llama-prefill", "LLaMA-style decoder, prompt pass: RMSNorm, RoPE, SwiGLU, GQA, "
                 "present KV outputs", llama_prefill, _TEXT),
        ZooEntry("llama-decode", "LLaMA-style decoder, one decode step after `past` cached keys and "
                 "values (inputs)", llama_decode, _DECODE),
        ZooEntry("unet", "U-Net, opset 13, 4 levels, ConvTranspose upsampling, Concat skips",
                 unet, _IMAGE),
        ZooEntry("yolo-neck", "YOLO-style CSP backbone + FPN/PAN neck, opset 11 Resize, SiLU",
                 yolo_neck, _IMAGE),
        ZooEntry("rnn-control", "Elman RNN in a Loop plus a data-dependent If, opset 13",
                 rnn_control, _IMAGE),
    )
}


def list_models() -> list[ZooEntry]:
    """Every zoo entry, in listing order."""
    return list(ZOO.values())


def _entry(name: str) -> ZooEntry:
    if name not in ZOO:
        raise BadInput(
            f"unknown zoo model '{name}'; available: {', '.join(ZOO)} (see `fusesearch zoo list`)"
        )
    return ZOO[name]


def build_model(name: str, **params: int) -> onnx.ModelProto:
    """Build zoo model `name`; `params` are its builder's keyword parameters (sizes)."""
    entry = _entry(name)
    unknown = sorted(set(params) - set(entry.params()))
    if unknown:
        accepted = ", ".join(entry.params()) or "none"
        raise BadInput(
            f"zoo model '{name}' has no parameter {', '.join(unknown)}; accepted: {accepted}"
        )
    return entry.build(**params)
