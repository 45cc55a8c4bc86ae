"""Small scripts that measure the code: its size, and what a change did to its results."""
