"""ONNX converters: data movement (reshape, permute, cast, cat, split, slicing, indexing, gather, expand, pad,
flip, pixel shuffle) and writes of slices into a tensor (select_scatter, slice_scatter)."""

from __future__ import annotations

from quantlens.compiler.ir import Node
from quantlens.compiler.onnx.builder import Builder, onnx_dtype
from quantlens.compiler.onnx.registry import onnx_converter


@onnx_converter("reshape")
def _reshape(b: Builder, node: Node) -> None:
    shape = [int(d) for d in node.attrs["shape"]]
    if shape.count(-1) > 1:
        raise b.error(node, f"target shape {shape} has more than one dynamic dimension",
                      "Export without dynamic_batch, or reshape so that only the batch dimension is dynamic.")
    b.add("Reshape", [b.value(node.inputs[0]), b.ints(shape, f"{node.outputs[0]}/shape")], node.outputs[0],
          allowzero=int(0 in shape))


@onnx_converter("permute")
def _permute(b: Builder, node: Node) -> None:
    b.add("Transpose", [b.value(node.inputs[0])], node.outputs[0], perm=[int(d) for d in node.attrs["dims"]])


@onnx_converter("cast")
def _cast(b: Builder, node: Node) -> None:
    b.add("Cast", [b.value(node.inputs[0])], node.outputs[0], to=onnx_dtype(node.attrs["dtype"]))


@onnx_converter("cat")
def _cat(b: Builder, node: Node) -> None:
    dtype = b.out_dtype(node)
    # torch's cat skips an empty 1-D tensor (an empty cache before its first step); ONNX Concat needs equal ranks
    inputs = [i for i in node.inputs if b.shape(i) != (0,)] or node.inputs[:1]
    b.add("Concat", [b.cast(b.value(i), dtype) for i in inputs], node.outputs[0], axis=int(node.attrs["dim"]))


@onnx_converter("split")
def _split(b: Builder, node: Node) -> None:
    sizes = [int(s) for s in node.attrs["sizes"]]
    if any(s < 0 for s in sizes):
        raise b.error(node, "split along the dynamic batch dimension", "Export without dynamic_batch.")
    b.add("Split", [b.value(node.inputs[0]), b.ints(sizes, f"{node.outputs[0]}/sizes")], list(node.outputs),
          axis=int(node.attrs["dim"]))


@onnx_converter("slice")
def _slice(b: Builder, node: Node) -> None:
    a = node.attrs
    out = node.outputs[0]
    b.add("Slice", [b.value(node.inputs[0]), b.ints([a["start"]], f"{out}/starts"), b.ints([a["end"]], f"{out}/ends"),
                    b.ints([a["dim"]], f"{out}/axes"), b.ints([a.get("step") or 1], f"{out}/steps")], out)


@onnx_converter("select")
def _select(b: Builder, node: Node) -> None:
    index = b.scalar(int(node.attrs["index"]), "int64", f"{node.outputs[0]}/index")
    b.add("Gather", [b.value(node.inputs[0]), index], node.outputs[0], axis=int(node.attrs["dim"]))


@onnx_converter("expand")
def _expand(b: Builder, node: Node) -> None:
    # ONNX Expand broadcasts both ways: a 1 keeps the input's size, which is how the dynamic batch (-1) passes.
    shape = [1 if int(d) < 0 else int(d) for d in node.attrs["shape"]]
    b.add("Expand", [b.value(node.inputs[0]), b.ints(shape, f"{node.outputs[0]}/shape")], node.outputs[0])


@onnx_converter("gather")
def _gather(b: Builder, node: Node) -> None:
    x, index = node.inputs
    b.add("GatherElements", [b.value(x), b.cast(b.value(index), "int64")], node.outputs[0],
          axis=int(node.attrs["dim"]))


@onnx_converter("index_select")
def _index_select(b: Builder, node: Node) -> None:
    x, index = node.inputs
    b.add("Gather", [b.value(x), b.cast(b.value(index), "int64")], node.outputs[0], axis=int(node.attrs["dim"]))


@onnx_converter("index")
def _index(b: Builder, node: Node) -> None:
    """``x[i0, i1, ...]`` (advanced indexing, "" = a full slice) as Transpose -> GatherND -> Transpose."""
    x, indices = node.inputs[0], node.inputs[1:]
    out = node.outputs[0]
    rank, out_rank = b.rank(x), b.rank(out)
    positions = [d for d, name in enumerate(indices) if name]
    if rank is None or out_rank is None or not positions:
        raise b.error(node, "unknown ranks or no index tensor", "Export again; every value should carry a shape.")
    if any(b.dtype(indices[d]) in ("bool", "uint8") for d in positions):
        raise b.error(node, "boolean mask indexing (data-dependent output shape)",
                      "Use torch.where or multiply by the mask instead of x[mask].")
    rest = [d for d in range(rank) if d not in positions]
    perm = positions + rest
    xv = b.value(x)
    if perm != list(range(rank)):
        xv = b.add("Transpose", [xv], f"{out}/front", perm=perm, dtype=b.dtype(x), rank=rank)
    idx = [b.cast(b.value(indices[d]), "int64") for d in positions]
    if len(idx) > 1:  # broadcast the index tensors against each other: i + 0*j + 0*k ...
        zero = b.scalar(0, "int64", f"{out}/zero")
        total = None
        for i in idx:
            z = b.add("Mul", [i, zero], f"{out}/zeros", dtype="int64")
            total = z if total is None else b.add("Add", [total, z], f"{out}/zeros", dtype="int64")
        idx = [b.add("Add", [i, total], f"{out}/broadcast", dtype="int64") for i in idx]
    axis = b.ints([-1], f"{out}/last")
    stacked = b.add("Concat", [b.add("Unsqueeze", [i, axis], f"{out}/unsqueeze", dtype="int64") for i in idx],
                    f"{out}/indices", axis=-1, dtype="int64")
    n_broadcast = out_rank - len(rest)
    contiguous = positions == list(range(positions[0], positions[0] + len(positions)))
    if contiguous and positions[0] > 0:
        # torch keeps the indexed block in place when the indexed dims are adjacent
        first = positions[0]
        perm2 = [n_broadcast + j for j in range(first)] + list(range(n_broadcast)) + \
                [n_broadcast + j for j in range(first, len(rest))]
        gathered = b.add("GatherND", [xv, stacked], f"{out}/gathered", dtype=b.dtype(x), rank=out_rank)
        b.add("Transpose", [gathered], out, perm=perm2)
    else:
        b.add("GatherND", [xv, stacked], out)


