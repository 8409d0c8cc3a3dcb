"""rill.demo"""
