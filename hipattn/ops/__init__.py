"""Launchers: one module per kernel family group, turning a validated Problem into launches."""
