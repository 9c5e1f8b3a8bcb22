"""What the daemon keeps in SQLite: the request log and the API keys."""
