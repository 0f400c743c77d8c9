""":class:`TorchModelAccess`: the :class:`~.model_access.ModelAccess` of float and prepared torch models."""

from __future__ import annotations

import importlib
from contextlib import contextmanager, nullcontext
from typing import Any, Iterator

import torch
from torch import nn

from quantlens.errors import QuantLensError
from quantlens.profiler.ablation.torch_cache import CachedAblations, TorchAblationCache
from quantlens.profiler.index_ops import IndexOpMode
from quantlens.profiler.model_access import (
    AnalysisType,
    ConsistencyInfo,
    ModelAccess,
    Quantizer,
    SameInputSource,
    TraceSink,
)
from quantlens.profiler.torch_probe import FloatProbe, Probe, RuntimeProbe
from quantlens.quantization.fake_quantize import FakeQuantize, frozen_weights
from quantlens.quantization.qat_modules import frozen_folds
from quantlens.quantization.queries import without_integer_rules
from quantlens.quantization.runtime import emulator_for
from quantlens.quantization.state import is_prepared, use_runtime
from quantlens.sites.record import call_model, inputs_to, model_device
from quantlens.sites.tracer import OpSiteTracer

__all__ = ["TorchModelAccess"]

def _pre_export_api():
    # Imported on use: only the 'pre_export' analysis type needs it. (quantlens.quantization.pre_export is
    # also the name of a function in the package namespace, so import the module by its path.)
    return importlib.import_module("quantlens.quantization.pre_export")


