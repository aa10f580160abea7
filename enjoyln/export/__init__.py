"""Export of folded models to other formats (ONNX)."""