_ONNX_PAD_MODES = {"constant": "constant", "reflect": "reflect", "replicate": "edge"}


@onnx_converter("pad")
def _pad(b: Builder, node: Node) -> None:
    """torch's pad list runs from the last dim backwards as (begin, end) pairs; ONNX wants all begins, then all
    ends, from the first dim."""
    x = b.value(node.inputs[0])
    rank = b.rank(node.inputs[0])
    pad = [int(p) for p in node.attrs["pad"]]
    begins, ends = [0] * rank, [0] * rank
    for i in range(len(pad) // 2):
        begins[rank - 1 - i], ends[rank - 1 - i] = pad[2 * i], pad[2 * i + 1]
    out = node.outputs[0]
    inputs = [x, b.ints(begins + ends, f"{out}/pads")]
    if node.attrs["mode"] == "constant":
        inputs.append(b.scalar(float(node.attrs["value"]), b.dtype(node.inputs[0]) or "float32", f"{out}/value"))
    b.add("Pad", inputs, out, mode=_ONNX_PAD_MODES[node.attrs["mode"]])


@onnx_converter("pixel_shuffle", "pixel_unshuffle")
def _pixel_shuffle(b: Builder, node: Node) -> None:
    """``pixel_shuffle`` is ``DepthToSpace(CRD)``; ``pixel_unshuffle`` (no ONNX op: ``SpaceToDepth`` is the DCR
    order) is ``Reshape [N, C, H, r, W, r] -> Transpose [0, 1, 3, 5, 2, 4] -> Reshape [N, C·r·r, H, W]``."""
    x, out = node.inputs[0], node.outputs[0]
    shape = b.shape(x)
    if shape is None or len(shape) != 4 or any(d < 0 for d in shape[1:]):
        raise b.error(node, f"input shape {shape}", "Use a 4-D input with static channel and spatial sizes.")
    if node.op == "pixel_shuffle":
        b.add("DepthToSpace", [b.value(x)], out, blocksize=int(node.attrs["upscale_factor"]), mode="CRD")
        return
    r = int(node.attrs["downscale_factor"])
    n, c, h, w = shape
    dtype = b.dtype(x)
    split = b.add("Reshape", [b.value(x), b.ints([n, c, h // r, r, w // r, r], f"{out}/split_shape")],
                  f"{out}/split", dtype=dtype, rank=6)
    moved = b.add("Transpose", [split], f"{out}/moved", perm=[0, 1, 3, 5, 2, 4], dtype=dtype, rank=6)
    b.add("Reshape", [moved, b.ints([n, c * r * r, h // r, w // r], f"{out}/shape")], out)


@onnx_converter("flip")
def _flip(b: Builder, node: Node) -> None:
    """``Slice`` with step -1 over every flipped dim (starts -1, ends the most negative int64)."""
    dims = [int(d) for d in node.attrs["dims"]]
    out = node.outputs[0]
    if not dims:
        b.add("Identity", [b.value(node.inputs[0])], out)
        return
    b.add("Slice", [b.value(node.inputs[0]), b.ints([-1] * len(dims), f"{out}/starts"),
                    b.ints([-(2**63)] * len(dims), f"{out}/ends"), b.ints(dims, f"{out}/axes"),
                    b.ints([-1] * len(dims), f"{out}/steps")], out)


@onnx_converter("select_scatter", "slice_scatter")
def _scatter(b: Builder, node: Node) -> None:
    """``x[..., i, ...] = src`` as a concat of x's slices before and after the written range and src (step 1)."""
    x, src = node.inputs
    a = node.attrs
    dim, out = int(a["dim"]), node.outputs[0]
    size = b.shape(x)[dim]
    if node.op == "select_scatter":
        start, end = int(a["index"]), int(a["index"]) + 1
        src_v = b.add("Unsqueeze", [b.value(src), b.ints([dim], f"{out}/axis")], f"{out}/src", dtype=b.dtype(src))
    else:
        if (a.get("step") or 1) != 1:
            raise b.error(node, "a strided slice write", "Write contiguous slices (step 1).")
        start, end, src_v = int(a["start"]), int(a["end"]), b.value(src)
    parts = []
    for lo, hi, tag in ((0, start, "before"), (end, size, "after")):
        if hi > lo:
            piece = b.add("Slice", [b.value(x), b.ints([lo], f"{out}/{tag}_s"), b.ints([hi], f"{out}/{tag}_e"),
                                    b.ints([dim], f"{out}/{tag}_a")], f"{out}/{tag}", dtype=b.dtype(x))
            parts.append((tag, piece))
    pieces = [p for t, p in parts if t == "before"] + [src_v] + [p for t, p in parts if t == "after"]
    b.add("Concat", pieces, out, axis=dim)
