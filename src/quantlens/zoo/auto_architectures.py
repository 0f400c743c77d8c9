"""Every model class of ``transformers`` that builds from its own config class with a tiny config: the automatic
coverage sweep's models (``benchmarks/bench_coverage.py --auto``).

:func:`enumerate_architectures` walks transformers' base-model mapping (model type -> base model class) and decides
each model's input from its class's ``main_input_name`` and its ``forward`` signature: token ids, an image, a raw
waveform or audio features. Models it cannot drive with one such input (two modalities, an inference session, a
time series), and models whose modules need a package that is not installed, come back apart, each with a one-line
why. :func:`tiny_config` shrinks a config class's defaults by generic rules on field names and types (widths to 32,
layers to 2, heads to 4, feed-forward widths to 64, vocabulary to 99, images to 32 pixels, ...), not by a table per
model; :func:`build_auto` returns ``(model, example, calibration batches, held-out batch)`` as
:func:`quantlens.zoo.architectures.build` does, after one float forward on the example. The module code is
transformers' own, unchanged; only the configs are tiny and the weights random (seeded).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch

from quantlens.errors import QuantLensError
from quantlens.zoo.architectures import settle_batch_norms

__all__ = ["AutoArchitecture", "OVERRIDES", "KeywordCall", "enumerate_architectures", "describe", "tiny_fields",
           "tiny_config", "build_auto"]

#: field name -> tiny value, for integer fields (a field already at or under the tiny value keeps its own)
_WIDTH = 32
_INTS = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "embed_dim", "dim", "d_embed", "word_embed_proj_dim",
                     "embedding_size", "embedding_dim", "emb_dim", "projection_dim", "text_embed_dim",
                     "vision_embed_dim", "encoder_hidden_size", "decoder_hidden_size", "hidden_dim_encoder",
                     "out_hidden_size", "output_hidden_size", "pooler_output_size", "attention_hidden_size",
                     "classifier_proj_size", "codevector_dim", "proj_codevector_dim", "xvector_output_dim",
                     "hidden_size_per_layer_input", "projector_hidden_size", "d_inner_model"), _WIDTH),
    **dict.fromkeys(("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers",
                     "num_encoder_layers", "num_decoder_layers", "depth", "num_blocks"), 2),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads",
                     "decoder_attention_heads", "num_encoder_attention_heads", "num_decoder_attention_heads"), 4),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num",
                     "encoder_kv_heads"), 2),
    **dict.fromkeys(("head_dim", "d_kv", "qk_head_dim", "v_head_dim", "kv_channels", "mamba_d_head",
                     "attention_head_size", "swa_head_dim", "index_head_dim", "linear_key_head_dim",
                     "linear_value_head_dim", "linear_head_dim"), 8),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "d_ff", "encoder_ffn_dim", "decoder_ffn_dim", "hidden_dim",
                     "n_inner", "d_inner", "mlp_dim", "dim_feedforward", "ffn_hidden_size", "encoder_feedforward_dim",
                     "decoder_intermediate_size", "shared_intermediate_size"), 64),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "top_k", "n_group",
                     "topk_group"), 1),
    **dict.fromkeys(("qk_nope_head_dim", "qk_rope_head_dim", "rotary_dim"), 4),  # qk_head_dim: their sum, 8
    **dict.fromkeys(("kv_lora_rank", "q_lora_rank", "index_topk"), 16),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "max_target_positions", "max_seq_len",
                     "max_2d_position_embeddings", "max_sequence_length"), 64),
    "vocab_size": 99, "max_source_positions": 16, "image_size": 32, "pretrain_image_size": 32, "patch_size": 8,
    "num_conv_pos_embeddings": 8, "num_conv_pos_embedding_groups": 4, "max_length": 32, "sliding_window": 4,
    "window_size": 4, "num_queries": 8, "mamba_n_heads": 8, "codebook_size": 32, "num_codevectors_per_group": 16,
}
#: integer fields by suffix, when no exact name matched: the widths a model has under other names
_SUFFIXES = (("intermediate_size", 64), ("_ffn_dim", 64), ("_hidden_size", _WIDTH), ("_embed_dim", _WIDTH),
             ("_channels", _WIDTH), ("_hidden_dim", _WIDTH), ("_head_dim", 8), ("_num_layers", 2))
#: integer-list fields: lengths kept, entries shrunk
_LIST_ONES = ("depths", "num_layers", "stage_num_blocks", "num_block_repeats", "block_repeats", "layers")
_LIST_WIDTHS = ("hidden_sizes", "embed_dim_per_stage", "neck_hidden_sizes", "embed_dim", "embed_dims", "conv_dim",
                "tdnn_dim", "backbone_channel_list", "stage_out_channels", "stage_mid_channels", "stage_in_channels",
                "encoder_in_channels", "intermediate_feature_dims", "embedding_dimension")
_LIST_HEADS = ("num_heads", "num_attention_heads", "num_attention_heads_per_layer")
_TOKEN_SUFFIXES = ("_token_id", "_token_index", "_token_ids")
_NOT_SIZES = frozenset(("num_channels", "num_labels", "sampling_rate", "sample_rate", "initializer_range",
                        "rope_theta", "layer_norm_eps", "num_mel_bins"))
#: fields whose default is None (set in the model from other fields, or a default the model class does not take)
_NONE_FILL = {"vocab_size": 99, "head_dim": 8, "n_routed_experts": 4, "num_experts_per_tok": 1}
#: the handful of models the generic rules do not reach, with why (fields on top of the tiny config)
OVERRIDES: dict[str, dict[str, Any]] = {
    # the last conv's width is round_filters(1280) at the width coefficient, and hidden_dim must equal it
    "efficientnet": {"width_coefficient": 0.25, "depth_coefficient": 0.25, "hidden_dim": 320},
    # num_heads * head_dim must equal expand * hidden_size (2 * 32)
    "mamba2": {"num_heads": 8},
    # the multimodal rotary sections are the modeling code's default, not the config's: half the rotary width
    **dict.fromkeys(("qwen2_vl_text", "qwen2_5_vl_text", "glm4v_text", "glm_image_text", "glm_ocr_text"),
                    {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}}),
    "glm4v_moe_text": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [0, 1, 1],
                                           "partial_rotary_factor": 0.5}},
}
_MODALITIES = ("input_ids", "pixel_values", "input_values", "input_features", "pixel_values_videos")
_KINDS = {"input_ids": "ids", "pixel_values": "image", "input_values": "audio", "input_features": "features"}


@dataclass(frozen=True)
class AutoArchitecture:
    """A transformers base model class, its config class, and the kind of input it takes."""

    name: str  # the model type (transformers' CONFIG_MAPPING key)
    family: str  # text-encoder / text-decoder / text-seq2seq / vision / audio / speech
    config: str
    model: str
    inputs: str  # ids / seq2seq / image / audio / features


def _shrunk_int(name: str, value: int, layers: int | None) -> int | None:
    if name.endswith(_TOKEN_SUFFIXES):
        return None if value < 99 else 91 + value % 8  # inside the tiny vocabulary, above the inputs' ids
    if name in _NOT_SIZES:
        return None
    tiny = _INTS.get(name)
    if tiny is None:
        tiny = next((t for suffix, t in _SUFFIXES if name.endswith(suffix) and value > 64), None)
    if tiny is None and layers and name in ("first_k_dense_replace", "max_window_layers"):
        return min(value, 1)
    return tiny if tiny is not None and value > tiny else None


def _shrunk_list(name: str, value: list, layers: int | None) -> list | None:
    if not value or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        if layers and len(value) == layers and len(value) > 2:  # one entry per layer (layer_types, ...)
            return value[:2]
        return None
    if name in _LIST_ONES:
        return [1] * len(value)
    if name in _LIST_WIDTHS:  # proportional, the narrowest to 16: a stage's width relative to the others kept
        scale = min(1.0, 16 / max(1, min(value)))  # then multiples of 8, to stay divisible by the heads
        return [max(16, round(x * scale / 8) * 8) if x > 16 else x for x in value]
    if name in _LIST_HEADS:
        return [min(x, 2) for x in value]
    if name == "image_size":
        return [32] * len(value)
    if layers and len(value) == layers and len(value) > 2:
        return value[:2]
    return None


def tiny_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """The fields of a config (its ``to_dict()``) that the generic rules shrink, with their tiny values; sub-configs
    (dicts with a ``model_type``) shrunk the same way, whole."""
    counts = ("num_hidden_layers", "num_layers", "n_layer", "n_layers")
    layers = None if isinstance(fields.get("depths"), list) else next(
        (fields[k] for k in counts if isinstance(fields.get(k), int)), None)
    out: dict[str, Any] = {name: tiny for name, tiny in _NONE_FILL.items() if name in fields and fields[name] is None}
    for name, value in fields.items():
        if name.startswith("_") or isinstance(value, bool) or value is None:
            continue
        if isinstance(value, int):
            new = _shrunk_int(name, value, layers)
        elif isinstance(value, (list, tuple)):
            new = _shrunk_list(name, list(value), layers)
        elif isinstance(value, dict) and "model_type" in value:
            new = {**value, **tiny_fields(value)}
        elif isinstance(value, dict) and isinstance(value.get("mrope_section"), list):
            new = {**value, "mrope_section": _mrope(value["mrope_section"], value.get("partial_rotary_factor", 1.0))}
        else:
            new = None
        if new is not None:
            out[name] = new
    if "use_cache" in fields:
        out["use_cache"] = False
    _keep_relations(fields, out)
    return out


def _keep_relations(fields: dict[str, Any], out: dict[str, Any]) -> None:
    """Relations between fields the defaults hold, kept: multi-head attention stays multi-head (a None key/value
    head count too) and multi-query multi-query; MLA's head widths add up; a hierarchical model (a ``depths`` list)
    keeps its derived layer count and last width, starts at 16 channels, takes 64-pixel images and windows of 2;
    a width equal to a stage list's first entry follows it."""
    heads, kv = fields.get("num_attention_heads"), fields.get("num_key_value_heads")
    if "num_key_value_heads" in fields and isinstance(heads, int):
        out["num_key_value_heads"] = 1 if kv == 1 else out.get("num_attention_heads", heads) if kv in (heads, None) \
            else out.get("num_key_value_heads", kv)
    if "qk_head_dim" in fields and "qk_nope_head_dim" in out:
        out["qk_head_dim"] = out["qk_nope_head_dim"] + out.get("qk_rope_head_dim", 0)
    if fields.get("head_dim") is not None and fields.get("head_dim") == fields.get("qk_rope_head_dim"):
        out["head_dim"] = out.get("qk_rope_head_dim", fields["head_dim"])  # the rotary width, under another name
    if isinstance(fields.get("depths"), list):  # stages: the layer count and last width follow from them
        out.pop("num_layers", None)
        out.pop("hidden_size", None)
        if isinstance(fields.get("embed_dim"), int):
            out["embed_dim"] = 16  # doubled per stage
        if "image_size" in fields:  # a hierarchical model halves its resolution per stage: 16, 8, 4, 2 (windows of 2)
            out["image_size"] = 64 if isinstance(fields["image_size"], int) else [64, 64]
            if isinstance(fields.get("window_size"), int) and fields["window_size"] > 2:
                out["window_size"] = 2
    for name in _LIST_WIDTHS:
        if isinstance(out.get(name), list) and fields[name]:
            for scalar in ("hidden_size", "embed_dim", "d_model"):
                if fields.get(scalar) == fields[name][0]:
                    out[scalar] = out[name][0]


