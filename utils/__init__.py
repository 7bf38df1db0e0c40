"""Helpers shared by every layer of k3c (files, hashes); they import nothing else from k3c."""
