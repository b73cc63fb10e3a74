"""The OpenAI wire format (with vLLM's extensions), one module per direction:

- ``requests``: the request bodies, validated and turned into ``GenerationRequest``s;
- ``encoding``: what the backends stream (``GenerationChunk``s) written out as OpenAI's JSON bodies and
  server-sent events;
- ``schemas``: the answers as pydantic models, for the OpenAPI document and the fuzz suite only.
"""
