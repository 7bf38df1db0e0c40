"""The entry points of a compiled K3 module (docs/pipeline.md §2), in the order export writes them.
Every module has ``prefill`` and ``decode``; the torch front end adds ``extend`` (a prompt's later
pieces), which the ONNX front end does not export."""
ENTRY_POINTS = ("prefill", "extend", "decode")
REQUIRED = ("prefill", "decode")
