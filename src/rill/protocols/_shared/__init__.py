"""rill.protocols._shared"""
