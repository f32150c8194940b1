"""One module per API surface, as vLLM keeps one serving class per API: each converts its request into the shared
planning and forwarding path (``gateway.serving``) and the backend's answers back into its own shape."""
