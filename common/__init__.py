"""The bottom layer: what every service shares.

OpenAI wire models and errors, SSE, chat rendering, the server runtime, model loading, process helpers.
Imports nothing of the project's own above it.
"""
