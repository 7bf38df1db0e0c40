"""runtimes: targets, iree-compile, and IREE runtime sessions that run and validate a bundle."""
