"""Ferry wire protocol: torch-free models, codec, key names and a client."""
