"""ONNX-facing layer: loading, canonicalization, the frozen Graph view and the OpKind table."""
