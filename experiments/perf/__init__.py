"""Speed, overhead, scale and multi-device measurements (scripts that print numbers)."""
