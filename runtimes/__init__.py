"""runtimes: IREE runtime sessions that load a bundle on a device and run it."""
