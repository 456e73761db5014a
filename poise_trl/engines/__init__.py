"""Generation engines: transformers and vLLM (colocated or as a server)."""
