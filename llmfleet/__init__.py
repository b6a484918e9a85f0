"""The `llmfleet` command line: one entry point for the fleet's parts."""
