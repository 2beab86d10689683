"""The web front server: serves the chat page and forwards the OpenAI API, /stats and health to the engine.

It holds the engine's API key (so the page never does), streams SSE through chunk by chunk, and closes the
upstream request the moment the browser goes away so the engine stops generating. aiohttp only: this process
must start in a fraction of a second and never import torch or the engine.
"""
