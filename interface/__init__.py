"""Orchestration the CLI delegates to: build a bundle, validate it, benchmark."""

# The longest prompt one prefill call takes unless told otherwise (``--max-prompt``): the validation
# prompt (build.PROMPT_LEN, 600 tokens) fits in one call with room to spare.
DEFAULT_MAX_PROMPT = 1024
