"""The run's record: the typed result (`result`), decision.json, and every rendering of it
(markdown, html, junit, prometheus, the webhook's POST, the log line `submit` reads), with the
redaction and the atomic writes they share. Renderers take the typed record, never the store.
"""
