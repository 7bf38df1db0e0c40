"""iree-compile: the target table, its flags, and the devices this host has."""
