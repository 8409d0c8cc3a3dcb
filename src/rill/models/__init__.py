"""rill.models"""
