"""GPU volunteers on home links holding pipeline stages, the card emulated (issue 55)."""
