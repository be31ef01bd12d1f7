"""kvturn.gateway."""
