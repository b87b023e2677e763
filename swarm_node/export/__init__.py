"""Turning stage checkpoints into one model: Hugging Face export and text sampling."""
