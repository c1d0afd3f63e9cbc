"""Command-line adapters for tools run remotely through KCoral."""
