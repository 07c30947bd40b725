"""Runtime adapters: turn a runtime's own notion of requests into lifecycle records."""
