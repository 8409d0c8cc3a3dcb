"""rill.engine"""
