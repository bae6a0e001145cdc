"""Monitoring: metrics files and sinks."""
