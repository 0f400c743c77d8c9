"""QAT by distillation: a short quantization-aware training of the prepared model against the float model's own
outputs on the unlabeled calibration inputs, so no label is needed (``docs/remedies.md``).

The prepared model (its setter's qconfigs, every per-tensor activation scale learned: LSQ) is calibrated, then its
weights, biases, norms and activation scales train together on ``1 - cosine`` between each output and the float
model's, plus, for a model built of a stack of blocks (its longest ``nn.ModuleList``: a transformer's layers), the
normalised squared error of each block's output (the hidden states: the signal of every layer, not only the last).
A CONFIG's own ``train_qat(model)`` replaces that loop when given. The result goes back to the search as a float
model with the trained weights and a :class:`~.learned_ranges.FixedRangeQconfigSetter` with the learned ranges, so
``prepare`` + calibration reproduce the trained model; the search keeps it only when the held-out metric improves.

The run has a step budget and a time budget, shows a progress bar, and writes a checkpoint (safetensors, the
prepared model's state and the step) that a run with the same inputs resumes from.
"""

from __future__ import annotations

import copy
import hashlib
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from quantlens._io import atomic_write_bytes, safetensors_bytes
from quantlens.errors import QuantLensError, QuantLensWarning
from quantlens.quantization import ConsistencyStrategy, FakeQuantState, set_fake_quantize
from quantlens.search.bar import SearchBar
from quantlens.search.remedies.learned_ranges import (
    FixedRangeQconfigSetter,
    calibrated_with_learned_scales,
    cosine_loss,
    learnable_output_fqs,
    learned_ranges,
    output_tensors,
)
from quantlens.sites.record import call_model

__all__ = ["QatBudget", "qat_distill", "CHECKPOINT_FILE"]

#: the checkpoint's file name in the run's folder
CHECKPOINT_FILE = "qat_distill.safetensors"


@dataclass(frozen=True)
class QatBudget:
    """How long the distillation runs (whichever ends first) and how fast it moves."""

    steps: int = 200
    seconds: float = 300.0
    #: Adam's step for the weights, biases and norms (a pretrained model moves little)
    lr: float = 5e-5
    #: Adam's step for the learned activation scales, relative to each scale's calibrated value
    scale_lr: float = 1e-3
    #: a checkpoint every this many steps (and at the end)
    checkpoint_every: int = 25

    def __post_init__(self):
        if self.steps < 1 or not self.seconds > 0 or not self.lr > 0 or not self.scale_lr > 0:
            raise QuantLensError(f"QatBudget: steps must be >= 1 and seconds, lr, scale_lr > 0; got {self}.")


def _blocks(model: nn.Module) -> list[str]:
    """The names of the model's longest ``nn.ModuleList``'s members (a transformer's layers; none: outputs only)."""
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 1]
    if not lists:
        return []
    name, longest = max(lists, key=lambda item: len(item[1]))
    return [f"{name}.{i}" if name else str(i) for i in range(len(longest))]


class _Hidden:
    """Forward hooks that keep each named block's (first) output of the last forward."""

    def __init__(self, model: nn.Module, names: list[str]):
        self.values: dict[str, torch.Tensor] = {}
        modules = dict(model.named_modules())
        self.handles = [modules[n].register_forward_hook(self._keep(n)) for n in names if n in modules]

    def _keep(self, name: str):
        def hook(module, args, out):
            first = out[0] if isinstance(out, (tuple, list)) else out
            if isinstance(first, torch.Tensor) and first.is_floating_point():
                self.values[name] = first
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _hidden_loss(ours: dict[str, torch.Tensor], refs: dict[str, torch.Tensor]) -> torch.Tensor | float:
    total: torch.Tensor | float = 0.0
    for name, ref in refs.items():
        if name in ours and ours[name].shape == ref.shape:
            total = total + ((ours[name] - ref) ** 2).mean() / (ref ** 2).mean().clamp(min=1e-12) / len(refs)
    return total


def _key(model: nn.Module, batches: Sequence[Any], setter: Any, budget: QatBudget) -> str:
    """What the checkpoint was made from: the float weights, the calibration inputs, the setter, the budget."""
    h = hashlib.sha256(repr((budget, getattr(setter, "name", type(setter).__name__))).encode())
    for t in list(model.state_dict().values()) + [x for b in batches for x in output_tensors(b)]:
        if isinstance(t, torch.Tensor):
            h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def _load_checkpoint(path: Path | None, key: str, prepared: nn.Module) -> int:
    """The step a matching checkpoint reached (its state loaded into ``prepared``), else 0."""
    if path is None or not path.is_file():
        return 0
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        if meta.get("key") != key:
            return 0
        prepared.load_state_dict(load_file(str(path)))
        return int(meta["step"])
    except (OSError, SafetensorError, KeyError, ValueError, RuntimeError):
        return 0  # another run's or a damaged checkpoint: start afresh (it is overwritten)


def _save_checkpoint(path: Path | None, key: str, prepared: nn.Module, step: int) -> None:
    if path is None:
        return
    state = {k: v.detach().contiguous().clone() for k, v in prepared.state_dict().items()}
    atomic_write_bytes(path, safetensors_bytes(state, {"key": key, "step": str(step)}))


