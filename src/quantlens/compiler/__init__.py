"""Compiler stage: export a QAT model to the qat IR, convert it to the integer IR, save, load, ONNX."""

from quantlens.compiler.convert import convert
from quantlens.compiler.export import export
from quantlens.compiler.ir import Graph, Module, Node
from quantlens.compiler.onnx import to_onnx
from quantlens.compiler.serialize import load, save

__all__ = ["export", "convert", "Module", "Graph", "Node", "save", "load", "to_onnx"]
