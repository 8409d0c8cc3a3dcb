"""The browser playground served at ``GET /`` (see ``routes``).

A static page (``static/``: HTML, CSS and one script, no build step, no CDN) that drives
``/generate`` over WebSocket and plots ``/metrics``. It imports no protocol internals: the
page speaks the public wire formats like any other client.
"""
