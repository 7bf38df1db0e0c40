"""Orchestration the CLI delegates to: build a bundle, validate it, benchmark."""
