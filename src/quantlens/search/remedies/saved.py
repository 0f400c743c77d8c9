"""A remedy search's result on disk, for the command line and for re-running the flow later:
``remedies.json`` (the kept transforms, the ranges, the int16 promotions, the metric) and, when a kept transform
changed weights, ``remedied_weights.safetensors`` (the float model's new state dict). :func:`load_remedies` gives
back what ``prepare`` takes: the float model with those weights and the qconfig setter."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantlens._io import atomic_write_bytes, atomic_write_text, safetensors_bytes
from quantlens.errors import QuantLensError
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter
from quantlens.search.remedies.catalog import REMEDIES
from quantlens.search.remedies.channel_exponents import ChannelExponentQconfigSetter
from quantlens.search.remedies.learned_ranges import FixedRangeQconfigSetter
from quantlens.search.remedies.observers import RANGE_OBSERVERS, ObserverQconfigSetter
from quantlens.search.remedies.result import RemedyResult, level_now
from quantlens.search.remedies.weights import PerChannelWeightQconfigSetter

__all__ = ["RESULT_FILE", "WEIGHTS_FILE", "save_remedies", "load_remedies"]

RESULT_FILE = "remedies.json"
WEIGHTS_FILE = "remedied_weights.safetensors"
_FORMAT = 1
_SETTER_TRANSFORMS = ("per_channel_weights", "learned_ranges")  # kept remedies that change the setter only


def save_remedies(result: RemedyResult, out_dir: str | Path) -> Path:
    """Write ``result`` to ``out_dir`` (see the module docstring); returns the JSON file's path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = [t for t in result.transforms if t not in _SETTER_TRANSFORMS]
    if weights:
        state = {k: v.detach().contiguous().cpu() for k, v in result.model.state_dict().items()
                 if isinstance(v, torch.Tensor)}
        atomic_write_bytes(out / WEIGHTS_FILE, safetensors_bytes(state))
    data = {"format": _FORMAT, "transforms": list(result.transforms), "observers": dict(result.observers),
            "int16": [[p.site, p.kind] for p in result.int16], "base_value": result.base_value,
            "value": result.value, "deployed_value": result.deployed_value, "target": result.target,
            "higher_is_better": result.higher_is_better,
            "weights_file": WEIGHTS_FILE if weights else None, "fixed_ranges": _fixed_ranges(result.setter),
            "metric": result.metric, "noise": result.noise, "latency_cycles": result.latency_cycles,
            "skipped": [[s.name, s.error] for s in result.skipped], "model_digest": result.model_digest,
            "consistency_level": result.consistency_level}
    return atomic_write_text(out / RESULT_FILE, json.dumps(data, indent=1, sort_keys=True))


def load_remedies(model: nn.Module, out_dir: str | Path,
                  base_setter: Any = default_calibration_qconfig_setter) -> tuple[nn.Module, Any]:
    """``(model', setter)`` from a saved search: a copy of ``model`` with the remedied weights, and the setter
    (per-channel weights, ranges, int16 promotions on top of ``base_setter``, the one the search started from).
    Warns where the consistency level set now is not the one the search measured at (``remedies.json``'s
    ``consistency_level``): prepare at that level to deploy the integer model it measured."""
    import copy

    from quantlens.search.setter import MixedPrecisionQconfigSetter

    path = Path(out_dir) / RESULT_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise QuantLensError(f"load_remedies: cannot read {path}: {exc}. Run the search (quantlens fix) to write "
                             "it.") from None
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        raise QuantLensError(f"load_remedies: {path} is not a remedies file of format {_FORMAT}.")
    _check_fields(data, path)
    _check_model(data, path, model)
    _check_level(data, path)
    unknown = [t for t in data["transforms"] if t not in REMEDIES]
    bad_obs = [o for o in data.get("observers", {}).values() if o not in RANGE_OBSERVERS]
    if unknown or bad_obs:
        raise QuantLensError(f"load_remedies: {path} names unknown remedies {unknown + bad_obs}; known: "
                             f"{sorted(REMEDIES)}, observers {sorted(RANGE_OBSERVERS)}.")
    ranges = data.get("fixed_ranges") or {}
    if not isinstance(ranges, dict) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
            for v in ranges.values()):
        raise QuantLensError(f"load_remedies: {path}: fixed_ranges must map op sites to positive finite numbers.")
    out = copy.deepcopy(model)
    if data.get("weights_file"):
        _load_weights(out, Path(out_dir) / WEIGHTS_FILE)
    setter = base_setter
    if "per_channel_weights" in data["transforms"]:
        setter = PerChannelWeightQconfigSetter(None, setter)
    if "channel_exponents" in data["transforms"]:
        setter = ChannelExponentQconfigSetter(None, setter)
    if data.get("fixed_ranges"):
        setter = FixedRangeQconfigSetter(data["fixed_ranges"], setter)
    if data.get("observers"):
        setter = ObserverQconfigSetter(data["observers"], setter)
    if data.get("int16"):
        setter = MixedPrecisionQconfigSetter([tuple(p) for p in data["int16"]], setter)
    return out, setter


