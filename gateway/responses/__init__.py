"""OpenAI's Responses API (``/v1/responses``) on top of chat generation.

A Responses request is translated into a chat request (requests.py: items -> messages, function tools,
``text.format`` -> structured outputs, vLLM's extra sampling fields) and served by the same path as chat
completions: every backend kind, routing, limits, retries. Its chunks are written back as a Response object or
as the Responses API's typed events (encoding.py). Stored responses (store.py: in memory, or in Redis shared by
gateway replicas) carry the conversation for ``previous_response_id`` and the deployment that answered, so the
next turn is routed to the replica whose KV cache holds it (service.py).
"""
