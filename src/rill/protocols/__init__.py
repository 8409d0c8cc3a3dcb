"""rill.protocols"""
