"""Connectors that end a rayflow stream: print, collect, files, S3, PostgreSQL."""
