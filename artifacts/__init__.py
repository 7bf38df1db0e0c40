"""artifacts: the bundle (manifest, module, parameters, reference outputs), written atomically, verified on open."""
