"""Test helpers shipped with the package: offline random-init checkpoints (``checkpoints``).

Nothing here is imported by the server; ``transformers`` is needed only when a helper runs.
"""
