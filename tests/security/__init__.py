"""Hostile input, bad configurations, grants and secure defaults."""
