"""Developer tools run as ``python -m k3c.tools.<name>``; nothing in the package imports them."""
