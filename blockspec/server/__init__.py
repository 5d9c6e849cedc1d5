"""The OpenAI-compatible HTTP server (`blockspec serve`): FastAPI app, one engine worker thread,
SSE streaming, auth, /metrics. Entry points: args.add_serve_parser / args.run_serve, app.create_app."""
