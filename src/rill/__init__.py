"""rill: a streaming LLM inference server. One engine, many wire protocols."""

__version__ = "0.1.0"
