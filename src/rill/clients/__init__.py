"""rill.clients"""
