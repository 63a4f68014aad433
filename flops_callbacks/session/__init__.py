"""The step session below both callbacks: the profile window, the result it builds, the throughput meter."""
