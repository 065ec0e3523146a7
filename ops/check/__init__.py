"""Offline checks of ops/terraform and configs/ that need no terraform binary (run: python -m ops.check)."""
