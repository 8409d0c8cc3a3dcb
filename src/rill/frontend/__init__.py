"""rill.frontend"""
