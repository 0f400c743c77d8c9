"""Prepare's module swap: weighted modules become their QAT classes (fused with their BatchNorm where grouped),
under every name the model gives them and in the plain containers that hold them, so each stays one module."""

from __future__ import annotations

import collections

from torch import nn

from quantlens.march import QuantDType
from quantlens.quantization.fuse import FusedGroup
from quantlens.quantization.qat_modules import fused_class_for, qat_class_for
from quantlens.quantization.qconfig import QConfig, QuantSpec
from quantlens.sites.record import ModelRecord

__all__ = ["swap_modules"]


def _aliases(model: nn.Module, name: str) -> list[str]:
    """Every qualified name of the submodule ``name`` (a module registered twice, ``self.conv1 = conv`` and
    ``nn.Sequential(conv, ...)``, has two; its op sites use the first, as ``tracer.module_qualnames`` does)."""
    target = model.get_submodule(name)
    return [n for n, m in model.named_modules(remove_duplicate=False) if m is target] or [name]


def _replace_module(model: nn.Module, name: str, new: nn.Module, replaced: dict) -> None:
    """Put ``new`` in the place of the submodule ``name`` under each of its names, so it is still one module;
    ``replaced`` records it (id of the old module -> (old, new): the old one kept alive, so no later module takes
    its id) for :func:`_rebind_plain_containers`."""
    old = model.get_submodule(name)
    replaced[id(old)] = (old, new)
    for alias in _aliases(model, name):
        _set_submodule(model, alias, new)


def _rebind_plain_containers(model: nn.Module, replaced: dict) -> None:
    """The swapped modules also in the plain lists, tuples and dicts of the model's modules that hold them (a
    library's ``self.layers = [conv, norm]`` registered with ``add_module`` and called from the list: the call must
    reach the QAT module). One pass over the model after every swap."""
    if not replaced:
        return
    for module in model.modules():
        for attr, value in list(vars(module).items()):
            if attr.startswith("_") or not isinstance(value, (list, tuple, dict)):
                continue
            rebound = _replaced_in(value, replaced)
            if rebound is not value:
                object.__setattr__(module, attr, rebound)


def _replaced_in(value, replaced: dict):
    """``value`` (a list, tuple or dict, nested ones too) with each replaced module by its new one; ``value`` itself
    where it holds none (lists and dicts are changed in place, so other references see the change)."""
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, (list, tuple)):
        items = list(enumerate(value))
    else:
        pair = replaced.get(id(value)) if isinstance(value, nn.Module) else None
        return pair[1] if pair is not None and pair[0] is value else value
    changed = {key: new_item for key, item in items
               if (new_item := _replaced_in(item, replaced)) is not item}
    if not changed:
        return value
    if isinstance(value, tuple):
        return type(value)(*(changed.get(i, v) for i, v in items)) if hasattr(value, "_fields") else \
            tuple(changed.get(i, v) for i, v in items)
    for key, item in changed.items():
        value[key] = item
    return value


def swap_modules(
    model: nn.Module, record: ModelRecord, groups: list[FusedGroup], qconfigs: dict[str, QConfig]
) -> dict[str, QuantDType]:
    """Replace weighted modules by QAT classes (fused with their BatchNorm where grouped), under every name."""
    bn_of = {g.head: g.bn for g in groups if g.bn is not None}
    calls = collections.Counter(site.module_name for site in record.sites.values() if site.is_module)
    weight_dtypes: dict[str, QuantDType] = {}
    replaced: dict[int, tuple[nn.Module, nn.Module]] = {}
    for site in record.sites.values():
        if not site.is_module or "@" in site.name:
            continue
        qc = qconfigs.get(site.name)
        module = model.get_submodule(site.module_name)
        if qc is None or qc.weight is None:
            continue
        wspec = qc.weight
        if site.output_from_weight:  # embedding: one scale for the whole table (its rows are outputs)
            wspec = QuantSpec(wspec.dtype, wspec.observer, ch_axis=None)
        if site.name in bn_of:
            cls = fused_class_for(module)
            bn = model.get_submodule(bn_of[site.name])
            new = cls.from_modules(module, bn, wspec)
            _replace_module(model, bn_of[site.name], nn.Identity(), replaced)
        else:
            cls = qat_class_for(module)
            if cls is None:
                continue
            new = cls.from_float(module, wspec)
            if calls[site.module_name] > 1:  # one weight fake quant for several op sites (ALBERT's shared layer):
                new.folds_input_exponents = False  # it cannot fold one site's channel exponents and not another's
        _replace_module(model, site.module_name, new, replaced)
        weight_dtypes[site.name] = wspec.dtype
    _rebind_plain_containers(model, replaced)
    return weight_dtypes


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)
