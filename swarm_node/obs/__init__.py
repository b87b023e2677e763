"""Observability: logging set-up and progress display."""