def _mrope(sections: list[int], partial: float) -> list[int]:
    """Multimodal rotary sections shrunk to the tiny head (their sum: half the rotary part of head_dim 8)."""
    total, target = sum(sections), int(8 * partial) // 2
    new = [s * target // total for s in sections]
    new[-1] += target - sum(new)
    return new


def tiny_config(model_type: str):
    """The config of ``model_type``: its config class's defaults, shrunk (:func:`tiny_fields`, then
    :data:`OVERRIDES`)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    fields = {**tiny_fields(config_class().to_dict()), **OVERRIDES.get(model_type, {})}
    try:
        config = config_class(**fields)
    except Exception:  # noqa: BLE001 - a constructor that refuses a field as an argument: set it afterwards
        config = config_class()
        for name, value in fields.items():
            if not isinstance(value, dict):
                setattr(config, name, value)
    return config


def _model_class(class_name: str):
    import transformers

    return getattr(transformers, class_name)


def _signature(model_class) -> tuple[list[str], list[str]]:
    """The forward's parameters, and those without a default (self, ``*args`` and ``**kwargs`` left out)."""
    params = [p for p in inspect.signature(model_class.forward).parameters.values()
              if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return [p.name for p in params], [p.name for p in params if p.default is inspect.Parameter.empty]


def _family(model_type: str, kind: str, params: list[str]) -> tuple[str, str]:
    from transformers.models.auto import modeling_auto as m

    if kind == "image":
        return "vision", kind
    if kind == "audio":
        return "audio", kind
    if kind == "features":
        return "speech", kind
    if "decoder_input_ids" in params:
        return "text-seq2seq", "seq2seq"
    causal = model_type in m.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type not in m.MODEL_FOR_MASKED_LM_MAPPING_NAMES
    return ("text-decoder" if causal else "text-encoder"), kind


def describe(model_type: str) -> AutoArchitecture | str:
    """The :class:`AutoArchitecture` of ``model_type``, or a one-line why it cannot be driven."""
    from transformers.models.auto import modeling_auto as m
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    class_name = m.MODEL_MAPPING_NAMES.get(model_type)
    if class_name is None:
        return "no base model class"
    class_name = class_name if isinstance(class_name, str) else class_name[0]
    try:
        model_class = _model_class(class_name)
        params, required = _signature(model_class)
    except Exception as exc:  # noqa: BLE001 - a module that needs a missing package, or no longer exists
        return f"import error: {_first_line(exc)}"
    main = getattr(model_class, "main_input_name", "input_ids")
    if not isinstance(main, str) or main not in _KINDS:
        return f"input {main!r} is not token ids, an image or audio"
    others = [p for p in required if p != main]
    if others:
        return f"needs {main} and {', '.join(others)}"
    if main not in params:
        return f"forward takes no {main} (takes {', '.join(params[:3])})"
    second = next((p for p in _MODALITIES if p != main and p in params), None)
    if second is None and main != "input_ids" and "decoder_input_ids" in params:
        second = "decoder_input_ids"
    if second is not None:
        return f"needs both {main} and {second}"
    family, kind = _family(model_type, _KINDS[main], params)
    return AutoArchitecture(model_type, family, CONFIG_MAPPING_NAMES.get(model_type, "?"), class_name, kind)


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return (lines[0] if lines else type(exc).__name__)[:160]


def enumerate_architectures() -> tuple[dict[str, AutoArchitecture], dict[str, str]]:
    """``(architectures, skipped)``: every model type of transformers' base-model mapping that takes one kind of
    input, by name, and the others with a one-line why."""
    import warnings

    from transformers.models.auto import modeling_auto as m

    found: dict[str, AutoArchitecture] = {}
    skipped: dict[str, str] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for model_type in m.MODEL_MAPPING_NAMES:
            entry = describe(model_type)
            if isinstance(entry, str):
                skipped[model_type] = entry
            else:
                found[model_type] = entry
    return found, skipped


def _ids(config, seed: int, batch: int, length: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    vocab = getattr(config, "vocab_size", None) or getattr(getattr(config, "text_config", None), "vocab_size", 99)
    return torch.randint(3, max(4, min(int(vocab), 91)), (batch, length), generator=g)


def _candidates(arch: AutoArchitecture, config, params: list[str]) -> list[Callable[[int], dict]]:
    """The input makers to try, in order (seed -> {forward parameter: tensor}); the first that runs is kept."""
    batch = 2

    def randn(*shape):
        return lambda seed: {_MAIN[arch.inputs]: torch.randn(*shape, generator=torch.Generator().manual_seed(seed))}

    if arch.inputs in ("ids", "seq2seq"):
        def text(seed):
            ids = _ids(config, seed, batch)
            out = {"input_ids": ids}
            if len(params) > 1 and params[1] == "attention_mask":
                out["attention_mask"] = torch.ones_like(ids)
            if arch.inputs == "seq2seq":
                out["attention_mask"] = torch.ones_like(ids)
                out["decoder_input_ids"] = _ids(config, seed + 1000, batch, 6)
            return out
        return [text]
    if arch.inputs == "image":
        channels = getattr(config, "num_channels", 3) or 3
        size = getattr(config, "image_size", 32)
        size = size[0] if isinstance(size, (list, tuple)) else size
        sizes = dict.fromkeys([int(size) if isinstance(size, int) else 32, 32, 64, 128, 224])
        frames = getattr(config, "num_frames", None)  # a video model: (batch, frames, channels, height, width)
        lead = (batch, frames) if isinstance(frames, int) else (batch,)
        return [randn(*lead, channels, s, s) for s in sizes] + [randn(batch, 2, channels, s, s) for s in (32, 64)]
    features = _feature_candidates(config, randn, batch)
    if arch.inputs == "audio":  # a waveform, mono or with a channel axis; then spectrogram-like features
        return [randn(batch, n) for n in (3840, 16000)] + [randn(batch, 1, n) for n in (3840, 24000)] + features
    return features


#: config fields that give the width of audio features (the mel bins, a feature size)
_FEATURE_FIELDS = ("num_mel_bins", "feature_size", "input_feat_per_channel", "feature_projection_input_dim",
                   "input_dim", "n_mels")


def _feature_candidates(config, randn, batch: int) -> list:
    """(batch, bins, frames) and (batch, frames, bins) for each width the config names, then 80 and 128 bins."""
    widths = [getattr(config, f) for f in _FEATURE_FIELDS if isinstance(getattr(config, f, None), int)]
    frames = 2 * config.max_source_positions if isinstance(getattr(config, "max_source_positions", None), int) \
        else getattr(config, "max_length", None) if isinstance(getattr(config, "max_length", None), int) else 32
    out = []
    for width in dict.fromkeys(widths + [80, 128]):
        out += [randn(batch, width, frames), randn(batch, frames, width)]
    return out


_MAIN = {"ids": "input_ids", "seq2seq": "input_ids", "image": "pixel_values", "audio": "input_values",
         "features": "input_features"}


class KeywordCall(torch.nn.Module):
    """A model called with keywords, from positional inputs (its inputs are not its forward's first parameters)."""

    def __init__(self, model: torch.nn.Module, names: tuple[str, ...]):
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *inputs):
        return self.model(**dict(zip(self.names, inputs)))


def _callable(model: torch.nn.Module, names: tuple[str, ...], params: list[str]) -> torch.nn.Module:
    return model if list(names) == params[:len(names)] else KeywordCall(model, names)


def _first_run(model: torch.nn.Module, makers: list, params: list[str]) -> tuple[Callable, torch.nn.Module]:
    """The first input maker the model runs on, and the model as it is called with it."""
    from quantlens.zoo.coverage import float_leaves

    errors: list[BaseException] = []
    for make in makers:
        inputs = make(0)
        names = tuple(inputs)
        wrapped = _callable(model, names, params)
        try:
            with torch.no_grad():
                out = wrapped(*inputs.values())
        except Exception as exc:  # noqa: BLE001 - the next input shape may fit
            errors.append(exc)
            continue
        leaves = float_leaves(out)
        if not leaves:
            raise QuantLensError("the float forward returns no floating-point tensor")
        if not all(torch.isfinite(t).all() for t in leaves):
            raise QuantLensError("the float forward returns NaN or inf")
        return make, wrapped
    first = errors[0]  # the error of the input the config describes best
    raise QuantLensError(f"float forward failed: {type(first).__name__}: {_first_line(first)}")


def build_auto(name: str, seed: int = 0, n_batches: int = 4) -> tuple[torch.nn.Module, tuple, list, tuple]:
    """``(model, example, calibration batches, held-out batch)`` for the model type ``name`` (a key of
    :func:`enumerate_architectures`' first dict); raises :class:`QuantLensError` with a one-line why when it cannot
    be built or its float forward fails."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        arch = describe(name)
        if isinstance(arch, str):
            raise QuantLensError(f"architecture {name!r} cannot be built: {arch}")
        try:
            config = tiny_config(name)
            torch.manual_seed(seed)
            model = _model_class(arch.model)(config).float().eval()
        except Exception as exc:  # noqa: BLE001 - whatever the constructor raises, one line of why
            raise QuantLensError(f"build failed: {type(exc).__name__}: {_first_line(exc)}") from None
        params = _signature(type(model))[0]
        try:
            make, model = _first_run(model, _candidates(arch, config, params), params)
        except QuantLensError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise QuantLensError(f"float forward failed: {type(exc).__name__}: {_first_line(exc)}") from None
        batches = [tuple(make(s).values()) for s in range(seed + 1, seed + n_batches + 1)]
        settle_batch_norms(model, batches)
        model.eval()
    return model, tuple(make(seed).values()), batches, tuple(make(seed + 100).values())
