"""The wire shapes the sidecar serves beside Chat Completions, a folder per wire."""