class TorchModelAccess(ModelAccess):
    """A float ``nn.Module`` or a model returned by ``prepare`` (calibration, QAT or pre_export stage).

    Every profiler forward runs in eval mode, without gradients, with activation observers paused; the
    model's modes and flags are restored afterwards, so profiling never changes calibration statistics or
    BatchNorm running statistics.
    """

    def __init__(self, model: nn.Module, label: str):
        self.model = model
        self.label = label
        self.prepared = is_prepared(model)
        self.state = model._quantlens_state if self.prepared else None
        self._frozen_modules: list[nn.Module] | None = None  # set while :meth:`ablation` runs
        #: whether the forwards compute the consistency level's integer rules (levels 1-4) as the prepared model's
        #: own forward does; False: float + fake quant, what export traces (the ``export`` pair's baseline, set by
        #: :func:`~.pair_checks.check_deployed_pair`, so that it is compared with the qat IR it is meant to equal)
        self.integer_rules = True

    def describe(self) -> str:
        name = type(self.model).__name__
        if not self.prepared:
            return f"{name} (float model)"
        st = self.state
        return f"{name} (prepared; fake quant state: {st.fake_quant_state.value}; setter: {st.setter_name})"

    @property
    def quantized(self) -> bool:
        return self.prepared

    @property
    def device(self) -> torch.device:
        """Where the model runs: the device of its first parameter or buffer (the CPU when it has none)."""
        return model_device(self.model)

    def on_device(self, example: Any) -> Any:
        """``example`` with its tensors moved to the model's device (the bad case is held on the CPU)."""
        return inputs_to(example, self.device)

    def group_internal_sites(self) -> frozenset[str]:
        if not self.prepared:
            return frozenset()
        sites = self.state.record.sites
        consumers: dict[str, set[str]] = {}
        for site in sites.values():
            for inp in site.inputs:
                if inp.producer is not None:
                    consumers.setdefault(inp.producer, set()).add(site.name)
        out = set()
        for group in self.state.groups:
            members = set(group.members)
            out.update(m for m in group.members[:-1] if consumers.get(m, set()) <= members)
        return frozenset(out)

    def host_sites(self) -> frozenset[str]:
        if not self.prepared:
            return frozenset()
        return frozenset(name for name, plan in self.state.plans.items() if getattr(plan, "host", False))

    @property
    def fake_quant_state(self) -> str | None:
        return self.state.fake_quant_state.value if self.prepared else None

    def consistency(self) -> ConsistencyInfo | None:
        """A prepared model's level (``QuantState.consistency``, recorded by prepare); None for a float model."""
        if not self.prepared:
            return None
        return ConsistencyInfo.from_config(getattr(self.state, "consistency", None),
                                           f"{self.label} model (prepared model state)")

    def computed_rules(self) -> str | None:
        """What the forwards compute of the model's consistency level (see :meth:`ModelAccess.computed_rules`)."""
        if not self.prepared:
            return None
        config = getattr(self.state, "consistency", None)
        if config is None or not config.emulate_integer_rules:
            return None
        emulator = emulator_for(self.state) if self.integer_rules else None
        return "none" if emulator is None else "exact" if emulator.exact else "rounded"

    def _probe_runtime(self, probe: Probe) -> RuntimeProbe:
        """The prepared model's runtime reporting every site to ``probe``; without the integer rules when
        :attr:`integer_rules` is off (as :func:`~quantlens.quantization.without_integer_rules`)."""
        runtime = RuntimeProbe(self.state, probe)
        if not self.integer_rules:
            runtime.emulator = None  # float + fake quant, as export traces the forward
        return runtime

    # -- running ------------------------------------------------------------------------------------------
    @contextmanager
    def _profiling(self) -> Iterator[None]:
        # This runs once per sensitivity ablation: one traversal, and only the modules that change are touched,
        # through object.__setattr__ (nn.Module.__setattr__'s checks cost more than a small op; plain flags).
        modules = self._frozen_modules or list(self.model.modules())
        training = [m for m in modules if m.training]
        paused = [m for m in modules if isinstance(m, FakeQuantize) and not m.is_weight and m.observe_enabled]
        for m in training:  # self.model.eval()
            object.__setattr__(m, "training", False)
        for m in paused:
            object.__setattr__(m, "observe_enabled", False)
        # each conv/linear + BN folded once for this call's forwards (the traced one and its same-input re-runs, which
        # follow each op: the last two folds kept), its weight's scale computed once; an ablation's window has
        # folded them already
        folds = frozen_folds(modules, keep=2) if self.prepared and self._frozen_modules is None else nullcontext()
        try:
            with torch.no_grad(), frozen_weights(), folds:  # the profiler changes no weight: each scale computed once
                yield
        finally:
            for m in paused:
                object.__setattr__(m, "observe_enabled", True)
            for m in training:
                object.__setattr__(m, "training", True)

    def run(self, example: Any, sink: TraceSink | None = None, same_input: SameInputSource | None = None,
            indices: dict[str, list[torch.Tensor]] | None = None, override: Any = None) -> Any:
        example = self.on_device(example)
        with self._profiling():
            if sink is None and indices is None and override is None:
                if self.integer_rules or not self.prepared:
                    return call_model(self.model, example)
                with without_integer_rules(self.model):
                    return call_model(self.model, example)
            probe = Probe(sink, same_input if self.prepared else None, indices, override)
            wants_index_ops = getattr(sink, "wants_index_ops", False)
            # an empty replacement table changes nothing: no mode (every torch call would pass through it)
            mode = IndexOpMode(indices, probe.index_op) if indices or wants_index_ops else nullcontext()
            if not self.prepared:
                with mode, OpSiteTracer(self.model, FloatProbe(probe)):
                    return call_model(self.model, example)
            # The prepared model's forward picks up this runtime instead of a plain one (see prepare).
            with mode, use_runtime(self.model, self._probe_runtime(probe)):
                return call_model(self.model, example)

    # -- ablation ------------------------------------------------------------------------------------------
    def _require_prepared(self, what: str) -> None:
        if not self.prepared:
            raise QuantLensError(
                f"{what} needs the analysis model to be a prepared model (quantlens.quantization.prepare), but "
                f"{type(self.model).__name__} has no fake quants. Pass the calibration/QAT model as analysis_model."
            )

    def _units(self, analysis_type: AnalysisType) -> dict[Quantizer, list]:
        """Each quantizer and what switches it: FakeQuantize modules, or the site name of a lookup table."""
        self._require_prepared("sensitivity()")
        st = self.state
        modules = dict(self.model.named_modules())
        units: dict[Quantizer, list] = {}
        if analysis_type is AnalysisType.PRE_EXPORT:
            tables = set(_pre_export_api().lut_sites(self.model))
            for plan in st.plans.values():
                if plan.name in tables:
                    units[Quantizer(plan.name, "lut", plan.op_type, plan.output_dtype)] = [plan.name]
            return units
        # a fused group's output quantizer is the group's: named by its members' op types, as compare_per_layer
        # names the group's row ("conv2d+batch_norm"), never by its last member's type alone
        group_types = {g.last: "+".join(st.record.sites[m].op_type for m in g.members) for g in st.groups}
        for plan in st.plans.values():
            site = st.record.sites[plan.name]
            acts = [st.fq[k] for k in plan.input_fq.values()] + ([st.fq[plan.output_fq]] if plan.output_fq else [])
            if plan.override is not None and plan.override in st.overrides:
                # fake quants inside a site's override (e.g. sdpa's scores/probabilities) are activations too
                acts += [m for m in st.overrides[plan.override].modules() if isinstance(m, FakeQuantize)]
            if acts:
                units[Quantizer(plan.name, "activation", group_types.get(plan.name, plan.op_type),
                                acts[-1].dtype.value)] = acts
            weights = [st.fq[k] for k in plan.weight_fq.values()]
            module = modules.get(site.module_name) if site.is_module and "@" not in plan.name else None
            if isinstance(getattr(module, "weight_fake_quant", None), FakeQuantize):
                weights.append(module.weight_fake_quant)
            if weights:
                units[Quantizer(plan.name, "weight", plan.op_type, weights[0].dtype.value)] = weights
        return units

    def quantizers(self, analysis_type: AnalysisType) -> list[Quantizer]:
        return list(self._units(analysis_type))

    def _acting_sites(self, analysis_type: AnalysisType) -> dict[Quantizer, set[str]]:
        """Each quantizer and the op sites it acts at: the sites whose plan uses its fake quants (input, output,
        weight, inside the site's override, the module's weight fake quant; every call of a shared module), or
        its lookup table's site."""
        units = self._units(analysis_type)
        if analysis_type is AnalysisType.PRE_EXPORT:
            return {q: set(sites) for q, sites in units.items()}
        st = self.state
        modules = dict(self.model.named_modules())
        at: dict[int, set[str]] = {}
        for plan in st.plans.values():
            used = [st.fq[k] for k in plan.input_fq.values()] + [st.fq[k] for k in plan.weight_fq.values()]
            if plan.output_fq:
                used.append(st.fq[plan.output_fq])
            if plan.override is not None and plan.override in st.overrides:
                used += [m for m in st.overrides[plan.override].modules() if isinstance(m, FakeQuantize)]
            site = st.record.sites.get(plan.name)
            module = modules.get(site.module_name) if site is not None and site.is_module else None
            if isinstance(getattr(module, "weight_fake_quant", None), FakeQuantize):
                used.append(module.weight_fake_quant)
            for m in used:
                at.setdefault(id(m), set()).add(plan.name)
        return {q: {s for m in fqs for s in at.get(id(m), ())} | {q.op_name} for q, fqs in units.items()}

    def ablation_cache(self, analysis_type: AnalysisType, example: Any,
                       indices: dict[str, list[torch.Tensor]] | None):
        """A runner of cached ablation forwards (:mod:`.ablation`), made inside :meth:`ablation` before any
        quantizer is switched on; None where the model is not cached (a full forward per ablation)."""
        cache = self.reference_cache(example, indices)
        if cache is None:
            return None
        acting = self._acting_sites(analysis_type)
        return CachedAblations(cache, acting.__getitem__)

    def reference_cache(self, example: Any, indices: dict[str, list[torch.Tensor]] | None):
        """The cached forwards of this model in its current state (None: not supported, see
        :mod:`.ablation`)."""
        if not self.prepared or not TorchAblationCache.supported(self):
            return None
        return TorchAblationCache(self, example, indices)

    @contextmanager
    def ablation(self, analysis_type: AnalysisType):
        units = self._units(analysis_type)
        if analysis_type is AnalysisType.PRE_EXPORT:
            api = _pre_export_api()
            sites = [q.op_name for q in units]
            # A disabled table site has no override (pre_export's convention): remember which were on.
            was_on = [name for name in sites if self.state.plans[name].override is not None]
            api.set_lut_enabled(self.model, sites, False)

            def enable_lut(q: Quantizer, on: bool = True) -> None:
                api.set_lut_enabled(self.model, units[q], on)

            try:
                yield enable_lut
            finally:
                api.set_lut_enabled(self.model, sites, False)
                api.set_lut_enabled(self.model, was_on, True)
            return
        modules = list(self.model.modules())
        all_fq = [m for m in modules if isinstance(m, FakeQuantize)]
        saved = [(m, m.fake_quant_enabled, m.observe_enabled) for m in all_fq]
        # Observers are paused too: an ablation measures the model as it is and must not move a scale. (A weight's
        # fake quant observes in every state but FLOAT, recomputing its scale on every call even while switched
        # off: a fifth of a CNN's ablation time. The one switched on still refreshes its scale from the weight.)
        for m in all_fq:
            m.fake_quant_enabled = False
            m.observe_enabled = False

        def enable(q: Quantizer, on: bool = True) -> None:
            for m in units[q]:
                m.fake_quant_enabled = on

        # the ablation forwards run on a model nobody restructures meanwhile: one module list for all of them, and
        # (weights and BN statistics fixed: only fake quants switch) each conv/linear + BN folded once
        self._frozen_modules = modules
        try:
            with frozen_folds(modules):
                yield enable
        finally:
            self._frozen_modules = None
            for m, flag, observing in saved:
                m.fake_quant_enabled, m.observe_enabled = flag, observing
