"""Test helpers shipped with the package: offline random-init checkpoints (``checkpoints``) and
fault injection into a live engine (``faults``).

Nothing here is imported by the server; ``transformers`` is needed only when a helper runs.
"""
