"""Architectures from ``transformers``' own module code with tiny random configs: the coverage sweep's models.

Each :class:`Architecture` names a config class, a model class and the config's fields; :func:`build` returns the
model (seeded, eval, BatchNorm statistics from a few batches so no channel is dead) with its example input, its
calibration batches and a held-out batch. The module code is transformers' own, unchanged; only the configs are
tiny. ``transformers`` is an extra (``pip install quantlens[hf]``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

import torch

from quantlens.errors import QuantLensError

__all__ = ["Architecture", "ARCHITECTURES", "build", "list_architectures", "settle_batch_norms"]

_TEXT = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
             max_position_embeddings=64)
_DECODER = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                max_position_embeddings=64, num_key_value_heads=2, use_cache=False)
_VIT = dict(image_size=32, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64)
_AUDIO = dict(vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
              conv_dim=(16, 16), conv_stride=(5, 4), conv_kernel=(10, 4), num_conv_pos_embeddings=8,
              num_conv_pos_embedding_groups=4, do_stable_layer_norm=False)


@dataclass(frozen=True)
class Architecture:
    """A transformers model class with a tiny config, and the kind of input it takes."""

    name: str
    family: str  # text / vision / audio / speech
    kind: str  # conv / attention / recurrent / normalization
    config: str
    model: str
    inputs: str  # text, image, audio, features, image64
    fields: dict[str, Any] = field(default_factory=dict)


_A = Architecture
ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in [
    _A("bert", "text", "attention", "BertConfig", "BertModel", "text", _TEXT),
    _A("roberta", "text", "attention", "RobertaConfig", "RobertaModel", "text", _TEXT),
    _A("distilbert", "text", "attention", "DistilBertConfig", "DistilBertModel", "text",
       dict(vocab_size=99, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=64)),
    _A("albert", "text", "attention", "AlbertConfig", "AlbertModel", "text", dict(_TEXT, embedding_size=16)),
    _A("electra", "text", "attention", "ElectraConfig", "ElectraModel", "text", dict(_TEXT, embedding_size=16)),
    _A("mpnet", "text", "attention", "MPNetConfig", "MPNetModel", "text", _TEXT),
    _A("xlm_roberta", "text", "attention", "XLMRobertaConfig", "XLMRobertaModel", "text", _TEXT),
    _A("gpt2", "text", "attention", "GPT2Config", "GPT2Model", "ids",
       dict(vocab_size=99, n_embd=32, n_layer=2, n_head=4, n_positions=64, use_cache=False)),
    _A("opt", "text", "attention", "OPTConfig", "OPTModel", "ids",
       dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
            max_position_embeddings=64, word_embed_proj_dim=32, use_cache=False)),
    _A("llama", "text", "normalization", "LlamaConfig", "LlamaModel", "ids", _DECODER),
    _A("mistral", "text", "normalization", "MistralConfig", "MistralModel", "ids", _DECODER),
    _A("qwen2", "text", "normalization", "Qwen2Config", "Qwen2Model", "ids", _DECODER),
    _A("gemma", "text", "normalization", "GemmaConfig", "GemmaModel", "ids", dict(_DECODER, head_dim=8)),
    _A("phi", "text", "attention", "PhiConfig", "PhiModel", "ids", _DECODER),
    _A("bloom", "text", "attention", "BloomConfig", "BloomModel", "ids",
       dict(vocab_size=99, hidden_size=32, n_layer=2, n_head=4, use_cache=False)),
    _A("gpt_neox", "text", "attention", "GPTNeoXConfig", "GPTNeoXModel", "ids", dict(_TEXT, use_cache=False)),
    _A("t5_encoder", "text", "normalization", "T5Config", "T5EncoderModel", "text",
       dict(vocab_size=99, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)),
    _A("convbert", "text", "conv", "ConvBertConfig", "ConvBertModel", "text", dict(_TEXT, embedding_size=32)),
    _A("vit", "vision", "attention", "ViTConfig", "ViTModel", "image", _VIT),
    _A("deit", "vision", "attention", "DeiTConfig", "DeiTModel", "image", _VIT),
    _A("beit", "vision", "attention", "BeitConfig", "BeitModel", "image",
       dict(_VIT, use_relative_position_bias=True)),
    _A("dinov2", "vision", "attention", "Dinov2Config", "Dinov2Model", "image", dict(_VIT, image_size=32)),
    _A("swin", "vision", "attention", "SwinConfig", "SwinModel", "image",
       dict(image_size=32, patch_size=2, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4)),
    _A("convnext", "vision", "conv", "ConvNextConfig", "ConvNextModel", "image",
       dict(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2)),
    _A("resnet", "vision", "conv", "ResNetConfig", "ResNetModel", "image",
       dict(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic")),
    _A("regnet", "vision", "conv", "RegNetConfig", "RegNetModel", "image",
       dict(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], groups_width=8)),
    _A("mobilenet_v1", "vision", "conv", "MobileNetV1Config", "MobileNetV1Model", "image",
       dict(image_size=32, depth_multiplier=0.25)),
    _A("mobilenet_v2", "vision", "conv", "MobileNetV2Config", "MobileNetV2Model", "image",
       dict(image_size=32, depth_multiplier=0.25)),
    _A("mobilevit", "vision", "attention", "MobileViTConfig", "MobileViTModel", "image64",
       dict(image_size=64, hidden_sizes=[16, 24, 32], neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64],
            num_attention_heads=2)),
    _A("efficientnet", "vision", "conv", "EfficientNetConfig", "EfficientNetModel", "image",
       dict(image_size=32, width_coefficient=0.25, depth_coefficient=0.25, hidden_dim=320)),
    _A("poolformer", "vision", "normalization", "PoolFormerConfig", "PoolFormerModel", "image",
       dict(hidden_sizes=[16, 32, 32, 32], depths=[1, 1, 1, 1], num_encoder_blocks=4)),
    _A("segformer", "vision", "attention", "SegformerConfig", "SegformerModel", "image64",
       dict(hidden_sizes=[8, 16, 16, 32], depths=[1, 1, 1, 1], num_attention_heads=[1, 1, 2, 2])),
    _A("levit", "vision", "attention", "LevitConfig", "LevitModel", "image64",
       dict(image_size=64, hidden_sizes=[16, 32, 48], num_attention_heads=[1, 2, 3], depths=[1, 1, 1],
            key_dim=[8, 8, 8])),
    _A("wav2vec2", "speech", "normalization", "Wav2Vec2Config", "Wav2Vec2Model", "audio", _AUDIO),
    _A("hubert", "speech", "normalization", "HubertConfig", "HubertModel", "audio", _AUDIO),
    _A("wavlm", "speech", "attention", "WavLMConfig", "WavLMModel", "audio", dict(_AUDIO, num_buckets=16)),
    _A("whisper_encoder", "speech", "attention", "WhisperConfig", "models.whisper.modeling_whisper.WhisperEncoder", "features",
       dict(vocab_size=99, num_mel_bins=16, d_model=32, encoder_layers=2, encoder_attention_heads=4,
            encoder_ffn_dim=64, max_source_positions=16)),
    _A("ast", "audio", "attention", "ASTConfig", "ASTModel", "spectrogram",
       dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, patch_size=8,
            frequency_stride=8, time_stride=8, max_length=32, num_mel_bins=16)),
]}


def list_architectures() -> list[str]:
    """The names of :data:`ARCHITECTURES`, in declaration order."""
    return list(ARCHITECTURES)


def _input(arch: Architecture, seed: int, batch: int = 2):
    g = torch.Generator().manual_seed(seed)
    if arch.inputs in ("text", "ids"):  # ids: decoders, whose second positional argument is not the mask
        ids = torch.randint(3, 99, (batch, 12), generator=g)
        return (ids, torch.ones_like(ids)) if arch.inputs == "text" else (ids,)
    if arch.inputs in ("image", "image64"):
        size = 64 if arch.inputs == "image64" else 32
        return (torch.randn(batch, 3, size, size, generator=g),)
    if arch.inputs == "audio":
        return (torch.randn(batch, 800, generator=g),)
    if arch.inputs == "features":
        return (torch.randn(batch, arch.fields["num_mel_bins"], 2 * arch.fields["max_source_positions"],
                            generator=g),)
    if arch.inputs == "spectrogram":
        return (torch.randn(batch, arch.fields["max_length"], arch.fields["num_mel_bins"], generator=g),)
    raise QuantLensError(f"architecture {arch.name!r}: unknown input kind {arch.inputs!r}")


def settle_batch_norms(model: torch.nn.Module, batches: list, whole_model: bool = False) -> None:
    """BatchNorm statistics from the calibration batches: random init leaves them at 0/1. A cumulative average
    (momentum None), not the default 0.1, whose 4 updates would keep 66% of the 0/1 init: a deep net's activations
    then shrink layer by layer (MobileViT's to 1e-10, under the march's least scale). ``whole_model``: the model in
    training mode for it (else the norms alone, so no dropout or input masking runs); the norms end in eval mode."""
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None
    for m in ([model] if whole_model else norms):
        m.train()
    with torch.no_grad():
        for b in batches:
            model(*b)
    for m, momentum in zip(norms, momenta):
        m.momentum = momentum
        m.eval()


def build(name: str, n_batches: int = 4) -> tuple[torch.nn.Module, tuple, list, tuple]:
    """``(model, example, calibration batches, held-out batch)`` for the architecture ``name``."""
    if name not in ARCHITECTURES:
        raise QuantLensError(f"unknown architecture {name!r}; known: {', '.join(ARCHITECTURES)}")
    import transformers

    arch = ARCHITECTURES[name]
    torch.manual_seed(0)
    config = getattr(transformers, arch.config)(**arch.fields)
    model_class = transformers
    for part in arch.model.split("."):  # a class not exported at the top level: its module path
        model_class = getattr(model_class, part) if hasattr(model_class, part) else importlib.import_module(
            f"{model_class.__name__}.{part}")
    model = model_class(config)
    batches = [_input(arch, seed) for seed in range(1, n_batches + 1)]
    settle_batch_norms(model, batches, whole_model=True)
    model.eval()
    return model, _input(arch, 0), batches, _input(arch, 100)
