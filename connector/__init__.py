"""kvturn.connector."""
