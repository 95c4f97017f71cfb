"""OpenAI-compatible HTTP front end (aiohttp, SSE). It arrives with the serving pipeline."""
