"""numba-compiled CPU kernels (``cache=True``); torch-op twins live beside each codec."""
