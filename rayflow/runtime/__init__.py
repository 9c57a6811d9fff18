"""The runtime: subtask actors, channels, operators and the job master (private)."""
