"""Compiler stage: export a QAT model to the qat IR, convert it to the integer IR, save, load, ONNX."""

from quantlens.compiler.export import export
from quantlens.compiler.convert import convert
from quantlens.compiler.ir import Graph, Module, Node

__all__ = ["export", "convert", "Module", "Graph", "Node"]