def _distill(prepared: nn.Module, model: nn.Module, batches: list, budget: QatBudget, start: int,
             save: Callable[[int], None], bar: SearchBar) -> int:
    """The distillation loop from step ``start``; returns the steps done."""
    blocks = _blocks(model)
    ref_hidden, ours = _Hidden(model, blocks), _Hidden(prepared, blocks)
    try:
        refs = []
        with torch.no_grad():
            for batch in batches:
                outs = output_tensors(call_model(model, batch))
                refs.append((outs, dict(ref_hidden.values)))
        fqs = [m for m in prepared.modules() if getattr(m, "learn_scale", False) and bool(m.calibrated)]
        for fq in fqs:
            fq.start_learning()
        params = [p for n, p in prepared.named_parameters() if not n.endswith("learned_scale")]
        groups = [{"params": params, "lr": budget.lr}]
        groups += [{"params": [fq.learned_scale], "lr": budget.scale_lr * float(fq.learned_scale.detach())}
                   for fq in fqs]
        for p in prepared.parameters():
            p.requires_grad_(True)
        optimizer = torch.optim.Adam(groups)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, budget.steps)
        for _ in range(start):
            schedule.step()  # a resumed run continues the schedule where it stopped
        began, step = time.monotonic(), start
        while step < budget.steps and time.monotonic() - began < budget.seconds:
            batch, (ref, hidden) = batches[step % len(batches)], refs[step % len(batches)]
            optimizer.zero_grad()
            loss = cosine_loss(output_tensors(call_model(prepared, batch)), ref) + _hidden_loss(ours.values, hidden)
            loss.backward()
            optimizer.step()
            schedule.step()
            step += 1
            bar.show(f"qat_distill step {step}/{budget.steps} loss {float(loss):.4f}", completed=step)
            if step % budget.checkpoint_every == 0:
                save(step)
        return step
    finally:
        ref_hidden.remove()
        ours.remove()


def qat_distill(model: nn.Module, example: Any, batches: Sequence[Any], setter: Any, *,
                budget: QatBudget = QatBudget(), train_qat: Callable[[nn.Module], None] | None = None,
                out_dir: str | Path | None = None, progress: bool = False) -> tuple[nn.Module, Any]:
    """``(model, setter)`` after QAT by distillation (see the module docstring): a copy of the float ``model`` with
    the trained weights, and ``setter`` with the learned int8 ranges fixed. ``train_qat(prepared)``: the CONFIG's
    own QAT, run instead of the distillation. ``out_dir``: where the checkpoint lives (a run with the same model,
    batches, setter and budget resumes from it). ``model`` is not changed."""
    batches = list(batches)
    level = ConsistencyStrategy.get_consistency_level()
    if level is None or level < 1:
        warnings.warn(f"qat_distill trains at consistency level {'off' if level is None else level}: its forward is "
                      "float math and fake quants, so the integer model will differ from what it trained by the "
                      "integer rules. Set ConsistencyStrategy.set_consistency_level(1) (or higher) before, as "
                      "`quantlens fix --qat` does, and deploy at that level.", QuantLensWarning, stacklevel=2)
    prepared = calibrated_with_learned_scales(model, example, batches, setter, "qat_distill")
    set_fake_quantize(prepared, FakeQuantState.QAT)
    path = None if out_dir is None else Path(out_dir) / CHECKPOINT_FILE
    key = _key(model, batches, setter, budget)
    with SearchBar(budget.steps, progress, label="qat") as bar:
        if train_qat is not None:
            prepared.train()
            train_qat(prepared)
        else:
            prepared.eval()  # BatchNorm statistics and dropout as in inference: the target is the float model's
            start = _load_checkpoint(path, key, prepared)
            done = _distill(prepared, model, batches, budget, start,
                            lambda step: _save_checkpoint(path, key, prepared, step), bar)
            _save_checkpoint(path, key, prepared, done)
    prepared.eval()
    set_fake_quantize(prepared, FakeQuantState.VALIDATION)
    return _trained_model(model, prepared), FixedRangeQconfigSetter(_learned_ranges(prepared), setter)


def _trained_model(model: nn.Module, prepared: nn.Module) -> nn.Module:
    """A copy of the float model holding the prepared model's trained parameters (matched by name and shape)."""
    trained = copy.deepcopy(model)
    values = dict(prepared.named_parameters())
    with torch.no_grad():
        for name, param in trained.named_parameters():
            if name in values and values[name].shape == param.shape:
                param.copy_(values[name].detach())
    return trained


def _learned_ranges(prepared: nn.Module) -> dict[str, float]:
    """Each int8 activation op site's learned output range, ``site -> absmax`` (as :func:`learn_ranges`; a scale QAT
    never started, a site no batch reached, keeps its observer)."""
    fqs = learnable_output_fqs(prepared)
    return learned_ranges({site: fq for site, fq in fqs.items() if bool(getattr(fq, "learned_initialized", False))})
