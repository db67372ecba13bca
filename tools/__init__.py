"""Maintenance scripts of the repository (not part of the pdproxy package)."""
