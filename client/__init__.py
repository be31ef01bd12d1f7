"""kvturn.client."""
