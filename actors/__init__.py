"""Actor processes of the pipeline and the supervisor that owns their lives."""