def _is_str_map(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


#: each field load_remedies reads: whether it must be present, what it must be (in words), the check
_FIELDS = {
    "transforms": (True, "a list of remedy names", lambda v: isinstance(v, list) and all(
        isinstance(t, str) for t in v)),
    "observers": (False, "an object mapping op sites to observer names", _is_str_map),
    "int16": (False, "a list of [op site, \"activation\" or \"weight\"] pairs", lambda v: v is None or (
        isinstance(v, list) and all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str)
                                    and p[1] in ("activation", "weight") for p in v))),
    "weights_file": (False, "null or a file name", lambda v: v is None or isinstance(v, str)),
    "model_digest": (False, "the float model's fingerprint (a string)", lambda v: isinstance(v, str)),
    "consistency_level": (False, "\"off\" or a level 0-4", lambda v: v == "off" or (
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 4)),
}


_JSON_KIND = {list: "a list", dict: "an object", str: "a string", int: "a number", float: "a number",
              bool: "true/false", type(None): "null"}


def _check_fields(data: dict, path: Path) -> None:
    """Refuse a hand-edited file whose fields load_remedies cannot read, naming the field and what it expects."""
    for name, (required, expected, valid) in _FIELDS.items():
        if name not in data:
            if required:
                raise QuantLensError(f"load_remedies: {path} has no field '{name}' ({expected} was expected). "
                                     "Restore the file, or run the search again (quantlens fix) to write it.")
            continue
        if not valid(data[name]):
            got = _JSON_KIND.get(type(data[name]), type(data[name]).__name__)
            raise QuantLensError(f"load_remedies: {path}: field '{name}' is {got} where {expected} was expected "
                                 f"({str(data[name])[:60]}). Restore the file, or run the search again (quantlens "
                                 "fix) to write it.")


def _check_level(data: dict, path: Path) -> None:
    """Warn where the consistency level set now is not the one the search measured at (files written before the
    level was saved have none and are not checked): the model prepared from the loaded setter is then another
    integer model than the one whose value the file holds."""
    import warnings

    from quantlens.errors import QuantLensWarning

    saved, now = data.get("consistency_level"), level_now()
    if saved is not None and saved != now:
        warnings.warn(f"load_remedies: {path} was measured at consistency level {saved}, and the level set now is "
                      f"{now}: the model prepared with its setter is not the integer model it measured. Call "
                      f"ConsistencyStrategy.set_consistency_level({None if saved == 'off' else saved}) before "
                      "prepare (a CONFIG: the same --consistency-level) to deploy what the search chose.",
                      QuantLensWarning, stacklevel=3)


def _check_model(data: dict, path: Path, model: nn.Module) -> None:
    """Refuse a model other than the one the search started from (files written before the fingerprint existed
    have none and are not checked)."""
    from quantlens.search.provenance import float_model_digest

    saved = data.get("model_digest")
    if saved and saved != float_model_digest(model):
        raise QuantLensError(f"load_remedies: {path} was written by a search on another float model (its weights, "
                             "buffers or class differ from the model given): its remedies and weights belong to "
                             "that model. Give load_remedies the float model the search ran on (float_model() of "
                             "its CONFIG), or run the search on this one (quantlens fix --out another folder).")


def _fixed_ranges(setter: Any) -> dict[str, float]:
    """The learned ranges in a setter chain (each setter's ``base_setter``), or none."""
    while setter is not None and not isinstance(setter, (tuple, list)):
        if isinstance(setter, FixedRangeQconfigSetter):
            return dict(setter.ranges)
        setter = getattr(setter, "base_setter", None)
    return {}


def _load_weights(model: nn.Module, path: Path) -> None:
    """Load the remedied state dict; a bias that bias correction added to a bias-free layer is created first."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        state = load_file(str(path))
    except (OSError, SafetensorError) as exc:
        raise QuantLensError(f"load_remedies: cannot read {path}: {exc}.") from None
    own = model.state_dict()
    for key, value in state.items():
        if key in own:
            continue
        owner, _, leaf = key.rpartition(".")
        try:
            module = model.get_submodule(owner) if owner else model
        except AttributeError:
            module = None
        if module is None or leaf != "bias" or getattr(module, "bias", 0) is not None:
            raise QuantLensError(f"load_remedies: {path} has '{key}', which the model does not; was the search "
                                 "run on another model?")
        module.bias = nn.Parameter(torch.zeros_like(value))
    missing = sorted(set(model.state_dict()) - set(state))
    if missing:
        raise QuantLensError(f"load_remedies: {path} lacks {missing[:5]}; was the search run on another model?")
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:  # shapes that differ
        raise QuantLensError(f"load_remedies: {path} does not fit the model ({exc}); was the search run on another "
                             "model?") from None
