"""Quantized checkpoints: what they declare (config), how they store it (formats), and putting them
into a model (apply). The in-memory layouts live in models/layers/quant_linear.py."""

from blockspec.loader.quant.apply import QuantLoader, deferred_linears, finalize_quantized, quantize_model
from blockspec.loader.quant.config import LayerScheme, QuantConfig, check_flag, detect_quantization

__all__ = ["LayerScheme", "QuantConfig", "QuantLoader", "check_flag", "deferred_linears", "detect_quantization",
           "finalize_quantized", "quantize_model"]
