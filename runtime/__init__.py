"""Engine runtime: configuration, logging and the command line (models and kernels come later)."""
