"""weightsync core: layouts, adapters, merge, bucketing, transports, engines, API and CLI."""
