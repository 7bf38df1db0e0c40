"""The one exception type the CLI turns into a one-line message and a non-zero exit."""


class K3Error(Exception):
    """Bad input or a failed step; the message names the problem (a tensor, a file, a field)."""
