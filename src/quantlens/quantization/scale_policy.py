"""Scale policies of the consistency strategy (level 2): power-of-two activation scales and shared scales at
add/sub/cat, installed on a prepared model.

* **Power-of-two scales** (``ConsistencyConfig.pow2_activation_scales``): :func:`install_scale_policy` flags every
  activation fake quant to round its scale up to a power of two (:func:`.scale_groups.pow2_ceil`).
* **Shared scales** (``ConsistencyConfig.shared_elementwise_scales``): the integer add/sub/cat of
  ``docs/march.md`` §10 rescales each input to the output scale. When the inputs and the output are on one grid
  that rescale is the identity. :func:`build_scale_groups` joins, for every such op site whose output is
  quantized, the fake quants its tensor inputs are on and its own output fake quant into one *scale group*
  (union-find: a residual stream chains its adds into one group); :mod:`.scale_groups` resolves a group's scale
  while the model runs.
"""

from __future__ import annotations

from quantlens.march.opset import IR_OPS, OPS
from quantlens.quantization.fake_quantize import FakeQuantize, fake_quant_sites
from quantlens.quantization.observers import FixedScaleObserver
from quantlens.quantization.plan import OutputMode
from quantlens.quantization.scale_groups import ScaleGroup, is_pow2

__all__ = ["RESCALED_OPS", "build_scale_groups", "install_scale_policy"]


#: op types whose integer rule rescales every input to the output scale (docs/march.md §10; stack is a cat): those
#: lowering to an IR op the op set marks ``rescales_inputs``
RESCALED_OPS = frozenset(d.name for d in OPS.values() if any(IR_OPS[i].rescales_inputs for i in d.ir if i in IR_OPS))

# -- group construction -------------------------------------------------------------------------------------------

def _grid_of(state, name: str | None) -> tuple[str, str]:
    """The grid the output of op site ``name`` is on: ``("fq", key)``, or ``(kind, description)`` with kind
    ``weight`` / ``int32`` / ``float`` when it is on no shareable activation grid. Follows INHERIT passthrough
    sites back to their first input and FUSED members forward to their group's tail."""
    seen: set[str] = set()
    while name is not None and name not in seen:
        seen.add(name)
        plan = state.plans.get(name)
        if plan is None:
            return "float", f"op site '{name}' (no plan)"
        if plan.output is OutputMode.QUANTIZED and plan.output_fq:
            return "fq", plan.output_fq
        if plan.output is OutputMode.INHERIT:
            site = state.record.sites.get(name)
            name = site.inputs[0].producer if site is not None and site.inputs else None
            if name is None:
                return "float", f"a float model input (through op site '{plan.name}')"
            continue
        if plan.output is OutputMode.FUSED and plan.fused_into:
            name = plan.fused_into
            continue
        if plan.output is OutputMode.WEIGHT:
            return "weight", f"the weight table of op site '{name}'"
        if plan.output is OutputMode.HIGH_PRECISION:
            return "int32", f"the int32 output of op site '{name}'"
        return "float", f"the float output of op site '{name}'"
    return "float", "a float model input"


def _output_key(state, plan) -> str | None:
    """The fake quant of an add/sub/cat site's output: its own, or its fused group tail's (add + relu)."""
    if plan.output is OutputMode.QUANTIZED:
        return plan.output_fq
    if plan.output is OutputMode.FUSED and plan.fused_into:
        tail = state.plans.get(plan.fused_into)
        if tail is not None and tail.output is OutputMode.QUANTIZED:
            return tail.output_fq
    return None


class _UnionFind:
    """Disjoint sets of fake quant keys, with path compression; ``order`` lists the keys as first seen."""

    def __init__(self) -> None:
        self.parent: dict[str, str] = {}
        self.order: list[str] = []

    def find(self, key: str) -> str:
        parent = self.parent
        if key not in parent:
            parent[key] = key
            self.order.append(key)
        root = key
        while parent[root] != root:
            root = parent[root]
        while parent[key] != root:  # path compression
            parent[key], key = root, parent[key]
        return root

    def join(self, keys: list[str]) -> None:
        """Put ``keys`` in one set (the first key is found first: it fixes the order of new keys)."""
        for key in keys[1:]:
            root = self.find(keys[0])
            self.parent[self.find(key)] = root
        self.find(keys[0])


def _input_grid(state, plan, inp) -> tuple[str, str]:
    """The grid input ``inp`` of op site ``plan`` is on: its own input fake quant's, else its producer's."""
    if inp.position in plan.input_fq:
        return "fq", plan.input_fq[inp.position]
    return _grid_of(state, inp.producer) if inp.producer else ("float", "a float tensor")


