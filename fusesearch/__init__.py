"""fusesearch."""
