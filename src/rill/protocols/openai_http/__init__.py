"""OpenAI-compatible HTTP API: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

``messages`` holds the wire structs, ``codec`` turns request bodies into
``GenerateRequest``s and errors into OpenAI's error JSON, ``session`` turns engine outputs
into response bodies and SSE chunks (all three pure), and ``adapter`` is the Starlette glue
that talks to the engine client and watches for client disconnects.
"""
