"""The engine: requests in, token streams out, one propose-verify-accept step at a time."""