def _site_members(state, plan, out_key: str) -> tuple[list[str], list[str]]:
    """The fake quant keys an add/sub/cat site joins (its inputs' grids, then its output's), without repeats, and
    one problem per input on no shareable activation grid."""
    site = state.record.sites.get(plan.name)
    keys, problems = [], []
    for inp in site.inputs if site is not None else ():
        kind, what = _input_grid(state, plan, inp)
        if kind == "fq" and what in state.fq and state.fq[what].channel_exponents:
            continue  # codes in channel-exponent form keep their own scales; the rule rescales them (§3.1)
        if kind == "fq" and what in state.fq:
            keys.append(what)
        else:
            problems.append(f"input {inp.position} of '{plan.name}' is {what} ({kind})")
    keys.append(out_key)
    return list(dict.fromkeys(keys)), problems


def _join_rescaled_sites(state, sets: _UnionFind) -> list[tuple[str, list[str], list[str]]]:
    """Join the keys of every add/sub/cat site whose output is quantized; ``(site, member keys, problems)``."""
    site_keys: list[tuple[str, list[str], list[str]]] = []
    for plan in state.plans.values():
        if plan.op_type not in RESCALED_OPS:
            continue
        out_key = _output_key(state, plan)
        if out_key is None or out_key not in state.fq:
            continue  # the output is not quantized: no integer rescale at this site
        if state.fq[out_key].channel_exponents:
            continue  # a sum written in channel-exponent form (§3.1) has a scale per channel: no shared one
        keys, problems = _site_members(state, plan, out_key)
        sets.join(keys)
        site_keys.append((plan.name, keys, problems))
    return site_keys


def _groups_of(sets: _UnionFind, site_keys: list[tuple[str, list[str], list[str]]]) -> list[ScaleGroup]:
    """One group per set, numbered in the order its first key was seen, with its sites and their problems."""
    by_root: dict[str, ScaleGroup] = {}
    for key in sets.order:
        root = sets.find(key)
        group = by_root.setdefault(root, ScaleGroup(len(by_root), [], []))
        group.members.append(key)
    for name, keys, problems in site_keys:
        group = by_root[sets.find(keys[0])]
        group.sites.append(name)
        group.reasons.extend(problems)
    return sorted(by_root.values(), key=lambda g: g.index)


def _check_shareable(state, group: ScaleGroup) -> None:
    """Add the reasons the group's members cannot share one scale (mixed dtypes, a weight or per-channel fake
    quant, a fixed scale) and set ``group.shared``."""
    fqs = [state.fq[k] for k in group.members]
    dtypes = sorted({fq.dtype.value for fq in fqs})
    if len(dtypes) > 1:
        group.reasons.append(f"it mixes {' and '.join(dtypes)}")
    for key, fq in zip(group.members, fqs):
        if fq.is_weight or fq.ch_axis is not None:
            group.reasons.append(f"'{key}' is a weight (per-channel) fake quant")
        elif isinstance(fq.observer, FixedScaleObserver):
            group.reasons.append(f"'{key}' has a fixed scale ({fq.observer.scale})")
    group.reasons = list(dict.fromkeys(group.reasons))
    group.shared = not group.reasons


def build_scale_groups(state) -> tuple[list[ScaleGroup], list[str]]:
    """The scale groups of a prepared model's state (before fake quants are flagged) and one warning per group
    that cannot share a scale."""
    sets = _UnionFind()
    groups = _groups_of(sets, _join_rescaled_sites(state, sets))
    warnings: list[str] = []
    for group in groups:
        _check_shareable(state, group)
        if not group.shared:
            warnings.append(
                f"shared elementwise scales: scale group {group.index} (op sites {', '.join(group.sites)}; fake quants "
                f"{', '.join(group.members)}) is not shared because " + "; ".join(group.reasons) + ". Its members "
                "keep their own scales, so the integer add/sub/cat rescales its inputs there."
            )
    return groups, warnings


def install_scale_policy(prepared) -> None:
    """Apply the prepared model's ``state.consistency`` switches: flag the activation fake quants for
    power-of-two scales and build the scale groups (``state.scale_groups``). Warnings go to ``state.warnings``."""
    state = prepared._quantlens_state
    config = state.consistency
    state.scale_groups = []
    if config.pow2_activation_scales:
        labels = fake_quant_sites(prepared)
        for path, fq in prepared.named_modules():
            if not isinstance(fq, FakeQuantize) or fq.is_weight or fq.ch_axis is not None:
                continue
            if isinstance(fq.observer, FixedScaleObserver):
                if not is_pow2(fq.observer.scale):
                    site, role, key = labels.get(id(fq), (path, "fake quant", None))
                    state.warnings.append(
                        f"power-of-two activation scales: op site '{site}' ({role}) has the fixed scale "
                        f"{fq.observer.scale}, which is not a power of two; it is kept as given, so requantizing "
                        "to or from it is no plain shift."
                    )
                continue
            fq.pow2_scale = True
    if config.shared_elementwise_scales:
        groups, warnings = build_scale_groups(state)
        state.scale_groups = groups
        state.warnings.extend(warnings)
        for group in groups:
            if not group.shared:
                continue
            for key in group.members:
                state.fq[key].scale_group = group.index
                state.fq[key].fq_key = key
